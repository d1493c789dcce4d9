"""Memory, traffic and time per rank of any model at any world size, from the
engine itself: `flatfsdp estimate` (docs/scale.md).

The names below resolve on first use (PEP 562): importing a light module of
this package (``devices``, whose names the bench's flags offer) must not pay
for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flatfsdp.estimator.estimate import estimate, estimate_layout
    from flatfsdp.estimator.models import resolve_model
    from flatfsdp.estimator.rank_step import Layout, RankFigures

__all__ = ["Layout", "RankFigures", "estimate", "estimate_layout", "resolve_model"]
_HOMES = {"Layout": "rank_step", "RankFigures": "rank_step", "estimate": "estimate", "estimate_layout": "estimate",
          "resolve_model": "models"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'flatfsdp.estimator' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"flatfsdp.estimator.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
