"""The command line of `flatfsdp train`: one frozen dataclass, one field per flag.

Flag names follow Megatron-LM / Megatron-FSDP where they have a counterpart, so
a Megatron user's flags carry over; a flag `flatfsdp estimate` or `bench` has
too is defined once in flatfsdp.cli.flags (``_shared``). The parser is
generated from the fields so a flag, its default and its help text live in one
place. Nothing here imports torch: `flatfsdp train --help` and a bad flag answer
before it is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from flatfsdp.cli import flags
from flatfsdp.cli.flags import UsageError

PROG = "flatfsdp train"

__all__ = ["PROG", "TrainOptions", "UsageError", "build_parser", "parse_options", "check_options",
           "accumulation_steps", "warmup_iters"]


def _flag(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


def _shared(default: Any, note: str = "", default_text: str = "", **argparse_kwargs: Any) -> Any:
    """A flag whose name and meaning flatfsdp.cli.flags.SHARED defines for every command."""
    return field(default=default, metadata={"shared": True, "note": note, "default_text": default_text,
                                            **argparse_kwargs})


@dataclass(frozen=True)
class TrainOptions:
    # ---- launch ----
    nproc_per_node: int | None = _shared(None, default_text="every accelerator, else 2 CPU ranks")
    # ---- sharding (Megatron-FSDP flags) ----
    data_parallel_sharding_strategy: str = _shared("optim_grads_params", type=flags.parse_strategy)
    grad_reduce_in_bf16: bool = _shared(False)
    grad_reduce_dtype: str | None = _shared(None, default_text="fp32, or bf16 with --grad-reduce-in-bf16")
    param_gather_dtype: str | None = _shared(None, default_text="the compute dtype")
    init_model_with_meta_device: bool = _flag(False, "build the model on the meta device; each unit is "
                                                     "initialised on first use, each rank keeping its shard")
    calculate_per_token_loss: bool = _flag(False, "sum token losses and gradients over ranks and micro-batches, "
                                                  "then divide by the global token count once per step")
    recompute: str = _shared("none")
    bf16: bool = _shared(False)
    # ---- batch and schedule ----
    micro_batch_size: int = _shared(8)
    global_batch_size: int | None = _flag(None, "sequences per optimizer step over all ranks (default: micro batch "
                                                "x ranks); accumulation steps = global / (micro x ranks)")
    seq_length: int = _shared(128, note="--data is packed into windows of this length")
    train_iters: int = _flag(400, "optimizer steps to train in total (a resumed run counts the loaded steps)")
    lr: float = _shared(3e-3, note="the peak of the warmup and cosine decay")
    min_lr: float = _flag(3e-4, "learning rate at the end of the cosine decay")
    lr_warmup_iters: int | None = _flag(None, "linear warmup steps (default: 5%% of --train-iters)")
    weight_decay: float = _flag(0.1, "AdamW weight decay")
    clip_grad: float = _flag(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _shared(1234)
    # ---- model ----
    num_layers: int = _shared(4, note="ignored with --hf-model DIR")
    hidden_size: int = _shared(128, note="ignored with --hf-model DIR")
    num_attention_heads: int = _shared(4, note="ignored with --hf-model DIR")
    hf_model: str | None = _flag(None, "fine-tune the Hugging Face causal LM in this local directory (config.json "
                                       "and safetensors; the model flags are ignored); bare --hf-model: a tiny random "
                                       "LlamaForCausalLM from a LlamaConfig; nothing downloaded; needs pip install "
                                       "'flatfsdp[hf]' (default: the package's GPT)", nargs="?", const="",
                                 metavar="DIR")
    lora_rank: int | None = _flag(None, "fine-tune --hf-model through LoRA adapters of this rank (PEFT): the model's "
                                        "own weights stay frozen; only the adapters get gradients and optimizer "
                                        "state; needs pip install 'flatfsdp[lora]' (default: no adapters, every "
                                        "weight trains)", metavar="R")
    lora_alpha: float = _flag(16.0, "LoRA scaling numerator: adapters add (alpha / rank) * B @ A")
    lora_targets: str = _flag("all-linear", "comma-separated module names the adapters wrap (e.g. q_proj,v_proj), "
                                            "or all-linear (every linear layer but the output head)",
                              metavar="NAMES")
    # ---- data ----
    data: tuple[str, ...] | None = _flag(None, "train on these .txt (paragraphs), .jsonl, .parquet files, folders of "
                                               "them or datasets save_to_disk folders; tokenized once into "
                                               "--data-cache (default: the text shipped with flatfsdp); "
                                               "--data-path is Megatron-LM's name for it", nargs="+", metavar="PATH",
                                         aliases=("--data-path",))
    data_field: str = _flag("text", "the .jsonl field / parquet or datasets column holding each document",
                            metavar="NAME")
    tokenizer: str | None = _flag(None, "a Hugging Face tokenizer folder, or 'bytes' (every UTF-8 byte a token, "
                                        "256 ends a document); checkpoints remember it and exported models carry "
                                        "it (default: the one in the --hf-model DIR folder -- a folder without "
                                        "one is refused -- else bytes)", metavar="DIR|bytes")
    data_cache: str | None = _flag(None, "where tokenized text is kept, keyed by its content and the tokenizer "
                                         "(default: ~/.cache/flatfsdp/tokens)", metavar="DIR")
    # ---- checkpoints, evaluation, output ----
    save: str | None = _flag(None, "checkpoint directory, replaced atomically at each save (end of training, "
                                   "every --save-interval steps, Ctrl-C) (default: none; Ctrl-C saves into the "
                                   "run directory)")
    load: str | None = _flag(None, "resume from this checkpoint: weights, optimizer state, step, RNG (default: "
                                   "start from fresh or --hf-model weights)")
    save_interval: int | None = _flag(None, "steps between checkpoints to --save (default: only at the end)")
    async_save: bool = _flag(False, "training goes on while checkpoints are written: each save pauses it only "
                                    "to copy the shards to host memory; the checkpoint replaces the previous one "
                                    "once every rank's files are written")
    exit_interval: int | None = _flag(None, "stop after the first step divisible by this (saving to --save), "
                                            "as if interrupted but with exit status 0 (default: never)")
    eval_interval: int = _flag(100, "steps between evaluations on the held-out text (0: only at the end)")
    eval_iters: int = _flag(4, "micro-batches per rank in one evaluation")
    log_interval: int = _flag(10, "steps between log lines and memory reports")
    run_dir: str | None = _flag(None, "where log.json, loss.png and (without --save) an interrupt checkpoint "
                                      "go (default: runs/<date-time>)")
    no_progress: bool = _flag(False, "plain log lines instead of a live progress bar")
    # ---- faults ----
    on_nonfinite: str = _flag("stop", "when a step's loss or gradients are NaN/inf (checked on every step, before "
                                      "the optimizer): stop with an error naming the step and parameters, or skip "
                                      "the step and go on; a non-finite model is never saved",
                              choices=["stop", "skip"])
    timeout: float = _flag(300.0, "seconds a rank waits in a collective before failing with an error naming the "
                                  "ranks that did not arrive")


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(prog=PROG, description="Train a GPT (or fine-tune a Hugging Face model) on your "
                                 "text or on the text shipped with flatfsdp, sharded over local ranks (or the "
                                 "ranks torchrun started). See docs/train.md.")
    for f in dataclasses.fields(TrainOptions):
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        if meta.pop("shared", False):
            flags.add(parser, flag, default=f.default, **meta)
        elif f.type == "bool":
            parser.add_argument(flag, action="store_true", help=meta["help"])
        else:
            kind = meta.pop("type", None) or _TYPES[f.type]
            if f.name in ("save", "load", "run_dir"):
                meta["metavar"] = "DIR"
            meta.setdefault("metavar", {int: "N", float: "X"}.get(kind))
            parser.add_argument(flag, *meta.pop("aliases", ()), type=kind, default=f.default, **meta)
    return parser


_TYPES = {"int": int, "int | None": int, "float": float, "str": str, "str | None": str, "tuple[str, ...] | None": str}


def parse_options(argv: list[str]) -> TrainOptions:
    """The options of a command line; raises UsageError (--help exits, as argparse does)."""
    args = vars(build_parser().parse_args(argv))
    if args["data"] is not None:
        args["data"] = tuple(args["data"])  # frozen options stay hashable
    options = TrainOptions(**args)
    check_options(options)
    return options


def check_options(o: TrainOptions) -> None:
    """Checks that need no world size, no files and no imports."""
    positive = ["micro_batch_size", "seq_length", "train_iters", "num_layers", "hidden_size",
                "num_attention_heads", "eval_iters", "log_interval"]
    for name in positive:
        if getattr(o, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(o, name)}")
    for name in ["nproc_per_node", "global_batch_size", "save_interval", "exit_interval"]:
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(o, name)}")
    for name, low, strict in [("lr", 0.0, True), ("min_lr", 0.0, False), ("weight_decay", 0.0, False),
                              ("clip_grad", 0.0, False), ("timeout", 0.0, True)]:
        value = getattr(o, name)
        if not math.isfinite(value) or value < low or (strict and value == low):
            bound = "greater than" if strict else "at least"
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number {bound} {low:g}, got {value}")
    if o.eval_interval < 0 or (o.lr_warmup_iters or 0) < 0:
        raise UsageError("--eval-interval and --lr-warmup-iters must not be negative")
    if o.save_interval and not o.save:
        raise UsageError("--save-interval needs --save DIR to save to")
    if o.hidden_size % o.num_attention_heads:
        raise UsageError(f"--hidden-size {o.hidden_size} is not divisible by --num-attention-heads "
                         f"{o.num_attention_heads}")
    if o.lora_rank is not None:
        if o.lora_rank < 1:
            raise UsageError(f"--lora-rank must be at least 1, got {o.lora_rank}")
        if not o.hf_model:
            raise UsageError("--lora-rank fine-tunes a pretrained model: pass --hf-model DIR")
        if not math.isfinite(o.lora_alpha) or o.lora_alpha <= 0:
            raise UsageError(f"--lora-alpha must be a finite number greater than 0, got {o.lora_alpha}")
    if not o.data and o.data_field != "text":
        raise UsageError("--data-field applies to --data PATH: the shipped text is plain paragraphs")
    if o.hf_model == "" and o.init_model_with_meta_device:
        raise UsageError("--init-model-with-meta-device needs every module to initialise itself in "
                         "reset_parameters(); the Hugging Face Llama does not (its norms and rotary tables), "
                         "so use it without --hf-model")


def accumulation_steps(o: TrainOptions, world: int) -> int:
    """Micro-batches per rank per optimizer step; the global batch must split evenly."""
    per_pass = o.micro_batch_size * world
    global_batch = o.global_batch_size or per_pass
    if global_batch % per_pass:
        raise UsageError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
                         f"{o.micro_batch_size} x {world} data-parallel ranks = {per_pass}")
    return global_batch // per_pass


def warmup_iters(o: TrainOptions) -> int:
    return round(0.05 * o.train_iters) if o.lr_warmup_iters is None else o.lr_warmup_iters
