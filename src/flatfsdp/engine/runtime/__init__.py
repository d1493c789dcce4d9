"""Runtime: what happens while a sharded model runs.

A unit's hooks (``unit_state``), the root's schedule of one step
(``root_context``: order, prefetch, reductions in flight, end of backward),
the ``FSDPModule`` class a sharded module becomes, model state dicts,
deferred meta-device initialisation, conversions after sharding and the
checks that guard them (tied parameters, stale optimizers, replaced
parameters).

May import: ``engine.layout``, ``engine.comm``, ``engine.groups`` and modules
of this package. Never the front doors.
"""
