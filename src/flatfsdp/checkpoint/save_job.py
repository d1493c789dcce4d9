"""One checkpoint save, in the three phases that let its write run in the background.

Note [the phases of a save]
Every save, synchronous or not, runs these phases; an async save only runs
the middle one on another thread (Note [async saves], async_save.py).

1. ``SaveJob(...)`` -- collective, on the caller's thread. Rank 0 picks the
   token and prepares ``DIR.tmp-<token>`` (recover, refuse a user's file or
   folder, remove our leftovers: Note [only our own files]); the ranks agree
   on DCP's save plan (plans gathered to rank 0, the deduplicated global plan
   and its metadata made there, each rank's share scattered back); an async
   save then stages this rank's share in host memory.
2. ``write()`` -- local, any thread, no collective. DCP writes this rank's
   files (fsynced); the rank reads them back and hashes them for the
   manifest. Errors are kept, not raised: they travel in phase 3.
3. ``commit()`` -- collective, on the caller's thread. The ranks' outcomes
   are gathered to rank 0, which writes DCP's ``.metadata``, then the
   manifest (last, fsynced), and publishes the directory (Note [atomic
   checkpoint directories]); its success or the first rank's error reaches
   every rank.

This is DCP's own save sequence (``torch.distributed.checkpoint.save`` with
its default planner and ``FileSystemWriter``) cut at the two points where it
communicates, so that the part in between can run while training issues
collectives of its own on the same group.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from flatfsdp.checkpoint import atomic, manifest
from flatfsdp.checkpoint.coordination import Coordination
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.staging import StagingBuffers, StagingSavePlanner, layout_signature


def _writer(path: str) -> dcp.FileSystemWriter:
    # sync_files: every data file is fsynced before DCP reports it written, so
    # the manifest (written after) never describes bytes still in page cache.
    return dcp.FileSystemWriter(path, sync_files=True)


def _plain(state_dict: dict) -> dict:
    """Top-level Stateful objects replaced by their state_dict(), as dcp.save does."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


class SaveJob:
    """Phase 1 runs in the constructor; see Note [the phases of a save]."""

    def __init__(self, state_dict: dict, directory, co: Coordination, *, stage: bool,
                 buffers: StagingBuffers | None = None):
        self.directory = atomic.normalize(directory)
        self.co = co
        self.token = co.broadcast(atomic.new_token() if co.is_coordinator else None)
        self.tmp = atomic.temp_path(self.directory, self.token)
        co.run_on_coordinator(self._prepare)
        self.writer = _writer(self.tmp)
        self.planner: StagingSavePlanner | None = StagingSavePlanner()
        self.plan, self.metadata = self._agree_on_plan(_plain(state_dict), buffers if stage else None)
        self.staged_bytes = self.planner.stage(self.plan, buffers) if stage else 0
        self.outcome: tuple[bool, Any] = (False, f"rank {co.rank}: the write of {self.directory} never ran")

    def _prepare(self) -> None:
        atomic.recover(self.directory)
        atomic.check_replaceable(self.directory)  # before anything is deleted: Note [only our own files]
        atomic.remove_leftovers(self.directory)
        os.makedirs(self.tmp)

    def _set_up(self, state_dict: dict) -> tuple[bool, Any]:
        """DCP's planner and writer set up on ``state_dict``: (True, its layout signature) or (False, why not)."""
        try:
            self.planner.set_up_planner(state_dict=state_dict, storage_meta=self.writer.storage_meta(),
                                        is_coordinator=self.co.is_coordinator)
            self.writer.set_up_storage_writer(self.co.is_coordinator, rank=self.co.rank, use_collectives=True)
            return True, layout_signature(self.planner.state_dict)
        except Exception as exc:  # travels to rank 0, which fails every rank with it
            return False, f"rank {self.co.rank}: {type(exc).__name__}: {exc}"

    def _local_plan(self) -> tuple[bool, Any]:
        try:
            return True, self.writer.prepare_local_plan(self.planner.create_local_plan())
        except Exception as exc:
            return False, f"rank {self.co.rank}: {type(exc).__name__}: {exc}"

    def _global_plans(self, local: list[tuple[bool, Any]]) -> tuple[list[tuple[bool, Any]], Any]:
        failed = [value for ok, value in local if not ok]
        if failed:
            return [(False, failed[0])] * self.co.world, None
        try:
            plans, metadata = self.planner.create_global_plan([plan for _, plan in local])
            return [(True, plan) for plan in self.writer.prepare_global_plan(plans)], metadata
        except Exception as exc:
            return [(False, f"rank 0: {type(exc).__name__}: {exc}")] * self.co.world, None

    def _agree_on_plan(self, state_dict: dict, buffers: StagingBuffers | None):
        """This rank's final plan and (rank 0) the checkpoint's metadata. When
        every rank's state dict has the layout of its previous save with the
        same ``buffers``, that save's plan is reused: one tiny all-gather instead
        of building, gathering and deduplicating the plans again."""
        ok, signature = self._set_up(state_dict)
        cached = buffers._cached_plan(signature) if ok and buffers is not None else None
        if all(self.co.gather(cached is not None)):
            plan, metadata = cached
            return self.planner.finish_plan(plan), metadata
        local = self.co.gather_to_coordinator(self._local_plan() if ok else (False, signature))
        per_rank, metadata = self._global_plans(local) if self.co.is_coordinator else (None, None)
        ok, plan = self.co.scatter_from_coordinator(per_rank)
        if not ok:
            raise CheckpointError(f"cannot save a checkpoint to {self.directory}: planning the save failed on {plan}")
        if buffers is not None:
            buffers._remember_plan(signature, plan, metadata)
        return self.planner.finish_plan(plan), metadata

    def write(self) -> None:
        """Phase 2: this rank's files, written, fsynced, read back and hashed.
        No collective; never raises (the outcome is reported by `commit`)."""
        try:
            future = self.writer.write_data(self.plan, self.planner)
            future.wait()
            results = future.value()
            written = {r.storage_data.relative_path for r in results}
            self.outcome = (True, (results, manifest.describe_files(self.tmp, written)))
        except Exception as exc:
            self.outcome = (False, f"rank {self.co.rank} could not write its part of {self.directory}: "
                                   f"{type(exc).__name__}: {exc}")
        finally:
            self.planner = None  # frees the staged copies as soon as they are on disk

    def commit(self, *, remove_old: bool = True) -> str | None:
        """Phase 3: publish the checkpoint, or raise the first rank's error on
        every rank. ``remove_old=False``: the replaced checkpoint is left for
        the caller to delete; rank 0 gets its path (None elsewhere)."""
        outcomes = self.co.gather_to_coordinator(self.outcome)
        old = self.co.run_on_coordinator(lambda: self._publish(outcomes, remove_old))
        return old if self.co.is_coordinator else None

    def _publish(self, outcomes: list[tuple[bool, Any]], remove_old: bool) -> str | None:
        failed = [value for ok, value in outcomes if not ok]
        if failed:
            raise CheckpointError(f"{failed[0]} (nothing was published: {self.directory} keeps what it held)")
        self.writer.finish(metadata=self.metadata, results=[results for _, (results, _files) in outcomes])
        described = {}
        for _, (_results, files) in outcomes:
            described.update(files)
        manifest.write_manifest(self.tmp, described)
        return atomic.publish(self.tmp, self.directory, self.token, remove_old=remove_old)
