"""The `flatfsdp` command line, importable without torch.

* ``commands``          -- the subcommands: one line each, parse (torch-free) then run
* ``flags``             -- the flags train, estimate and bench share: one name, one meaning,
                           old spellings for one release; the parser class and help formatter
* ``estimate_flags``    -- `flatfsdp estimate`'s parser and argument checks
* ``checkpoint_flags``  -- `flatfsdp checkpoint`'s parser

`flatfsdp train`'s flags live with the dataclass they fill (flatfsdp.train.options),
`flatfsdp bench`'s likewise (flatfsdp.bench.options); neither imports torch either.
"""

from flatfsdp.cli.commands import COMMANDS, main, parse

__all__ = ["COMMANDS", "main", "parse"]
