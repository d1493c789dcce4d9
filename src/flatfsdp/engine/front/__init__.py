"""Front doors: turning a user's model into sharded units, and the public
operations on a sharded model.

``api`` holds the two front doors (Megatron-FSDP's one call and FSDP2's
per-module ``fully_shard``, one loop over units), ``shard_unit`` makes one
module a unit, ``optimizer`` binds optimizers, ``memory`` and
``finite_check`` report on a sharded model; ``keyword_table`` writes every
keyword of the doors once, ``keywords``, ``fsdp2_args`` and ``unit_classes``
read the user's arguments.

May import: every other engine package. Only ``engine/__init__`` (the public
API) imports this package.
"""
