"""`python -m flatfsdp.train` is `flatfsdp train`."""

from flatfsdp.train.command import main

if __name__ == "__main__":
    main()
