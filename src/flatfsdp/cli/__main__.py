"""`python -m flatfsdp.cli ARGS` is `flatfsdp ARGS`."""

from flatfsdp.cli.commands import main

if __name__ == "__main__":
    main()
