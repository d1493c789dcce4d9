"""`flatfsdp train`'s process-level logic: parse, check what can be checked
before any rank starts, launch, turn the outcome into an exit status.

Exit status: 0 done; 2 a usage problem (one line on stderr: bad flag, batch
sizes that do not divide, a checkpoint that is missing or of another model);
130 interrupted by Ctrl-C (after saving a checkpoint when training had begun).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from flatfsdp import checkpoint
from flatfsdp.cli.flags import fail, parse_or_exit
from flatfsdp.data.tokenizer import TokenizerIdentity
from flatfsdp.launch import LaunchInterrupted, launch, under_torchrun
from flatfsdp.train import data, hf, own_data, resume
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
    return o.nproc_per_node or default_nproc()


def expected_model_shapes(o: TrainOptions, vocab_size: int) -> dict[str, tuple]:
    """Names and shapes of the model these flags build (on the meta device: no memory, no init)."""
    from flatfsdp.train.model import build_model

    meta = torch.device("meta")
    with meta:
        built = build_model(o, meta, vocab_size)
    return {name: tuple(t.shape) for name, t in built.model.state_dict().items()}


def check_before_launch(o: TrainOptions):
    """Everything that can fail on the user's input, so no rank starts to fail
    (the text is tokenized now); returns the world size, the token files and
    the tokenizer's identity (which checkpoints remember)."""
    world = world_size(o)
    if not under_torchrun() and torch.accelerator.is_available() and world > torch.accelerator.device_count():
        raise UsageError(f"--nproc-per-node {world} is more than the {torch.accelerator.device_count()} accelerators "
                         "here")
    accumulation_steps(o, world)
    if o.hf_model is not None:
        hf.require_transformers()
    if o.lora_rank is not None:
        hf.require_peft()
    if o.hf_model:
        hf.require_model_folder(o.hf_model)  # a missing model says so, not that it has no tokenizer
    tokenizer = own_data.tokenizer_for(o)
    tokenized = own_data.data_paths(o, tokenizer) is not None
    if o.hf_model:
        hf.check_pretrained(o.hf_model, tokenizer.vocab_size if tokenized else data.VOCAB_SIZE, o.seq_length,
                            f"the tokenizer ({tokenizer.name})" if tokenized else "the shipped text's byte values")
    check_paths(o)
    identity = TokenizerIdentity.of(tokenizer)
    if o.load:
        resume.check_same_tokenizer(o.load, identity)
    files = own_data.prepare(o, tokenizer, show_progress=not o.no_progress, report=own_data.reports_on_this_node())
    if o.load:
        resume.check_loadable(o.load, expected_model_shapes(o, own_data.data_vocab(o, files)))
    if files is None:
        check_sequence_fits(o)
    return world, files, identity


def check_paths(o: TrainOptions) -> None:
    """--save and --run-dir, now rather than after the run: a save never
    replaces a folder that is not a checkpoint (nor a file), and both must be writable."""
    if o.save:
        try:
            checkpoint.check_save_target(o.save)
        except checkpoint.CheckpointError as exc:
            raise UsageError(f"--save {o.save}: {exc}") from None
    run_dir = o.run_dir or "runs"
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError(f"--run-dir {run_dir} is a file, not a directory")
    try:
        if o.run_dir:  # made now, as rank 0 would make it anyway: any reason it cannot be shows here
            os.makedirs(run_dir, exist_ok=True)
        existing = os.path.abspath(run_dir)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{existing} is not writable")
        # Permission bits do not tell (root, read-only mounts, /proc): create and remove a file there.
        probe, name = tempfile.mkstemp(prefix=".flatfsdp-probe-", dir=existing)
        os.close(probe)
        os.unlink(name)
    except OSError as exc:
        what = f"--run-dir {run_dir}" if o.run_dir else f"the default run directory ./{run_dir}"
        raise UsageError(f"{what} cannot be created or written ({exc.strerror or exc}): pass "
                         "--run-dir DIR") from None


def check_sequence_fits(o: TrainOptions) -> None:
    """Training and evaluation windows of --seq-length + 1 bytes must fit in the text."""
    corpus = data.load_corpus()
    shortest = min(corpus.train.numel(), corpus.eval.numel())
    if o.seq_length + 1 >= shortest:
        raise UsageError(f"--seq-length {o.seq_length} is too long for the shipped text: sequences must be "
                         f"shorter than {shortest - 1} bytes (the held-out part)")


def _interrupted_at_start() -> None:
    print(f"{PROG}: interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


def main(argv: list[str] | None = None) -> dict:
    """Run the command; returns rank 0's summary (this rank's under torchrun) when it finishes."""
    return run_options(parse_or_exit(parse_options, argv, PROG))


def run_options(o: TrainOptions) -> dict:
    """The command on a parsed command line (`flatfsdp train` parses before importing torch)."""
    try:
        world, files, tokenizer = check_before_launch(o)
    except UsageError as exc:
        fail(PROG, str(exc))
    except KeyboardInterrupt:  # Ctrl-C during the checks (reading the corpus, a checkpoint's metadata)
        _interrupted_at_start()
    threads = 1 if torch.accelerator.is_available() else max(1, (os.cpu_count() or 2) // world)
    try:
        summary = launch(run, world, o, files, tokenizer, threads_per_rank=threads, forward_sigint=True,
                         collective_timeout_s=o.timeout)
    except (LaunchInterrupted, KeyboardInterrupt):
        _interrupted_at_start()
    if summary.get("error"):
        if summary["rank"] == 0:
            fail(PROG, summary["error"])
        raise SystemExit(2)
    if summary["interrupted"]:
        if summary["rank"] == 0:
            print(f"{PROG}: interrupted at step {summary['last_step']}; checkpoint saved to {summary['checkpoint']} "
                  f"(continue with --load {summary['checkpoint']})", file=sys.stderr, flush=True)
        raise SystemExit(130)
    return summary
