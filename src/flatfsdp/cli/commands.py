"""The `flatfsdp` command's subcommands: one line each for the top-level help,
how each parses its flags (torch-free), and how it is run (importing torch).

Parsing comes first and alone, so `flatfsdp --help`, `flatfsdp SUB --help`,
a mistyped flag and every check that needs no file answer before torch is
imported; only a command line that parses imports the command itself.
"""

from __future__ import annotations

import difflib
import importlib
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
    flags: str
    """``module:function`` turning argv into what the command runs on; the module
    imports no torch and names the command (``PROG``) for its one-line errors."""
    runner: str
    """``module:function`` running it: importing the module imports torch."""

    def parse(self, argv: list[str]) -> Any:
        """--help and bad flags end here (SystemExit), before torch is imported."""
        module, function = self.flags.split(":")
        flags_module = importlib.import_module(module)
        return parse_or_exit(getattr(flags_module, function), argv, flags_module.PROG)

    def load(self) -> Callable[[Any], Any]:
        """Imports the command (and torch); returns its runner, which takes what ``parse`` returned."""
        module, function = self.runner.split(":")
        return getattr(importlib.import_module(module), function)


COMMANDS = {c.name: c for c in (
    Command("train", "train a GPT or fine-tune a Hugging Face model, sharded",
            "flatfsdp.train.options:parse_options", "flatfsdp.train.command:run_options"),
    Command("estimate", "memory and traffic per rank at any world size, before you rent",
            "flatfsdp.cli.estimate_flags:parse", "flatfsdp.estimator.cli:run_args"),
    Command("bench", "flatfsdp against FSDP2, DeepSpeed and the compute floor",
            "flatfsdp.bench.options:parse", "flatfsdp.bench.__main__:run_parsed"),
    Command("checkpoint", "inspect, export (a file or a Hugging Face folder), import; torch_dist -> fsdp_dtensor",
            "flatfsdp.cli.checkpoint_flags:parse", "flatfsdp.checkpoint.cli:run_args"),
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
