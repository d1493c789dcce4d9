"""Communication: collectives over flat buffers and the plans built on them.

Stateless, counted collectives (``collectives``, the gloo ``exchange``), waits
with a limit (``watchdog``), the ranks' agreement check (``fingerprint``), and
above them a group's gather plan, coalescing of small requests, the bounded
queue of a step's gradient reductions and HFSDP's outer split.

May import: ``engine.layout`` and modules of this package. Knows nothing of
param groups, hooks or optimizers.
"""
