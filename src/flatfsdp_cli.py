"""The `flatfsdp` command's entry point, kept outside the flatfsdp package on
purpose: a command imports torch (seconds on a busy machine), and a Ctrl-C in
those seconds would end the command with a traceback -- or worse, be
swallowed by some library's catch-all ``except`` around an optional import,
and the run would start as if nothing happened. So while the command imports,
a Ctrl-C only sets a flag, read once the import is done; afterwards the
command handles its own (docs/reliability.md). Parsing the command line
imports no torch and comes before, unguarded: a Ctrl-C there ends nothing that
has begun.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted(command: str) -> None:
    what = "interrupted before training started; nothing was saved" if command == "train" else "interrupted"
    print(f"flatfsdp{' ' + command if command else ''}: {what}", file=sys.stderr, flush=True)
    # Not SystemExit: nothing is ours to clean up yet, and an import cut short
    # may have left a thread that interpreter shutdown would wait for.
    os._exit(130)


def main() -> None:
    # The command line is parsed first, without torch (flatfsdp.cli): --help,
    # a bad flag or a bad value answers at once, and only then does the
    # command import what it runs on.
    try:
        from flatfsdp.cli import parse

        command, parsed = parse(sys.argv[1:])
    except KeyboardInterrupt:
        _interrupted(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "")
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        run = command.load()
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        _interrupted(command.name)
    try:
        run(parsed)
    except KeyboardInterrupt:
        _interrupted(command.name)


if __name__ == "__main__":
    main()
