"""Ctrl-C as a request, not an exception.

A KeyboardInterrupt raised wherever Python happens to be could leave one rank
inside a collective its peers never enter, and the job hangs or dies without a
checkpoint. The handler only sets a flag; the training loop reads it at step
boundaries, all ranks agree on it in their per-step all-reduce, and they save
and stop together. The handler never escalates: a terminal's Ctrl-C reaches
every rank *and* the launcher (which forwards it), so one key press can arrive
twice. To abort without saving, press Ctrl-C again in the launching terminal:
the launcher, not the ranks, counts presses (see flatfsdp.launch).
"""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """Set by SIGINT (or by ``request()``); installed for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def request(self, *_args) -> None:
        self.requested = True

    def __enter__(self) -> "StopRequest":
        # signal.signal works only in the main thread; elsewhere (a test driving
        # the loop from a thread) the flag can still be set by request().
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self.request)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
