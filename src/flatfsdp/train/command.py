"""`flatfsdp train`'s process-level logic: parse, check what can be checked
before any rank starts, launch, turn the outcome into an exit status.

Exit status: 0 done; 2 a usage problem (one line on stderr: bad flag, batch
sizes that do not divide, a checkpoint that is missing or of another model);
130 interrupted by Ctrl-C (after saving a checkpoint when training had begun).
"""

from __future__ import annotations

import os
import sys

import torch

from flatfsdp.launch import LaunchInterrupted, launch, under_torchrun
from flatfsdp.train import hf, resume
from flatfsdp.train.loop import run
from flatfsdp.train.options import PROG, TrainOptions, UsageError, accumulation_steps, parse_options


def default_nproc() -> int:
    """Every accelerator when there is one, else two CPU ranks."""
    if torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return 2


def world_size(o: TrainOptions) -> int:
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return o.nproc or default_nproc()


def expected_model_shapes(o: TrainOptions) -> dict[str, tuple]:
    """Names and shapes of the model these flags build (on the meta device: no memory, no init)."""
    from flatfsdp.train.model import build_model

    meta = torch.device("meta")
    with meta:
        built = build_model(o, meta)
    return {name: tuple(t.shape) for name, t in built.model.state_dict().items()}


def check_before_launch(o: TrainOptions) -> int:
    """Everything that can fail on the user's input, so no rank starts to fail; returns the world size."""
    world = world_size(o)
    if not under_torchrun() and torch.accelerator.is_available() and world > torch.accelerator.device_count():
        raise UsageError(f"--nproc {world} is more than the {torch.accelerator.device_count()} accelerators here")
    accumulation_steps(o, world)
    if o.hf_model is not None:
        hf.require_transformers()
    if o.hf_model:
        hf.check_pretrained(o.hf_model)
    if o.load:
        resume.check_loadable(o.load, expected_model_shapes(o))
    return world


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    """Run the command; returns rank 0's summary (this rank's under torchrun) when it finishes."""
    try:
        o = parse_options(argv)
        world = check_before_launch(o)
    except UsageError as exc:
        _fail(str(exc))
    threads = 1 if torch.accelerator.is_available() else max(1, (os.cpu_count() or 2) // world)
    try:
        summary = launch(run, world, o, threads_per_rank=threads, forward_sigint=True)
    except LaunchInterrupted:
        print(f"{PROG}: interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    if summary.get("error"):
        if summary["rank"] == 0:
            _fail(summary["error"])
        raise SystemExit(2)
    if summary["interrupted"]:
        if summary["rank"] == 0:
            print(f"{PROG}: interrupted at step {summary['last_step']}; checkpoint saved to {summary['checkpoint']} "
                  f"(continue with --load {summary['checkpoint']})", file=sys.stderr, flush=True)
        raise SystemExit(130)
    return summary
