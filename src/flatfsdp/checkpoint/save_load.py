"""`save` and `load`: DCP with atomic publication, a manifest, and checked loading.

See Note [the phases of a save] (save_job.py), Note [async saves]
(async_save.py), Note [atomic checkpoint directories] (atomic.py) and Note
[checkpoint pickles] (safe_read.py).
"""

from __future__ import annotations

import contextlib
import warnings

import torch.distributed.checkpoint as dcp
from torch.profiler import record_function

from flatfsdp.checkpoint import atomic, manifest
from flatfsdp.checkpoint.async_save import AsyncSave, start_async_save, wait_for_saves_in_flight
from flatfsdp.checkpoint.compare import mismatch_report
from flatfsdp.checkpoint.coordination import Coordination
from flatfsdp.checkpoint.errors import CheckpointError, unwrap_dcp_errors
from flatfsdp.checkpoint.safe_read import METADATA_NAME, SafeLoadPlanner, VerifiedReader
from flatfsdp.checkpoint.save_job import SaveJob
from flatfsdp.checkpoint.staging import StagingBuffers


@contextlib.contextmanager
def quiet_no_dist(coordination: Coordination):
    """DCP warns when run without a process group; that is a supported mode here."""
    with warnings.catch_warnings():
        if not coordination.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(state_dict: dict, directory, *, process_group=None, no_dist: bool = False,
         async_save: bool = False, staging: StagingBuffers | None = None) -> AsyncSave | None:
    """Save ``state_dict`` (DTensors, tensors, plain values) as a DCP checkpoint at
    ``directory``, replacing a previous one atomically. Collective over
    ``process_group`` (default: the world) when one is initialised, unless
    ``no_dist`` (this process alone writes the whole checkpoint). Refuses a
    ``directory`` that exists and is neither a checkpoint nor empty.

    Waits first for any save of this process still in flight. ``async_save``:
    return once this rank's share is copied to host memory, with an
    `AsyncSave` whose ``wait()`` (collective) publishes the checkpoint after
    the background write; see Note [async saves]. ``staging``: host memory
    to copy into, kept from one async save to the next (`StagingBuffers`)."""
    co = Coordination(process_group, no_dist=no_dist)
    wait_for_saves_in_flight()
    with record_function("flatfsdp::checkpoint_save"):
        if async_save:
            return start_async_save(state_dict, directory, co, staging)
        job = SaveJob(state_dict, directory, co, stage=False)
        job.write()
        job.commit()
    return None


def check_save_target(directory) -> None:
    """Raise CheckpointError now if `save` to ``directory`` would be refused (it
    is a file, or a folder that is not a checkpoint) or cannot be written: lets
    a program check before it spends hours producing what it wants to save."""
    atomic.check_replaceable(atomic.normalize(directory))


def open_checkpoint(directory, co: Coordination | None = None, *, hashes: bool = True) -> VerifiedReader:
    """A reader for a complete, verified checkpoint. Collective when ``co`` is
    distributed: each rank hashes its share of the files and every rank raises the
    first problem found. Without ``co`` this process works alone."""
    directory = atomic.normalize(directory)
    co = co or Coordination(no_dist=True)
    co.run_on_coordinator(lambda: atomic.recover(directory))
    files, error = {}, None
    try:
        files = manifest.read_manifest(directory)
        if METADATA_NAME not in files:
            raise CheckpointError(f"{directory} is not a DCP checkpoint: {METADATA_NAME} is not in its manifest")
        # .metadata is hashed by the reader itself, on the very bytes it unpickles.
        mine = sorted(n for n in files if n != METADATA_NAME)[co.rank::co.world]
        manifest.verify_files(directory, files, mine, hashes=hashes)
    except CheckpointError as exc:
        error = str(exc)
    co.raise_first(error)
    return VerifiedReader(directory, files[METADATA_NAME]["sha256"], listed=frozenset(files))


def load(state_dict: dict, directory, *, process_group=None, no_dist: bool = False, strict: bool = True,
         verify_data: bool = True) -> None:
    """Load a checkpoint written by `save` into ``state_dict`` in place (DCP
    semantics: DTensors reshard to the caller's placements).

    Refuses directories without a manifest and files whose size or sha256 differ
    from it (``verify_data=False`` checks sizes only, skipping the full read);
    raises one CheckpointError listing missing/unexpected/mismatched entries.
    Collective like `save`; ``no_dist`` loads in this process alone.
    """
    co = Coordination(process_group, no_dist=no_dist)
    with record_function("flatfsdp::checkpoint_load"):
        reader = open_checkpoint(directory, co, hashes=verify_data)
        report = mismatch_report(state_dict, reader.read_metadata(), strict=strict)
        if report:
            raise CheckpointError(f"checkpoint {atomic.normalize(directory)} does not match the state dict "
                                  f"being loaded:{report}")
        with quiet_no_dist(co), unwrap_dcp_errors():
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict),
                     process_group=process_group, no_dist=not co.distributed)
