"""Tensor-subclass parameters at ``fully_shard``: which ones the engine
shards faithfully, and a named refusal for the rest.

A parameter whose class implements FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) is sharded and gathered
through it (groups/subclass_group). Any other subclass would have its plain
values copied into the flat buffers and the subclass dropped -- a float8 or
NF4 weight silently trained in full precision -- so it is refused, as are
the protocol's cases this engine does not cover yet. Plain tensors, Python
subclasses of ``nn.Parameter`` and fake tensors (the estimator's) pass.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatfsdp.engine.groups.slots import ParamSlot
from flatfsdp.engine.groups.subclass_gather import has_gather_protocol
from flatfsdp.engine.layout.main_home import MainHome


class UnsupportedParameterSubclass(TypeError):
    """A tensor-subclass parameter the engine cannot shard faithfully."""


def local_of(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def is_plain(tensor: torch.Tensor) -> bool:
    kind = type(tensor)
    if kind is torch.Tensor or issubclass(kind, nn.Parameter):
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(tensor, FakeTensor)


def protocol_slots(slots: list[ParamSlot]) -> set[str]:
    """Names of the parameters gathered through their own class."""
    return {s.fqn for s in slots if not is_plain(local_of(s.param))}


def check_subclass_params(slots: list[ParamSlot], *, world: int, unit: str, home: MainHome) -> None:
    """Refuse, naming parameter and class, every subclass parameter that
    would not be sharded faithfully. ``slots`` carry their chosen shard dim."""
    for slot in slots:
        local = local_of(slot.param)
        if is_plain(local):
            continue
        kind = type(local).__name__
        where = f"unit '{unit}': parameter '{slot.fqn}' is a {kind}"
        if not has_gather_protocol(local):
            half = [h for h in ("fsdp_pre_all_gather", "fsdp_post_all_gather") if hasattr(local, h)]
            missing = "defines only " + half[0] if half else "does not implement FSDP2's all-gather extension"
            raise UnsupportedParameterSubclass(
                f"{where}, a tensor subclass that {missing} (fsdp_pre_all_gather and fsdp_post_all_gather). "
                "Sharding it as a plain tensor would drop the subclass and train its plain values; implement "
                "both methods, convert it to a plain tensor before fully_shard, or leave it out (ignored_params)")
        if isinstance(slot.param, DTensor):
            raise UnsupportedParameterSubclass(
                f"{where} inside a tensor-parallel DTensor: flatfsdp gathers subclass parameters of plain "
                "(not tensor-parallel) modules only so far")
        if slot.param.is_meta:
            raise UnsupportedParameterSubclass(
                f"{where} on the meta device: build it on a real device (torchao converts meta weights "
                "without values to shard) before fully_shard")
        if not home.shares_device_memory:
            raise UnsupportedParameterSubclass(f"{where}: {home.keyword} (main weights in host memory) is not "
                                               "supported for subclass parameters")
        if slot.shard_dim is None or world == 1:
            continue  # replicated: nothing is gathered, the module computes with the parameter itself
        _check_chunks(slot, local, world, where)


def _check_chunks(slot: ParamSlot, local: torch.Tensor, world: int, where: str) -> None:
    """Dim 0 in equal chunks, which the subclass itself can cut (FSDP2's protocol assumes both)."""
    shape = tuple(local.shape)
    if slot.shard_dim != 0:
        raise UnsupportedParameterSubclass(
            f"{where} asked to shard on dim {slot.shard_dim}; subclass parameters shard on dim 0 only")
    if shape[0] % world:
        raise UnsupportedParameterSubclass(
            f"{where} of shape {shape}: dim 0 ({shape[0]}) does not split evenly over {world} ranks, which the "
            "all-gather extension needs (each rank's inputs have the same size)")
    try:
        chunks = torch.chunk(local.detach(), world, dim=0)
        ok = len(chunks) == world and all(type(c) is type(local) for c in chunks)
    except Exception as error:  # the subclass's own split refused (e.g. NF4 scale blocks)
        raise UnsupportedParameterSubclass(
            f"{where} of shape {shape} that cannot be cut into {world} chunks on dim 0: "
            f"{type(error).__name__}: {error}") from error
    if not ok:
        raise UnsupportedParameterSubclass(
            f"{where} of shape {shape}: cutting it into {world} chunks does not give {world} tensors of its class")
