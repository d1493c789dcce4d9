"""What a unit still owes between ``fully_shard`` and its first use.

FSDP2 initialises lazily, and users rely on the window between sharding and
the first forward: a meta-device model's ``reset_parameters()`` runs then
(meta_init), parameters assigned in the meantime are taken then
(replaced_params), and errors about parameters a sibling unit took are raised
then, where FSDP2 raises them. This record holds that window's state for one
unit; the unit's runtime (unit_state) only asks it questions.
"""

from __future__ import annotations

from torch import nn


class DeferredInit:
    def __init__(self, *, pending: list, meta_originals: dict, seed: int, conflicts: list[tuple[int, Exception]]):
        self.pending = pending
        """(module index, path in the unit, module) of every module whose
        ``reset_parameters()`` still has to run (built on the meta device)."""
        self.meta_originals = meta_originals
        """Real parameter -> the meta-device parameter it replaced (an optimizer
        built on the meta model still holds the old objects)."""
        self.seed = seed
        """Seeds each module's deferred initialisation (the same on every rank)."""
        self.errors = [error for _, error in conflicts]
        """Found while sharding, raised at the first forward (see shard_unit)."""
        self.conflicted = {pid for pid, _ in conflicts}
        """ids of the parameters those errors are about (left to the unit below)."""
        self.user_valued: set[int] = set()
        """ids of original parameters whose values the user gave after sharding
        (a replaced or loaded parameter): deferred initialisation leaves them alone."""
        self.orphaned: dict[int, tuple] = {}
        """id -> (plain parameter the user assigned after sharding, its name):
        its value was taken, the object itself is not trained (see replaced_params)."""
        self.first_use_seen = False
        self._baseline: dict[int, int] = {}
        """id(sharded parameter) -> its version when deferred initialisation was
        set up: a parameter written since (through its DTensor) has the user's values."""

    def drop(self) -> None:
        """The caller initialises the parameters itself (to_empty, load, mark_initialized)."""
        self.pending = []

    def note_baseline(self, groups: list) -> None:
        """Remember the sharded parameters' versions while initialisation is deferred."""
        if self.pending:
            self._baseline = {id(p): p._version for g in groups for p in g.sharded_params}

    def written_since_sharding(self, groups: list) -> set[int]:
        """ids of original parameters the user wrote through their sharded
        DTensor (e.g. ``nn.init``) after sharding, before the first use."""
        return {id(slot.param) for g in groups for slot, p in zip(g.slots, g.sharded_params)
                if id(p) in self._baseline and p._version != self._baseline[id(p)]}

    def meta_of(self) -> dict[int, nn.Parameter]:
        """id(real parameter) -> the meta-device parameter it replaced."""
        return {id(real): meta for real, meta in self.meta_originals.items()}
