"""``flatfsdp checkpoint convert --from torch_dist --to fsdp_dtensor``: Megatron-Core's torch_dist
checkpoint (tensor/pipeline/data-parallel runs) as the fsdp_dtensor checkpoint a Megatron-FSDP
run of Megatron-LM resumes from, in one process, on any machine, without Megatron installed.

What goes where: torch_dist_plan.py. How it is written:

* **One box at a time.** The output is saved by DCP from a state dict of meta
  placeholders; when DCP's writer asks for an entry's data, that box alone is
  read from the source (foreign_read.py). Peak memory is about the largest
  tensor, not the model.
* **Atomic, and never over anything.** ``OUT`` must not exist (or be an empty
  folder). Everything is written into ``OUT.partial-<token>`` beside it -- the
  ``iter_*`` folder with DCP's files and a flatfsdp manifest of their sha256,
  then ``latest_checkpointed_iteration.txt`` -- fsynced, and renamed to ``OUT``
  in one step. Interrupted anywhere, ``OUT`` does not exist (an exception
  removes the partial folder; a killed process leaves it, under its own name,
  which nothing reads as a checkpoint). The source is only read.
* **Nothing from the source runs.** Pickled values are carried inertly
  (Note [inert unpickling]) and written back as the same objects.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from flatfsdp.checkpoint import inert_pickle, megatron_layout, torch_dist_plan
from flatfsdp.checkpoint.atomic import fsync_path
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.foreign_read import ForeignCheckpoint
from flatfsdp.checkpoint.manifest import write_manifest


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that a placeholder's data is read from the source when
    written, and pickled values are written by the inert pickler."""

    def __init__(self, source: ForeignCheckpoint, plan: torch_dist_plan.Plan):
        super().__init__()
        self._source, self._sources = source, plan.sources

    def resolve_data(self, write_item):
        found = self._sources.get(write_item.index.fqn)
        if found is None:
            return super().resolve_data(write_item)
        region, shape = found
        return self._source.read_regions([region])[0].reshape(shape)

    def transform_object(self, write_item, obj):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(inert_pickle.dumps(obj))
        return obj


def _check_target(out: str, source: megatron_layout.CheckpointPath) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"{out} exists and is not an empty directory: will not write over it")
    for inside in (source.directory, source.root):
        if inside and (out == inside or out.startswith(inside + os.sep)):
            raise CheckpointError(f"{out} is inside the checkpoint being converted ({inside}): choose another folder")


def _write(source: ForeignCheckpoint, plan: torch_dist_plan.Plan, partial: str) -> str:
    name = "release" if plan.iteration == "release" else f"iter_{int(plan.iteration):07d}"
    folder = os.path.join(partial, name)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        try:
            dcp.save(plan.state_dict, storage_writer=FileSystemWriter(folder, thread_count=1, sync_files=True),
                     planner=_StreamingSavePlanner(source, plan), no_dist=True)
        except CheckpointException as exc:  # DCP wraps every error of its phases: raise ours plainly
            cause = next(iter(exc.failures.values()))[0]
            if isinstance(cause, (CheckpointError, OSError)):
                raise cause from None
            raise CheckpointError(f"writing {folder} failed: {type(cause).__name__}: {cause}") from None
    write_manifest(folder)
    tracker = os.path.join(partial, megatron_layout.TRACKER_NAME)
    with open(tracker, "w", encoding="utf-8") as f:
        f.write(str(plan.iteration))
        f.flush()
        os.fsync(f.fileno())
    for path in (folder, partial):
        fsync_path(path)
    return name


def convert_torch_dist_to_fsdp_dtensor(source, out, *, transformer_impl: str | None = None,
                                       swiglu: bool | None = None, model_only: bool = False) -> dict:
    """Write the torch_dist checkpoint at ``source`` (a ``--save`` folder or an ``iter_*`` folder)
    as a Megatron-LM fsdp_dtensor checkpoint folder ``out`` (``--load out``). ``transformer_impl``
    (``local`` / ``transformer_engine``) and ``swiglu`` override what the run's saved arguments say;
    ``model_only`` writes the weights without optimizer state. Returns a report."""
    located = megatron_layout.locate(source)
    found = megatron_layout.checkpoint_format(located.directory)
    if found != "torch_dist":
        checkpoint = ForeignCheckpoint(located.directory, check_files=False) if found in ("dcp", "flatfsdp") else None
        names = checkpoint.entries if checkpoint is not None else None
        found = megatron_layout.checkpoint_format(located.directory, names)
        raise megatron_layout.wrong_format(located.directory, found, "torch_dist",
                                           "it needs no conversion" if found == "fsdp_dtensor" else "")
    out = os.path.abspath(os.fspath(out))
    _check_target(out, located)
    src = ForeignCheckpoint(located.directory)
    plan = torch_dist_plan.build(src, transformer_impl=transformer_impl, swiglu=swiglu, model_only=model_only)
    if located.iteration is not None and located.iteration != plan.iteration:
        raise CheckpointError(f"{located.directory} holds iteration {plan.iteration}, not {located.iteration} "
                              "as its folder name or tracker file says (a mixed-up checkpoint?)")
    partial = f"{out}.partial-{uuid.uuid4().hex[:12]}"
    os.makedirs(partial)
    try:
        name = _write(src, plan, partial)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, checked above
        os.rename(partial, out)
        fsync_path(os.path.dirname(out))
    finally:
        if os.path.exists(partial):
            shutil.rmtree(partial)
    return {"source": located.directory, "output": os.path.join(out, name), "iteration": plan.iteration,
            "tensors": len(plan.sources), **plan.report}
