"""The one exception type the checkpoint layer raises for bad checkpoints."""

from __future__ import annotations

import contextlib

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or does not match the request.

    The message is a single human-readable paragraph that names the offending
    directory or file, so command-line tools can print it as is.
    """


@contextlib.contextmanager
def unwrap_dcp_errors():
    """DCP wraps every rank's exception in a CheckpointException (a BaseException
    carrying all tracebacks); when the cause is one of ours, raise it plainly."""
    try:
        yield
    except CheckpointException as exc:
        ours = [e for e, _trace in exc.failures.values() if isinstance(e, CheckpointError)]
        if ours:
            raise CheckpointError(str(ours[0])) from None
        raise


def weights_only_reason(exc: BaseException) -> str:
    """The informative line of torch.load's long weights_only refusal."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else repr(exc))
