"""The two front doors. Both end in one loop over units (``_shard_units``):
the per-module form is a loop of one, the one-call form's units go
bottom-up, then the root. Their keywords are front/keyword_table's."""

from __future__ import annotations

import dataclasses
import inspect
from typing import NamedTuple

from torch import nn

from flatfsdp.engine.comm.fingerprint import take_first_replica, value_check_mode, warn_first_replica_taken
from flatfsdp.engine.front.keyword_table import FSDP2, MEGATRON, OWN, Door, GivenKeywords
from flatfsdp.engine.front.keywords import shard_options, spmd_mesh_of
from flatfsdp.engine.front.megatron_model import adopt_megatron_members
from flatfsdp.engine.front.optimizer import fully_shard_optimizer
from flatfsdp.engine.front.shard_unit import is_expert, replica_groups, shard_unit
from flatfsdp.engine.front.spmd_mesh import check_spmd_params
from flatfsdp.engine.front.tied_units import tied_unit_groups
from flatfsdp.engine.front.unit_classes import resolve_unit_classes
from flatfsdp.engine.layout.mesh import mesh_device
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.runtime.tied_params import params_used_outside

_P = inspect.Parameter
_MODULE = _P("module", _P.POSITIONAL_OR_KEYWORD, annotation="nn.Module | list[nn.Module]")
_OPTIMIZER = _P("optimizer", _P.POSITIONAL_OR_KEYWORD, default=None, annotation="torch.optim.Optimizer | None")
_FULLY_SHARD = Door("fully_shard", (_MODULE, _OPTIMIZER), MEGATRON, FSDP2 + OWN)
_FULLY_SHARD_MODEL = Door("fully_shard_model", (_MODULE.replace(annotation="nn.Module"),), MEGATRON, OWN)


class Unit(NamedTuple):
    """One call of shard_unit: the module(s), a name for messages, and the
    ids of parameters an outer unit owns (tied weights)."""

    modules: nn.Module | list[nn.Module]
    name: str = ""
    exclude: frozenset[int] = frozenset()


@_FULLY_SHARD.takes
def fully_shard(module, optimizer=None, *args, **kwargs):
    """Shard ``module``.

    * ``fully_shard(model, optimizer, fsdp_unit_modules=[Block], ...)`` shards every
      ``Block`` and then the root, binds ``optimizer``, returns ``(model, optimizer)``
      (Megatron-FSDP style; without an optimizer it returns the model). Every
      keyword of ``megatron_fsdp.fully_shard``, in its positional order; the
      model answers ``MegatronFSDP``'s members (docs/megatron.md).
    * ``fully_shard(block, mesh=..., mp_policy=..., reshard_after_forward=...)`` shards
      one unit and returns it (PyTorch FSDP2 style; call bottom-up, then on the root).
      A list of modules becomes one unit (gathered and reduced together).
      ``shard_placement_fn``, ``offload_policy`` and ``ignored_params`` are
      FSDP2's (see docs/fsdp2.md); an int ``reshard_after_forward`` is read as
      FSDP2's: 1 keeps the weights gathered, any other size releases them.

    ``shard_block`` (B elements, or an (R, C) tile) keeps rank boundaries out of
    blocks, for block-wise optimizer state: see docs/placements.md.

    N-D meshes (docs/meshes.md): ``dp_outer_dim`` (or FSDP2's 2-D mesh) gives
    HSDP; ``dp_shard_dim`` may name a flattened ``(dp_shard, cp)`` dimension;
    parameters that are already DTensors (tensor parallelism, ``tp_dim``)
    are sharded over the data-parallel dimensions only; ``expt_device_mesh``
    shards expert parameters (``allreduce=False``) over its ``dp_shard_dim``.
    FSDP2's ``dp_mesh_dims`` (``mesh`` is the whole SPMD mesh) is read as
    those arguments: see spmd_mesh.

    Fewer bytes (docs/lowbit.md): ``param_gather_dtype="int8"`` or ``"fp8"``
    gathers weights as block-scaled 8-bit codes made once per optimizer step;
    ``grad_reduce_dtype="bf16"`` or ``"int8"`` reduces gradients so;
    at most ``lowbit_block`` elements share one scale.

    Every keyword, its default, and how it is read or why it is a no-op:
    front/keyword_table.py, from which this signature is made.
    """
    given = _FULLY_SHARD.read(args, kwargs)
    if given.fsdp_unit_modules is None and optimizer is None:
        options = shard_options(given, per_module=True)
        if given.dp_mesh_dims is not None:
            check_spmd_params(module, spmd_mesh_of(given))
        _shard_units([Unit(module)], options)
        return module
    if isinstance(module, (list, tuple)):
        raise TypeError("a list of modules is sharded as one unit by the per-module form, "
                        "fully_shard([m1, m2], mesh=...); the one-call form takes the model")
    if given.shard_placement_fn is not None:
        raise TypeError("shard_placement_fn belongs to the per-module form fully_shard(module, ...); "
                        "the one-call form takes shard_block=")
    _shard_model(module, given)
    if optimizer is None:
        return module
    return module, fully_shard_optimizer(optimizer, model=module)


@_FULLY_SHARD_MODEL.takes
def fully_shard_model(module, *args, **kwargs):
    """Megatron-FSDP's model half: shard units bottom-up, then the root. Bind an
    optimizer afterwards with ``fully_shard_optimizer``."""
    _shard_model(module, _FULLY_SHARD_MODEL.read(args, kwargs))
    return module


def _shard_units(units: list[Unit], options: ShardOptions) -> None:
    """The one loop both doors end in."""
    for unit in units:
        shard_unit(unit.modules, options, name=unit.name, exclude=unit.exclude)


def _shard_model(model: nn.Module, given: GivenKeywords) -> None:
    """The one-call form: units bottom-up, then the root, which also gets
    Megatron-FSDP's ``MegatronFSDP`` members (megatron_model.py)."""
    options = shard_options(given, per_module=False)
    classes = resolve_unit_classes(given.fsdp_unit_modules or (), model)
    if _took_first_replica(model, options):
        options = dataclasses.replace(options, replica_values="skip")
    _shard_units(_units_bottom_up(model, classes), options)
    adopt_megatron_members(model, given, options, classes)


def _units_bottom_up(model: nn.Module, classes: tuple[type, ...]) -> list[Unit]:
    """Every instance of ``classes`` below the root, children before parents
    (so each unit owns only what no inner unit took; a parameter also used
    outside a unit -- tied weights -- is left to an outer one), then the root."""
    names = {id(m): n for n, m in model.named_modules()}
    inner = [m for m in model.modules() if m is not model and classes and isinstance(m, classes)]
    units = [Unit(group if len(group) > 1 else group[0], ", ".join(names[id(m)] for m in group),
                  params_used_outside(group, model))
             for group in reversed(tied_unit_groups(model, inner))]  # unit modules tied to each other: one unit
    return [*units, Unit(model, "<root>")]


def _took_first_replica(model: nn.Module, options: ShardOptions) -> bool:
    """The one-call form's answer to replicas built from different weights
    (an unseeded model on each rank): every rank takes the first rank's
    values, as DDP does, and one warning names the first parameter that
    differed. (Megatron-FSDP trains such replicas as a silent mix of shards;
    FLATFSDP_CHECK_REPLICAS=error refuses them.) Checked once for the whole
    model, so the units below need not check values again (True)."""
    if value_check_mode(options.replica_values, options.switches.check_replicas) != "broadcast":
        return False
    dims = replica_groups(options.mesh)
    if not dims:
        return False
    values = [(name, p) for name, p in model.named_parameters()
              if id(p) not in options.ignored and (options.expert_mesh is None or not is_expert(p))]
    found = take_first_replica(type(model).__name__, values, [dim.get_group() for dim in dims],
                               mesh_device(options.mesh.shard))
    if found:
        warn_first_replica_taken(found, stacklevel=4)
    return True
