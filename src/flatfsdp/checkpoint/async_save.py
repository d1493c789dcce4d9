"""Saves whose files are written while training goes on.

Note [async saves]
``save(..., async_save=True)`` runs phase 1 of Note [the phases of a save]
(save_job.py) on the caller's thread -- the refusals, the plan, and a copy of
this rank's share in host memory -- and returns an `AsyncSave` once the copy
has landed. Phase 2 (writing, fsyncing and hashing the files) runs on a
background thread. That thread issues no collective: training's own
collectives on the same group would otherwise interleave with it in an order
the ranks need not agree on. Phase 3, the one that needs the ranks to agree
(every rank's files are there; rank 0 writes metadata and manifest and swaps
the directory in), runs on the caller's thread in `AsyncSave.wait()`, which
every rank calls: explicitly, or implicitly when the next `save` starts.

A thread, not a process: the staged copy is shared without another copy,
and a process would need the state pickled across. File writes, fsync and
sha256 release the GIL; DCP's per-tensor serialisation holds it in part.
What the training loop still feels is measured in docs/checkpoints.md.

What can happen meanwhile:

* the process dies (kill -9, OOM, power): nothing was published, ``DIR``
  still holds the previous checkpoint, and ``DIR.tmp-<token>`` has no
  manifest, so nothing loads it; the next save removes it;
* the write fails (disk full) on any rank: `wait()` raises that rank's error
  as CheckpointError on every rank, and ``DIR`` keeps the previous one;
* another save starts: it first waits for (publishes) every save this
  process has in flight, in the order they started, which all ranks share;
* Ctrl-C (KeyboardInterrupt) inside `wait()`: raised as usual; the write is
  abandoned, with the same outcome as a crash (``DIR`` untouched);
* the program ends without `wait()`: the checkpoint is not published (a
  publication needs every rank), and a line on stderr says so at exit.

The saves in flight are kept in a module-level list -- the one piece of
process-wide state in flatfsdp.checkpoint -- because their threads are
process-wide too: a `save` must find every unfinished one to keep two saves
from sharing a directory, whoever holds (or dropped) their handles.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import threading

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.save_job import SaveJob
from flatfsdp.checkpoint.staging import StagingBuffers

_in_flight: list["AsyncSave"] = []
_in_flight_lock = threading.Lock()


class AsyncSave:
    """What ``save(..., async_save=True)`` returns: the save in flight."""

    def __init__(self, job: SaveJob):
        self._job = job
        self._waited = False
        self._error: str | None = None
        self.directory = job.directory
        self.staged_bytes = job.staged_bytes
        """Bytes this rank copied to host memory for the write."""
        self._thread = threading.Thread(target=job.write, name="flatfsdp-checkpoint-write", daemon=True)
        with _in_flight_lock:
            _in_flight.append(self)
        atexit.register(self._report_unwaited)
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's background work has ended: before `wait`, its
        write (files written and hashed, or failed); after ``wait(...,
        remove_old_in_background=True)``, the deletion of the replaced
        checkpoint. Local and cheap; the checkpoint is published by `wait`."""
        return not self._thread.is_alive()

    def wait(self, *, remove_old_in_background: bool = False) -> None:
        """Collective over the save's group: wait for this rank's write, then
        publish the checkpoint on every rank -- or raise the first rank's error
        (CheckpointError) on every rank. Later calls return, or raise the same
        error, at once.

        The checkpoint it replaces is deleted before returning, or with
        ``remove_old_in_background`` by a thread on rank 0 (deleting a large
        directory takes a tenth of a second or more, all of it training's
        otherwise). The next save, `wait_for_saves_in_flight`, or ``wait()``
        without the flag waits for that deletion."""
        if not self._waited:
            self._thread.join()
            try:
                old = self._job.commit(remove_old=False)
                if old is not None:
                    self._thread = threading.Thread(target=shutil.rmtree, args=(old, True),
                                                    name="flatfsdp-checkpoint-cleanup", daemon=True)
                    self._thread.start()
            except CheckpointError as exc:
                self._error = str(exc)
            except Exception as exc:  # a collective failed (a rank died): raise it, and remember it
                self._error = f"publishing {self.directory} failed: {type(exc).__name__}: {exc}"
                raise
            finally:
                self._waited = True
                self._job = None
                atexit.unregister(self._report_unwaited)
        if not remove_old_in_background:
            self._thread.join()
            with _in_flight_lock:
                if self in _in_flight:
                    _in_flight.remove(self)
        if self._error is not None:
            raise CheckpointError(self._error)

    def _report_unwaited(self) -> None:
        state = "its write had finished" if self.done() else "its write was still running"
        print(f"flatfsdp.checkpoint: the async save to {self.directory} was never waited for ({state}), so it was "
              f"not published; {self.directory} keeps the checkpoint it held. Call .wait() on what "
              "save(..., async_save=True) returns.", file=sys.stderr, flush=True)


def wait_for_saves_in_flight() -> None:
    """Publish (or raise the error of) every save this process has in flight,
    oldest first. Collective like `AsyncSave.wait`."""
    while True:
        with _in_flight_lock:
            oldest = _in_flight[0] if _in_flight else None
        if oldest is None:
            return
        oldest.wait()


def start_async_save(state_dict: dict, directory, co, staging: StagingBuffers | None = None) -> AsyncSave:
    """Phase 1 here, phase 2 in the background (Note [async saves])."""
    return AsyncSave(SaveJob(state_dict, directory, co, stage=True, buffers=staging))
