"""Memory and traffic per rank of any model at any world size, from the engine
itself: `flatfsdp estimate` (docs/scale.md)."""

from flatfsdp.estimator.estimate import estimate, estimate_layout
from flatfsdp.estimator.models import resolve_model
from flatfsdp.estimator.rank_step import Layout, RankFigures

__all__ = ["Layout", "RankFigures", "estimate", "estimate_layout", "resolve_model"]
