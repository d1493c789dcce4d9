"""The flags `flatfsdp train`, `estimate` and `bench` share, defined once: one
name (Megatron-LM's where it has one, torchrun's for ranks), one help text,
and the old spellings that still work for one release.

A parser adds a shared flag with `add`, giving only what differs between
commands: its default (and, for a default of None, what that means), and
where needed a note after the shared text or its own ``type``. So a name
cannot drift into two meanings, and a Megatron user's flags carry over.

Imports nothing beyond the standard library: the parsers are built before
torch is imported (flatfsdp.cli).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
from typing import Any

REMOVAL = "the next release"
"""When the old spellings stop working, as each use of one says."""


class UsageError(Exception):
    """A problem with the command line or its inputs: printed as one line, exit status 2."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog
        """The (sub)command to name, when it is not the one the caller would name."""


@dataclass(frozen=True)
class Flag:
    help: str
    """What it means, the same in every command that has it."""
    old: tuple[str, ...] = ()
    """Spellings some command used before; hidden, and each use prints a deprecation line."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """add_argument keywords every command passes (choices, nargs, const, action)."""


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""zero_dp_strategy's names, ZeRO stage 0 to 3 (flatfsdp.ShardingStrategy; a test holds them equal)."""


def parse_strategy(text: str) -> str:
    """0-3 or a name -> the name (an argparse type; needs no torch, unlike ShardingStrategy.parse)."""
    key = text.strip().lower()
    if key.isdigit() and int(key) < len(STRATEGIES):
        return STRATEGIES[int(key)]
    if key in STRATEGIES:
        return key
    raise argparse.ArgumentTypeError(f"unknown strategy {text!r}: use 0-3 or one of {', '.join(STRATEGIES)}")


SHARED: dict[str, Flag] = {
    "--nproc-per-node": Flag("local ranks to launch (torchrun's name); ignored under torchrun, whose WORLD_SIZE "
                             "rules", old=("--nproc", "--nprocs"), kwargs=(("type", int), ("metavar", "N"))),
    "--nnodes": Flag("nodes (torchrun's name)", old=("--nodes",), kwargs=(("type", int), ("metavar", "N"))),
    "--data-parallel-sharding-strategy": Flag(
        "what is sharded: no_shard (0, DDP), optim (1, ZeRO-1), optim_grads (2, ZeRO-2), optim_grads_params "
        "(3, ZeRO-3)", old=("--strategy",), kwargs=(("metavar", "{no_shard,optim,optim_grads,optim_grads_params,0-3}"),)),
    "--micro-batch-size": Flag("sequences per rank per forward/backward (the micro batch)",
                               old=("--micro-batch", "--batch"), kwargs=(("type", int), ("metavar", "N"))),
    "--seq-length": Flag("tokens per sequence", old=("--seq-len",), kwargs=(("type", int), ("metavar", "N"))),
    "--num-layers": Flag("transformer blocks", old=("--layers",), kwargs=(("type", int), ("metavar", "N"))),
    "--hidden-size": Flag("width of the residual stream", old=("--d-model",), kwargs=(("type", int), ("metavar", "N"))),
    "--num-attention-heads": Flag("attention heads per block", old=("--heads",),
                                  kwargs=(("type", int), ("metavar", "N"))),
    "--vocab-size": Flag("token ids the embedding has rows for", old=("--vocab",),
                         kwargs=(("type", int), ("metavar", "N"))),
    "--untie-embeddings-and-output-weights": Flag(
        "give the output projection a weight of its own instead of the token embedding's",
        kwargs=(("action", "store_true"),)),
    "--max-position-embeddings": Flag("rows of the position table (the longest sequence)", old=("--context",),
                                      kwargs=(("type", int), ("metavar", "N"))),
    "--tensor-model-parallel-size": Flag("tensor-parallel ranks inside each data-parallel rank", old=("--tp",),
                                         kwargs=(("type", int), ("metavar", "N"))),
    "--bf16": Flag("compute in bf16 from fp32 main weights (which the optimizer steps)",
                   kwargs=(("action", "store_true"),)),
    "--grad-reduce-in-bf16": Flag("reduce gradients in bf16 (= --grad-reduce-dtype bf16)",
                                  kwargs=(("action", "store_true"),)),
    "--grad-reduce-dtype": Flag("gradient reduction: fp32, bf16, or int8 (block-scaled codes summed in fp32; "
                                "docs/lowbit.md)", kwargs=(("choices", ("fp32", "bf16", "int8")),)),
    "--param-gather-dtype": Flag("gather weights as block-scaled 8-bit codes made once per optimizer step: int8 "
                                 "or fp8 (e4m3); docs/lowbit.md", kwargs=(("choices", ("int8", "fp8")),)),
    "--recompute": Flag("recompute each transformer block's activations in backward (torch.utils.checkpoint); "
                        "bare --recompute means non_reentrant",
                        kwargs=(("nargs", "?"), ("const", "non_reentrant"),
                                ("choices", ("none", "reentrant", "non_reentrant")))),
    "--lr": Flag("AdamW learning rate", kwargs=(("type", float), ("metavar", "X"))),
    "--seed": Flag("seed of the initial weights and of the data", kwargs=(("type", int), ("metavar", "N"))),
    "--predict": Flag("also predict the step time from the engine's own schedule, recorded in a fake world of the "
                      "run's size (docs/scale.md, 'Time on paper')", kwargs=(("action", "store_true"),)),
}


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows every default: appended as "(default: X)" unless the text
    already says what the default is (as it must where the default is None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """A parser whose errors are one line (argparse prints its whole usage
    first, which buries the error in a terminal and a log), refuses abbreviated
    flags (--data is never read as --data-parallel-sharding-strategy) and shows
    defaults."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            message += self._suggestions(message.split(": ", 1)[1].split(" "))
        raise UsageError(message, self.prog)

    def _suggestions(self, words: list[str]) -> str:
        """"; did you mean --seq-length?" for a flag one typo away from a known one."""
        known = [name for action in self._actions if action.help != argparse.SUPPRESS
                 for name in action.option_strings]
        near = [match[0] for word in words if word.startswith("--")
                if (match := difflib.get_close_matches(word.split("=")[0], known, n=1))]
        return f"; did you mean {', '.join(near)}?" if near else ""


def add(parser: argparse.ArgumentParser, name: str, *, note: str = "", default_text: str = "",
        **kwargs: Any) -> argparse.Action:
    """Add shared flag ``name`` (and its old spellings) to ``parser``. ``note``:
    what this command adds to the shared meaning; ``default_text``: what a
    default of None means here; ``kwargs``: default, dest, or a command's own type."""
    flag = SHARED[name]
    text = flag.help + (f"; {note}" if note else "") + (f" (default: {default_text})" if default_text else "")
    action = parser.add_argument(name, help=text, **{**dict(flag.kwargs), **kwargs})
    for old in flag.old:
        add_old_spelling(parser, old, action)
    return action


def add_old_spelling(parser: argparse.ArgumentParser, old: str, action: argparse.Action) -> None:
    """``old`` still works, hidden from --help, and says it is deprecated each time it is used."""
    parser.add_argument(old, action=_OldSpelling, replacement=action, nargs=action.nargs, const=action.const,
                        type=action.type, choices=action.choices, dest=action.dest, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


class _OldSpelling(argparse.Action):
    def __init__(self, option_strings, dest, replacement: argparse.Action, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.replacement.option_strings[0]
        print(f"{parser.prog}: {option_string} is deprecated, use {new} (the old spelling goes in {REMOVAL})",
              file=sys.stderr, flush=True)
        self.replacement(parser, namespace, values, new)


def parse_or_exit(parse, argv: list[str] | None, prog: str):
    """``parse(argv)`` (argv None: the process's arguments); a UsageError
    becomes one line on stderr and exit status 2, --help exits 0 as argparse does."""
    try:
        return parse(sys.argv[1:] if argv is None else list(argv))
    except UsageError as exc:
        fail(exc.prog or prog, str(exc))


def fail(prog: str, message: str):
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
