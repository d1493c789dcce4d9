"""The `flatfsdp` command: `flatfsdp train ...`, `flatfsdp bench ...`, `flatfsdp estimate ...`."""

from __future__ import annotations

import sys


COMMANDS = {"train": "flatfsdp.train", "bench": "flatfsdp.bench.__main__",
            "checkpoint": "flatfsdp.checkpoint.cli", "estimate": "flatfsdp.estimator.cli"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = COMMANDS
    if not argv or argv[0] not in commands:
        print("usage: flatfsdp {train,bench,checkpoint,estimate} [options]   (flatfsdp COMMAND --help for options)", file=sys.stderr)
        raise SystemExit(2)
    module = __import__(commands[argv[0]], fromlist=["main"])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
