"""The `flatfsdp` command's subcommands: one line each for the top-level help,
how each parses its flags (torch-free), and how it is run (importing torch).

Parsing comes first and alone, so `flatfsdp --help`, `flatfsdp SUB --help`,
a mistyped flag and every check that needs no file answer before torch is
imported; only a command line that parses imports the command itself.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from typing import Any, Callable

from flatfsdp.cli.flags import fail, parse_or_exit

PROG = "flatfsdp"


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    """One line for `flatfsdp --help`."""
    parse: Callable[[list[str]], Any]
    """argv -> what the command runs on; imports no torch. --help and bad flags end here (SystemExit)."""
    load: Callable[[], Callable[[Any], Any]]
    """Imports the command (and torch) and returns its runner, which takes what ``parse`` returned."""


def _parse_train(argv: list[str]):
    from flatfsdp.train.options import PROG as TRAIN, parse_options

    return parse_or_exit(parse_options, argv, TRAIN)


def _load_train():
    from flatfsdp.train.command import run_options

    return run_options


def _parse_estimate(argv: list[str]):
    from flatfsdp.cli.estimate_flags import PROG as ESTIMATE, parse

    return parse_or_exit(parse, argv, ESTIMATE)


def _load_estimate():
    from flatfsdp.estimator.cli import run_args

    return run_args


def _parse_bench(argv: list[str]):
    from flatfsdp.bench.options import PROG as BENCH, parse

    return parse_or_exit(parse, argv, BENCH)


def _load_bench():
    from flatfsdp.bench.__main__ import run_parsed

    return run_parsed


def _parse_checkpoint(argv: list[str]):
    from flatfsdp.cli.checkpoint_flags import PROG as CHECKPOINT, parse

    return parse_or_exit(parse, argv, CHECKPOINT)


def _load_checkpoint():
    from flatfsdp.checkpoint.cli import run_args

    return run_args


COMMANDS = {c.name: c for c in (
    Command("train", "train a GPT or fine-tune a Hugging Face model, sharded", _parse_train, _load_train),
    Command("estimate", "memory and traffic per rank at any world size, before you rent",
            _parse_estimate, _load_estimate),
    Command("bench", "flatfsdp against FSDP2, DeepSpeed and the compute floor",
            _parse_bench, _load_bench),
    Command("checkpoint", "inspect, export (a file or a Hugging Face folder) and import", _parse_checkpoint, _load_checkpoint),
)}


def top_help() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = [f"usage: {PROG} COMMAND [options]", "",
             "Fully sharded data parallelism (ZeRO-1/2/3, HSDP) for PyTorch models, and the tools around it.", "",
             "commands:"]
    lines += [f"  {name:<{width}}{command.summary}" for name, command in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` lists a command's flags and their defaults.",
              f"`{PROG} --version` prints the version. Docs: README.md and docs/ in the source tree."]
    return "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flatfsdp")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def parse(argv: list[str] | None = None) -> tuple[Command, Any]:
    """The subcommand and its parsed flags; help, the version and errors exit here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        # Bare `flatfsdp` too: a person who typed it wants to know what it does (as pip and docker answer).
        print(top_help())
        raise SystemExit(0)
    if argv[0] == "--version":
        print(f"{PROG} {_version()}")
        raise SystemExit(0)
    command = COMMANDS.get(argv[0])
    if command is None:
        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        fail(PROG, f"unknown command {argv[0]!r}: {hint}choose from {', '.join(COMMANDS)} ({PROG} --help says "
                   "what each does)")
    return command, command.parse(argv[1:])


def main(argv: list[str] | None = None) -> Any:
    command, parsed = parse(argv)
    return command.load()(parsed)
