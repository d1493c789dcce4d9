"""How each contender wraps the same fp32 model and takes one training step.

A contender is set up on every rank after the model is built and returns a
``Trainer``: ``step(x, y)`` runs forward, backward and the optimizer step and
returns the (detached) loss. Optional contenders say why they cannot run
instead of failing the whole benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from flatfsdp.bench import ds
from flatfsdp.bench.floor import FloorTrainer
from flatfsdp.bench.link_activity import StepMarks
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.theory import STRATEGY_STAGE
from flatfsdp.bench.workload import build_optimizer, schedule_embedding_units, unit_classes, unit_modules


@dataclass
class Trainer:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """One optimizer step on this rank's batch; returns the detached loss."""
    stage: int | None
    """ZeRO stage whose theory applies (None: no communication at all)."""
    account: object | None = None
    """The engine's own byte account (reset() / snapshot()), if it keeps one."""
    marks: StepMarks = field(default_factory=StepMarks)
    """Where ``step`` marks its phases (off unless ``--link-timeline`` turns it on;
    a step that marks none is timed whole)."""


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Trainer:
    marks = StepMarks()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, targets=y)
        marks.note("loss")
        loss.backward()
        marks.note("backward")
        optimizer.step()
        marks.note("optimizer")
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return Trainer(step, stage=3, marks=marks)


def setup_floor(model: nn.Module, cfg: BenchConfig) -> Trainer:
    trainer = FloorTrainer(model, lambda params: build_optimizer(params, cfg), cfg.compute_dtype)
    return Trainer(trainer.step, stage=None)


def _maybe_compiled(model: nn.Module, compile_model: bool) -> nn.Module:
    """``torch.compile`` of the whole sharded model, as HF Trainer's
    ``torch_compile=True`` does (default inductor backend; the untimed warm-up
    steps absorb the compilation)."""
    return torch.compile(model) if compile_model else model


def hybrid_mesh(device_type: str, cfg: BenchConfig, names: tuple[str, str]):
    """The (outer, shard) mesh of HSDP and HFSDP. Ranks are numbered node-major
    (torchrun), and the mesh is row-major, so a shard group is ranks
    [o * inner, (o + 1) * inner): with --nnodes 2 the outer dimension is the node
    dimension -- replicas across nodes, shards within one. Without, two replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    world, outer = dist.get_world_size(), cfg.nodes if cfg.nodes > 1 else 2
    if world % outer:
        raise ValueError(f"HSDP over {outer} replicas needs a world divisible by {outer}, got {world} ranks")
    return init_device_mesh(device_type, (outer, world // outer), mesh_dim_names=names)


def setup_fsdp2(model: nn.Module, cfg: BenchConfig, compile_model: bool = False, hybrid: bool = False) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    # A 2-D mesh is FSDP2's HSDP: replicate over dim 0, shard over dim 1.
    mesh = (hybrid_mesh(device_type, cfg, ("replicate", "shard")) if hybrid
            else init_device_mesh(device_type, (dist.get_world_size(),)))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=cfg.reduce_dtype) if cfg.bf16
              else MixedPrecisionPolicy())
    for unit in unit_modules(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    schedule_embedding_units(model)
    # FSDP2 swaps parameters for DTensors: its optimizer is built after sharding.
    optimizer = build_optimizer(model.parameters(), cfg)
    return _plain_step(_maybe_compiled(model, compile_model), optimizer)


FLATFSDP_MESH_NAMES = ("dp_outer", "dp_shard")


def setup_flatfsdp(model: nn.Module, cfg: BenchConfig, on_nonfinite: str | None = None,
                   compile_model: bool = False, outer: str | None = None, device_mesh=None) -> Trainer:
    """``outer``: None (one shard group of every rank), or the outer dimension's
    ``outer_dp_sharding_strategy`` on the hybrid mesh: "no_shard" (HSDP), "optim" (HFSDP).
    ``device_mesh``: that mesh, made already (the estimator makes it outside its fake tensors)."""
    import flatfsdp

    mesh = {} if device_mesh is None else dict(device_mesh=device_mesh)
    if outer is not None:
        if device_mesh is None:
            device_mesh = hybrid_mesh(next(model.parameters()).device.type, cfg, FLATFSDP_MESH_NAMES)
        mesh = dict(device_mesh=device_mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                    outer_dp_sharding_strategy=outer)

    # Megatron-FSDP style: the optimizer is built on the plain model, then bound.
    optimizer = build_optimizer(model.parameters(), cfg)
    policy = (flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=cfg.reduce_dtype)
              if cfg.bf16 else None)
    lowbit = dict(param_gather_dtype=cfg.param_gather_dtype,
                  grad_reduce_dtype=None if cfg.grad_reduce_dtype == "fp32" else cfg.grad_reduce_dtype)
    model, optimizer = flatfsdp.fully_shard(model, optimizer, fsdp_unit_modules=unit_classes(model, cfg.tied_unit),
                                            zero_dp_strategy=cfg.strategy, mixed_precision_policy=policy,
                                            **lowbit, **mesh)
    # Row lookups read a ZeRO-3 shard gathered plainly (not low-bit codes) from other ranks.
    shard_ranks = dist.get_world_size() // (1 if outer is None else device_mesh.size(0))
    schedule_embedding_units(model, rows_only=cfg.strategy == "optim_grads_params" and cfg.param_gather_dtype is None
                             and shard_ranks > 1)
    if on_nonfinite is not None:
        flatfsdp.set_on_nonfinite(model, on_nonfinite)
    return replace(_plain_step(_maybe_compiled(model, compile_model), optimizer),
                   stage=STRATEGY_STAGE[cfg.strategy], account=flatfsdp.comm_account())


def setup_deepspeed(model: nn.Module, cfg: BenchConfig) -> Trainer:
    trainer = ds.DeepSpeedTrainer(model, build_optimizer(model.parameters(), cfg),
                                  ds.ds_config(cfg.batch, cfg.bf16, cfg.reduce_dtype))
    return Trainer(trainer.step, stage=3)


def _full_bit(cfg: BenchConfig) -> BenchConfig:
    """The same run without low-bit weights or gradients (fp32 model: fp32 reduction)."""
    grads = cfg.grad_reduce_dtype if cfg.bf16 and cfg.grad_reduce_dtype != "int8" else "fp32"
    return replace(cfg, param_gather_dtype=None, grad_reduce_dtype=grads)


FLATFSDP_VARIANTS = {
    "flatfsdp": dict(), "flatfsdp-nocheck": dict(on_nonfinite="off"), "flatfsdp-fullbit": dict(full_bit=True),
    "flatfsdp-compiled": dict(compile_model=True), "flatfsdp-hsdp": dict(outer="no_shard"),
    "flatfsdp-hfsdp": dict(outer="optim"),
}
"""How each flatfsdp contender calls ``setup_flatfsdp`` (``full_bit``: on ``_full_bit(cfg)``)."""


def setup_flatfsdp_variant(name: str, model: nn.Module, cfg: BenchConfig, device_mesh=None) -> Trainer:
    options = dict(FLATFSDP_VARIANTS[name])
    if options.pop("full_bit", False):
        cfg = _full_bit(cfg)
    return setup_flatfsdp(model, cfg, device_mesh=device_mesh, **options)


def _flatfsdp_unavailable() -> str | None:
    try:
        import flatfsdp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- the engine is work in progress; say why, do not crash
        return f"flatfsdp does not import: {type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    setup: Callable[[nn.Module, BenchConfig], Trainer]
    unavailable: Callable[[], str | None] = lambda: None
    preload: Callable[[], None] = lambda: None
    bytes_source: str = "torch.distributed c10d ops (dispatch-mode counter)"


REGISTRY = {c.name: c for c in (
    Contender("floor", "no-comm floor", setup_floor, bytes_source="none: no communication"),
    Contender("fsdp2", "FSDP2", setup_fsdp2),
    Contender("flatfsdp", "flatfsdp", lambda m, c: setup_flatfsdp_variant("flatfsdp", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("flatfsdp-nocheck", "flatfsdp, no NaN flag", lambda m, c: setup_flatfsdp_variant("flatfsdp-nocheck", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("flatfsdp-fullbit", "flatfsdp, no low-bit",
              lambda m, c: setup_flatfsdp_variant("flatfsdp-fullbit", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("fsdp2-compiled", "FSDP2, torch.compile", lambda m, c: setup_fsdp2(m, c, compile_model=True)),
    Contender("flatfsdp-compiled", "flatfsdp, torch.compile",
              lambda m, c: setup_flatfsdp_variant("flatfsdp-compiled", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("fsdp2-hsdp", "FSDP2-HSDP", lambda m, c: setup_fsdp2(m, c, hybrid=True)),
    Contender("flatfsdp-hsdp", "flatfsdp HSDP", lambda m, c: setup_flatfsdp_variant("flatfsdp-hsdp", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("flatfsdp-hfsdp", "flatfsdp HFSDP", lambda m, c: setup_flatfsdp_variant("flatfsdp-hfsdp", m, c),
              unavailable=_flatfsdp_unavailable, bytes_source="engine account (flatfsdp.comm_account)"),
    Contender("deepspeed", "DeepSpeed ZeRO-3", setup_deepspeed, unavailable=ds.unavailable_reason,
              preload=ds.preload),
)}
