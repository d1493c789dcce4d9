"""Where a unit is in the step. Transitions are asserted where they happen."""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    IDLE = "idle"
    """Between steps: parameters are the sharded DTensors the optimizer sees."""
    FORWARD = "forward"
    """Inside the unit's forward: parameters are gathered views."""
    PRE_BACKWARD = "pre_backward"
    """Gathered again for the unit's backward (its output gradients arrived)."""
    POST_BACKWARD = "post_backward"
    """Gradients handed to reduction, weights released."""
