"""What an index of ``optimizer.state_dict()["state"]`` means, the same as in
stock Megatron-FSDP.

torch numbers a parameter by its first appearance in the optimizer's
param groups. Stock ``megatron_fsdp.fully_shard`` first collapses the user's
param groups into one group of ``model.parameters()``, so its index ``i`` is
the model's ``i``-th parameter. flatfsdp keeps the user's groups (their
hyperparameters are the user's), so torch's numbering would follow the
groups' order: the same index could name another parameter, and a checkpoint
moved across would put one parameter's Adam moments on another -- silently
when the shapes agree.

So an optimizer bound through this package saves and loads its state in
stock's numbering (the model's parameter order), whatever its groups: a state
hook renumbers on the way out, a load hook back on the way in. Within the
groups nothing is reordered. The group structure itself cannot be remapped --
a checkpoint's single group carries one set of hyperparameters -- so a
checkpoint whose groups differ from the optimizer's (stock's one group into an
optimizer of two) is refused by name before anything is loaded.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


class StockNumbering:
    """The pair of optimizer hooks, for one model (held weakly)."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_state_dict_post_hook(self.to_model_order)
        optimizer.register_load_state_dict_pre_hook(self.from_model_order)

    def _ours_to_model(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """torch's index of each of the optimizer's parameters -> its place in the model."""
        model = self._model()
        place = {id(p): i for i, p in enumerate(model.parameters())}
        mapping, seen = {}, {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen[id(p)] = len(seen)
                if id(p) not in place:
                    raise ValueError(f"optimizer param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that "
                                     f"is not one of {type(model).__name__}'s")
                mapping[seen[id(p)]] = place[id(p)]
        return mapping

    def to_model_order(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        mapping = self._ours_to_model(optimizer)
        return {**state_dict, "state": {mapping[i]: v for i, v in state_dict["state"].items()},
                "param_groups": [{**g, "params": [mapping[i] for i in g["params"]]} for g in state_dict["param_groups"]]}

    def from_model_order(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        mapping = self._ours_to_model(optimizer)
        back = {m: i for i, m in mapping.items()}
        saved = [list(g["params"]) for g in state_dict["param_groups"]]
        own = [[mapping[i] for i in g] for g in _torch_indices(optimizer)]
        if [sorted(g) for g in saved] != [sorted(g) for g in own]:
            raise ValueError(
                f"optimizer state does not fit {type(optimizer).__name__} (nothing was loaded): the checkpoint "
                f"holds {len(saved)} param group(s) of {[len(g) for g in saved]} parameter(s), this optimizer "
                f"{len(own)} of {[len(g) for g in own]}. Stock Megatron-FSDP's fully_shard puts every parameter in "
                "one group; build the optimizer with one param group to exchange checkpoints with it")
        extra = sorted(set(state_dict["state"]) - set(back))
        if extra:
            raise ValueError(f"optimizer state holds entries for parameter(s) {extra[:5]} of the model's order, "
                             f"which {type(self._model()).__name__} does not have (nothing was loaded)")
        return {**state_dict, "state": {back[m]: v for m, v in state_dict["state"].items()},
                "param_groups": [{**g, "params": [back[m] for m in g["params"]]} for g in state_dict["param_groups"]]}


def _torch_indices(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Each group's parameters as torch's state_dict numbers them."""
    seen: dict[int, int] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append([seen.setdefault(id(p), len(seen)) for p in group["params"]])
    return groups


def has_stock_numbering(optimizer: torch.optim.Optimizer) -> bool:
    return any(getattr(h, "__self__", None).__class__ is StockNumbering
               for h in optimizer._optimizer_state_dict_post_hooks.values())
