"""Ranks must agree on the model they shard: check it once, at wrap time.

Each rank describes the unit it is about to shard (its name, and every
parameter's name, shape, dtype and requires_grad) and the ranks exchange one
64-bit hash of that description: one tiny all-gather per ``fully_shard`` call.
Only when the hashes differ do they exchange the descriptions themselves, to
name the first parameter that differs and the ranks that differ.

Without it a disagreement shows up later and far away: gloo aborts with
"Received data size doesn't match", NCCL hangs, or -- worst -- two ranks whose
shapes happen to pack to the same buffer size train garbage silently.

``verify_replicas`` is the optional second check: that every rank starts from
the same weights (a model initialised without a common seed, or loaded from a
different file on one rank, otherwise trains as a silent mix of shards).
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from flatfsdp.engine.comm.torch_collectives import all_gather_single
from flatfsdp.engine.layout.switches import CHECK_VALUES_ENV


class ReplicaMismatch(ValueError):
    """Ranks disagree on the model: what, where, and which ranks."""


def describe(name: str, params: Iterable[tuple[str, torch.Tensor]]) -> tuple:
    """What every rank must agree on about one unit."""
    return (name, tuple((fqn, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad))
                        for fqn, p in params))


def _hash(description: tuple) -> int:
    digest = hashlib.sha256(repr(description).encode()).digest()
    return struct.unpack("<q", digest[:8])[0]


def value_check_mode(default: str, setting: str | None) -> str:
    """What differing replica values do at fully_shard: ``error``, ``warn``,
    ``broadcast`` (take_first_replica) or ``skip`` (FLATFSDP_CHECK_REPLICAS=0:
    ranks that start from different weights on purpose and load the same
    checkpoint after sharding). ``setting`` is that variable, read once
    (layout/switches.py); unset, each front door picks (``default``): the
    one-call form takes the first rank's values, as DDP; the per-module
    (FSDP2) form warns, because FSDP2 accepts such replicas and scripts
    (PyTorch's own tests among them) rely on it -- a drop-in must not refuse
    what FSDP2 runs, but it need not be silent."""
    return default if setting is None else setting


def check_ranks_agree(description: tuple, group: dist.ProcessGroup, device: torch.device,
                      values: list[tuple[str, torch.Tensor]] | None = None, values_differ: str = "error") -> None:
    """Raise ReplicaMismatch on every rank unless all ranks of ``group`` passed
    the same ``description``; and -- for ``values`` (name, tensor), skipped when
    any is on the meta device -- when they are not bitwise the same, raise
    (``values_differ="error"``) or warn naming the first ("warn"; "skip" leaves
    them unread). Collective over ``group``: one all-gather of three int64 (a
    hash of the description, two checksums of the values' bits)."""
    world = group.size()
    if world == 1 or dist.get_backend(group) == "fake":
        return  # no other rank to disagree (torch's fake group: the estimator's one real rank)
    if not values or any(t.is_meta for _, t in values) or values_differ == "skip":
        values = []
    sums = torch.stack([_cheap_checksum(t).to(device) for _, t in values]).sum(0) if values else \
        torch.zeros(2, dtype=torch.int64, device=device)
    mine = torch.cat([torch.tensor([_hash(description)], dtype=torch.int64, device=device), sums])
    hashes = torch.empty(world * 3, dtype=torch.int64, device=device)
    all_gather_single(hashes, mine, group=group)
    hashes = hashes.view(world, 3)
    if bool((hashes == hashes[0]).all()):  # one host sync, whatever the world size
        return
    if bool((hashes[:, 0] == hashes[0, 0]).all()):
        message = _name_first_different_value(description[0], values, group, device)
        if values_differ == "warn":
            warnings.warn(f"{message}; FSDP2 shards such replicas as they are, so each rank keeps its chunk of "
                          f"a different model ({CHECK_VALUES_ENV}=error makes this an error)", stacklevel=4)
            return
        raise ReplicaMismatch(message)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, description, group=group)
    raise ReplicaMismatch(_first_difference(everyone, group))


def take_first_replica(name: str, values: list[tuple[str, torch.Tensor]], groups: list[dist.ProcessGroup],
                       device: torch.device) -> str | None:
    """What DDP does with replicas that start apart: every rank of each group
    in ``groups`` (the shard group, then the outer one) takes its first rank's
    ``values``, copied in place. Returns what differed (None: nothing did),
    for the caller to say once. Ranks that disagree on the model's structure
    are left alone: sharding names that difference per unit. Collective over
    each group: one all-gather of three int64, and only where values differ
    a second, and one broadcast per tensor."""
    values = [(n, t) for n, t in values if not t.is_meta and type(_local(t)) is torch.Tensor]
    description = describe(name, values)
    found = None
    for group in groups:
        if group is None or group.size() == 1 or dist.get_backend(group) == "fake":
            continue
        sums = torch.stack([_cheap_checksum(t).to(device) for _, t in values]).sum(0) if values else \
            torch.zeros(2, dtype=torch.int64, device=device)
        mine = torch.cat([torch.tensor([_hash(description)], dtype=torch.int64, device=device), sums])
        hashes = torch.empty(group.size() * 3, dtype=torch.int64, device=device)
        all_gather_single(hashes, mine, group=group)
        hashes = hashes.view(group.size(), 3)
        if bool((hashes == hashes[0]).all()) or not bool((hashes[:, 0] == hashes[0, 0]).all()):
            continue
        message = _name_first_different_value(name, values, group, device)
        found = found or message.split(";")[0]
        with torch.no_grad():
            for _, t in values:
                local = _local(t)
                staged = local.to(device) if local.device != device else local
                dist.broadcast(staged, group=group, group_src=0)
                if staged is not local:
                    local.copy_(staged)
    return found


def warn_first_replica_taken(found: str, stacklevel: int) -> None:
    warnings.warn(f"{found}; flatfsdp gives every replica the first rank's values, as DDP does "
                  f"({CHECK_VALUES_ENV}=error refuses such replicas, =warn keeps them apart as FSDP2 does)",
                  stacklevel=stacklevel + 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def _cheap_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bytes read as 64-bit words (all of them,
    and the first half): one read at memory speed, exact (wrapping) integer
    arithmetic, so equal weights give equal sums whatever the thread count,
    and different initial weights (another seed) change them. (Widening each
    element to int64 first, as `_checksum` does, is some 100 times slower.)"""
    flat = (t.to_local() if hasattr(t, "to_local") else t).detach()
    if type(flat) is not torch.Tensor:
        # A tensor subclass (float8, NF4: subclass_params) has no plain bytes to
        # read; its shape and dtype are still in the description hash.
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a storage offset that is not 8-byte aligned
        words = raw[:whole].clone().view(torch.int64)
    tail = raw[whole:].to(torch.int64).sum()
    return torch.stack([words.sum() + tail, words[:words.numel() // 2].sum()])


def _name_first_different_value(unit: str, values: list, group: dist.ProcessGroup, device: torch.device) -> str:
    """Slow path, values differ: per-parameter checksums, to name the first."""
    mine = torch.stack([_cheap_checksum(t).to(device) for _, t in values])
    gathered = torch.empty(group.size() * mine.numel(), dtype=torch.int64, device=device)
    all_gather_single(gathered, mine.reshape(-1), group=group)
    gathered = gathered.view(group.size(), *mine.shape)
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    for index, (name, _) in enumerate(values):
        differ = [rank for rank, g in zip(ranks, gathered) if not torch.equal(g[index], gathered[0][index])]
        if differ:
            return (
                f"replicas start from different weights in unit '{unit}': '{name}' differs between rank {ranks[0]} "
                f"and rank(s) {', '.join(map(str, differ))}; seed the initialisation the same on every rank, load "
                f"the same weights everywhere, or build the model on the meta device ({CHECK_VALUES_ENV}=0 skips "
                "this check, for weights loaded after fully_shard)")
    return f"replicas start from different weights in unit '{unit}'"  # checksums of the sum differ only


def _first_difference(descriptions: list, group: dist.ProcessGroup) -> str:
    ranks = [dist.get_global_rank(group, r) for r in range(len(descriptions))]
    reference = descriptions[0]
    differ = [rank for rank, d in zip(ranks, descriptions) if d != reference]
    other = descriptions[ranks.index(differ[0])]
    where = f"rank {ranks[0]} vs rank(s) {', '.join(map(str, differ))}"
    if reference[0] != other[0]:
        return (f"ranks disagree on the model: fully_shard is sharding unit '{reference[0]}' on rank {ranks[0]} "
                f"but unit '{other[0]}' on rank {differ[0]} ({where}); every rank must build the same model "
                "and shard the same units in the same order")
    for index in range(max(len(reference[1]), len(other[1]))):
        a = reference[1][index] if index < len(reference[1]) else None
        b = other[1][index] if index < len(other[1]) else None
        if a != b:
            same_name = a is not None and b is not None and a[0] == b[0]
            what = f"parameter '{a[0]}' is" if same_name else f"parameter #{index} is"
            return (f"ranks disagree on the model in unit '{reference[0]}': {what} {_spec(a, not same_name)} on "
                    f"rank {ranks[0]} but {_spec(b, not same_name)} on rank {differ[0]} ({where}); every rank "
                    "must build the same model")
    return f"ranks disagree on the model in unit '{reference[0]}' ({where})"


def _spec(entry, with_name: bool) -> str:
    if entry is None:
        return "absent"
    fqn, shape, dtype, requires_grad = entry
    return (f"'{fqn}' " if with_name else "") + f"{shape} {dtype} requires_grad={requires_grad}"


# ---- the optional check of the values ------------------------------------------------------------

def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain and position-weighted): any
    single changed element changes them; equal weights give equal sums."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                       8: torch.int64}[flat.element_size()])
    bits = flat.to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def verify_replicas(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise ReplicaMismatch unless every rank of ``group`` (default: the world)
    holds bitwise the same parameters and buffers in ``module``. Call it on the
    unsharded model, before ``fully_shard`` (meta tensors are skipped). One
    all-gather of two int64 checksums per tensor."""
    group = group or dist.group.WORLD
    device = _group_device(group)
    tensors = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers()) if not t.is_meta]
    check_ranks_agree(describe("<whole model>", tensors), group, device)  # same names and shapes first
    names = [n for n, _ in tensors]
    mine = torch.stack([_checksum(t).to(device) for _, t in tensors]) if tensors else \
        torch.zeros(0, 2, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    for index, name in enumerate(names):
        differ = [rank for rank, g in zip(ranks, gathered) if not torch.equal(g[index], gathered[0][index])]
        if differ:
            raise ReplicaMismatch(f"replicas start from different weights: '{name}' differs between rank {ranks[0]} "
                                  f"and rank(s) {', '.join(map(str, differ))}; seed the initialisation the same "
                                  "on every rank, or load the same weights everywhere")


def _group_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
