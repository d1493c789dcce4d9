"""The `flatfsdp` command's entry point, kept outside the flatfsdp package on
purpose: importing anything inside the package imports torch first (seconds on
a busy machine), and a Ctrl-C in those seconds would end the command with a
traceback -- or worse, be swallowed by some library's catch-all ``except``
around an optional import, and the run would start as if nothing happened.
So while the package imports, a Ctrl-C only sets a flag, read once the import
is done; afterwards the command handles its own (docs/reliability.md).
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
    command = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        import importlib

        from flatfsdp.cli import COMMANDS, main as run
        if command in COMMANDS:
            importlib.import_module(COMMANDS[command])
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        _interrupted(command)
    try:
        run()
    except KeyboardInterrupt:
        _interrupted(command)


if __name__ == "__main__":
    main()
