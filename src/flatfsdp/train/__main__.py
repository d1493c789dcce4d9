"""`python -m flatfsdp.train` is `flatfsdp train` (parsed before torch is imported, as the command is)."""

import sys

from flatfsdp.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
