"""What every rank runs: build, shard, maybe resume, train, evaluate, save.

All ranks take every decision together: log points, evaluations and saves
follow from the step number, and a stop request (Ctrl-C) is agreed on in the
one all-reduce each step already makes for the loss.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import flatfsdp
from flatfsdp import checkpoint
from flatfsdp.checkpoint import CheckpointError
from flatfsdp.checkpoint.lora_export import LORA_CONFIG_ENTRY
from flatfsdp.data.tokenizer import TokenizerIdentity
from flatfsdp.train import own_data, resume
from flatfsdp.train.interrupt import StopRequest
from flatfsdp.train.memory import gather_memory_mb
from flatfsdp.train.model import build_model, shard
from flatfsdp.train.options import TrainOptions, UsageError, accumulation_steps
from flatfsdp.train.progress import make_progress
from flatfsdp.train.report import finish_report
from flatfsdp.train.runlog import RunLog
from flatfsdp.train.schedule import lr_at
from flatfsdp.train.step import apply_step, eval_loss_sums, forward_backward


def run(o: TrainOptions, token_files=None, tokenizer: TokenizerIdentity | None = None) -> dict:
    """Entry point of every rank (flatfsdp.launch calls it). ``token_files``
    and ``tokenizer``: the token cache and the tokenizer's identity the
    launcher prepared (None: find or make them here).
    Problems the user can fix come back as ``{"error": ...}`` for the launcher to print."""
    try:
        with StopRequest() as stop:
            return Trainer(o, stop, token_files, tokenizer).train()
    except (UsageError, CheckpointError) as exc:
        return {"error": str(exc), "rank": dist.get_rank()}


def rank_device() -> torch.device:
    """CPU under gloo; this rank's accelerator otherwise (launch has set it current)."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def resolve_run_dir(o: TrainOptions) -> str:
    """Rank 0 picks (and creates) the directory; every rank gets its name."""
    name: list = [None]
    if dist.get_rank() == 0:
        path = o.run_dir or time.strftime("runs/%Y%m%d-%H%M%S")
        base, n = path, 1
        while o.run_dir is None and os.path.exists(path):
            path, n = f"{base}-{n}", n + 1
        try:
            os.makedirs(path, exist_ok=True)
            name = [path]
        except OSError as exc:  # every rank fails the same way, none waits for the others
            name = [UsageError(f"--run-dir {path} cannot be created: {exc.strerror or exc}")]
    dist.broadcast_object_list(name, src=0)
    if isinstance(name[0], UsageError):
        raise name[0]
    return name[0]


class Trainer:
    def __init__(self, o: TrainOptions, stop: StopRequest, token_files=None,
                 tokenizer: TokenizerIdentity | None = None):
        self.o, self.stop = o, stop
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = rank_device()
        self.accumulation = accumulation_steps(o, self.world)
        self.tokens_per_step = o.micro_batch_size * self.accumulation * self.world * o.seq_length
        self.run_dir = resolve_run_dir(o)
        if tokenizer is None:  # called directly, not by the command (which prepared both before launching)
            loaded = own_data.tokenizer_for(o)
            tokenizer = TokenizerIdentity.of(loaded)
            token_files = own_data.prepare(o, loaded, show_progress=not o.no_progress, report=self.rank == 0)
        self.tokenizer = tokenizer
        self.data = own_data.open_data(o, token_files)
        built = build_model(o, self.device, self.data.vocab_size)
        self.parameters = sum(p.numel() for p in built.model.parameters())
        self.trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
        self.loss = built.loss
        self.extra_entries = {k: v for k, v in ((checkpoint.HF_CONFIG_ENTRY, built.hf_config),
                                                (LORA_CONFIG_ENTRY, built.lora_config)) if v is not None}
        # Which tokenizer, and its files: --load refuses another, an export writes them beside the weights.
        self.extra_entries.update(checkpoint.companion_entries(tokenizer.record(), tokenizer.files,
                                                               built.hf_generation_config))
        self.model, self.optimizer = shard(built, o)
        self.data_flags = {"seed": o.seed, "global_batch_size": o.micro_batch_size * self.world * self.accumulation,
                           "seq_length": o.seq_length}
        self.first_step = self._maybe_resume()
        self.log = RunLog(os.path.join(self.run_dir, "log.json"), self._config())
        self.losses: list[tuple[int, float]] = []
        self.evals: list[tuple[int, float]] = []
        self.checkpoint: str | None = None
        """The last checkpoint published (an async save counts once its files are all written)."""
        self.pending: PendingSave | None = None
        self.staging = checkpoint.StagingBuffers() if o.async_save else None
        """An async save whose files are being written (--async-save)."""
        self.all_written = False
        """Every rank's background write had ended at the last step's all-reduce."""
        self.skipped: list[int] = []
        """Steps skipped for NaN/inf (--on-nonfinite skip)."""
        self.error: str | None = None
        """Why the run stopped early, for the command to print (None: it did not)."""

    def _config(self) -> dict:
        return {**dataclasses.asdict(self.o), "world_size": self.world, "accumulation_steps": self.accumulation,
                "device": str(self.device), "parameters": self.parameters, "trainable_parameters": self.trainable,
                "resumed_from_step": self.first_step, "tokens_per_step": self.tokens_per_step,
                **self.data.describe(), "tokenizer": self.tokenizer.record()}

    def _maybe_resume(self) -> int:
        if not self.o.load:
            return 0
        info = resume.load(self.o.load, self.model, self.optimizer, self.data_flags, self.device)
        if self.rank == 0:
            changed = ", ".join(f"--{k.replace('_', '-')} {now} (saved with {old})"
                                for k, (old, now) in info["changed"].items())
            note = f"; note: {changed}: the data order differs from the saved run's" if changed else ""
            print(f"resumed from {self.o.load} at step {info['step']}{note}", flush=True)
        return info["step"]

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        o = self.o
        progress = make_progress(o.train_iters, self.first_step, live=self.rank == 0 and not o.no_progress)
        started, stopped = time.perf_counter(), None
        try:
            for step in range(self.first_step + 1, o.train_iters + 1):
                step_started = time.perf_counter()
                loss, interrupted, nonfinite = self._step(step)
                if self.pending and self.all_written:
                    self._publish_pending(progress)
                if nonfinite is None:
                    self._record(step, loss, time.perf_counter() - step_started, progress)
                elif self._nonfinite(step, nonfinite, progress):
                    stopped = "nonfinite"
                    break
                stopped = "interrupt" if interrupted else self._exit_due(step)
                if stopped == "interrupt":
                    self._save(o.save or os.path.join(self.run_dir, "checkpoint"), step, progress, stopped)
                if stopped:
                    break
                self._periodic(step, progress)
            if stopped is None:
                self._at_end(progress)
            elif stopped == "exit_interval" and o.save:
                self._save(o.save, step, progress, stopped)
            self._publish_pending(progress)  # every rank is here: the run ends with its last save published
            checkpoint.wait_for_saves_in_flight()  # and the checkpoints it replaced deleted
        finally:
            progress.close()
        summary = finish_report(self, time.perf_counter() - started, stopped)
        if self.error:
            summary["error"] = self.error
        return summary

    def _nonfinite(self, step: int, report, progress) -> bool:
        """A step whose loss or gradients hold NaN/inf was not applied (the weights
        are still those after the previous step). Returns whether to stop."""
        what = report.describe(step)
        self.log.event(step, f"non-finite: {what}")
        if self.o.on_nonfinite == "skip":
            self.skipped.append(step)
            if self.rank == 0:
                progress.note(f"skipped {what}")
            return False
        self._publish_pending(progress)  # taken before the NaN, from finite weights
        kept = f"; the last checkpoint, {self.checkpoint}, is kept" if self.checkpoint else ""
        self.error = (f"{what}: stopped before the optimizer step, nothing saved{kept} "
                      "(lower --lr, or pass --on-nonfinite skip to skip such steps)")
        return True

    def _exit_due(self, step: int) -> str | None:
        every = self.o.exit_interval
        return "exit_interval" if every and step % every == 0 and step != self.o.train_iters else None

    def _step(self, step: int) -> tuple[float, bool, "flatfsdp.NonFiniteReport | None"]:
        o = self.o
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, o)
        batches = [self.data.micro_batch(step=step, micro=m, rank=self.rank, world=self.world,
                                         micro_batch_size=o.micro_batch_size,
                                         accumulation=self.accumulation).to(self.device)
                   for m in range(self.accumulation)]
        totals = forward_backward(self.model, batches, self.loss, per_token=o.calculate_per_token_loss)
        flag = torch.tensor([1.0 if self.stop.requested else 0.0], dtype=torch.float64, device=self.device)
        bad = flatfsdp.local_nonfinite(self.model, totals[0]).to(self.device, torch.float64).reshape(1)
        written = torch.tensor([1.0 if self.pending and self.pending.handle.done() else 0.0], dtype=torch.float64,
                               device=self.device)
        agreed = torch.cat([totals, flag, bad, written])
        # The one all-reduce of a step: loss sum, token count, how many ranks saw
        # Ctrl-C, how many saw NaN/inf -- before the optimizer step, which a
        # non-finite step must not reach -- and how many finished writing an
        # async save (when all have, it is published after this step).
        dist.all_reduce(agreed)
        loss_sum, tokens, stops, nonfinite, written = agreed.tolist()
        self.all_written = written == self.world
        if nonfinite:
            report = flatfsdp.nonfinite_report(self.model, totals[0])
            self.optimizer.zero_grad(set_to_none=True)
            return loss_sum / tokens, stops > 0, report
        apply_step(self.model, self.optimizer, global_tokens=tokens, per_token=o.calculate_per_token_loss,
                   clip_grad=o.clip_grad)
        return loss_sum / tokens, stops > 0, None

    def _record(self, step: int, loss: float, seconds: float, progress) -> None:
        self.losses.append((step, loss))
        tokens_per_s = self.tokens_per_step / seconds
        self.log.step(step=step, loss=loss, lr=self.optimizer.param_groups[0]["lr"], seconds=round(seconds, 5),
                      tokens_per_s=round(tokens_per_s, 1))
        log_point = step == self.first_step + 1 or step % self.o.log_interval == 0 or step == self.o.train_iters
        memory = gather_memory_mb(self.device) if log_point else None
        if self.rank == 0:
            recent = self.log.record["steps"][-self.o.log_interval:]
            rate = self.tokens_per_step * len(recent) / sum(s["seconds"] for s in recent)
            progress.step(step, loss, recent[-1]["lr"], rate, log_point, memory)
            if log_point:
                self.log.memory(step, memory)
                self.log.write()

    def _periodic(self, step: int, progress) -> None:
        o = self.o
        if o.eval_interval and step % o.eval_interval == 0 and step != o.train_iters:
            self._evaluate(step, progress)
        if o.save and o.save_interval and step % o.save_interval == 0 and step != o.train_iters:
            self._save(o.save, step, progress, "save")

    def _at_end(self, progress) -> None:
        last = self.losses[-1][0] if self.losses else self.first_step
        self._evaluate(last, progress)
        if self.o.save and self.losses:
            self._save(self.o.save, last, progress, "save")

    def _weights_finite(self) -> bool:
        local = [p.to_local() if isinstance(p, DTensor) else p
                 for p in self.model.parameters()]
        total = torch.stack([t.detach().float().sum() for t in local]).sum().reshape(1).to(self.device)
        bad = (~torch.isfinite(total)).float()
        dist.all_reduce(bad)
        return bad.item() == 0

    def _evaluate(self, step: int, progress) -> None:
        batches = [b.to(self.device) for b in self.data.eval_batches(
            count=self.o.eval_iters, rank=self.rank, world=self.world, micro_batch_size=self.o.micro_batch_size)]
        self.model.eval()  # dropout and recompute off (no_grad is set by eval_loss_sums)
        try:
            totals = eval_loss_sums(self.model, batches, self.loss)
        finally:
            self.model.train()
        dist.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        self.evals.append((step, loss))
        self.log.eval(step=step, loss=loss)
        if self.rank == 0:
            progress.note(f"eval at step {step}: held-out loss {loss:.4f}")

    def _save(self, directory: str, step: int, progress, why: str) -> None:
        self._publish_pending(progress)  # one save at a time, in order
        started = time.perf_counter()
        if not self._weights_finite():  # belt and braces: never replace a good checkpoint with NaN
            raise UsageError(f"step {step}: the weights hold NaN/inf; refusing to save them to {directory} "
                             "(the checkpoint there, if any, is kept)")
        handle = resume.save(directory, self.model, self.optimizer, step, self.data_flags, self.device,
                             self.extra_entries, async_save=self.o.async_save, staging=self.staging)
        if handle is not None:
            self.pending = PendingSave(handle, directory, step, why, started, time.perf_counter() - started)
            return
        self.checkpoint = directory
        self.log.event(step, f"{why}: checkpoint {directory}")
        if self.rank == 0:
            progress.note(f"saved checkpoint {directory} at step {step} ({time.perf_counter() - started:.1f} s)")

    def _publish_pending(self, progress) -> None:
        """Collective: publish the async save in flight (its write is waited
        for), or raise its error on every rank."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.handle.wait(remove_old_in_background=True)
        self.checkpoint = pending.directory
        took = time.perf_counter() - pending.started
        self.log.event(pending.step, f"{pending.why}: checkpoint {pending.directory} (async: training paused "
                                     f"{pending.stall_s:.3f} s, published after {took:.1f} s)")
        if self.rank == 0:
            progress.note(f"saved checkpoint {pending.directory} at step {pending.step} in the background "
                          f"(training paused {pending.stall_s:.2f} s; published after {took:.1f} s)")


@dataclasses.dataclass
class PendingSave:
    handle: checkpoint.AsyncSave
    directory: str
    step: int
    why: str
    started: float
    stall_s: float
    """Seconds training stood still for this save: finite check, plan, copy to host memory."""
