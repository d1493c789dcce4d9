"""One rank's training step -- `flatfsdp train`'s forward, loss, backward,
clipping and AdamW, on a model sharded with `fully_shard`'s defaults -- with
what it holds and sends written down. The estimator runs it on fake tensors
under a fake process group; the check against reality runs the very same
function on real ranks -- only the meter differs.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flatfsdp
from flatfsdp.cli.flags import STRATEGIES
from flatfsdp.estimator.live_bytes import distinct_storages
from flatfsdp.estimator.models import ModelSpec
from flatfsdp.estimator.schedule_trace import StepTrace, tracing
from flatfsdp.models.gpt import lm_loss
from flatfsdp.train.step import apply_step, forward_backward

ZERO_NAMES = {"no_shard": "ZeRO-0", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


@dataclass(frozen=True)
class Layout:
    """How the model is sharded and what one step feeds it."""
    world: int
    strategy: str = "optim_grads_params"
    replicas: int = 1
    """HSDP: model replicas (the outer mesh dimension); each shards over
    world / (replicas x tp) ranks."""
    outer_sharding: bool = False
    """HFSDP: the optimizer state is sharded across the replicas too."""
    tp: int = 1
    """Tensor-parallel ranks (the innermost mesh dimension); data parallelism
    spans world / tp ranks."""
    bf16: bool = False
    """Compute in bf16 from fp32 main weights."""
    reduce_bf16: bool = False
    """Reduce (and keep unsharded) gradients in bf16 rather than fp32."""
    param_gather_dtype: str | None = None
    """Weights gathered as "int8" / "fp8" codes (docs/lowbit.md)."""
    grad_reduce_dtype: str | None = None
    """Gradients reduced as "int8" codes (or "bf16", as ``reduce_bf16``)."""
    defer_reductions: bool = False
    """``sync_model_each_microbatch=False``: reductions may still be in flight
    after backward, and cross-replica ones wait for the optimizer step."""
    micro_batch: int = 1
    seq_len: int = 1024

    @property
    def shard(self) -> int:
        """Ranks each replica's data-parallel shards span."""
        return self.world // (self.replicas * self.tp)

    def describe(self) -> str:
        text = ZERO_NAMES[self.strategy]
        if self.replicas > 1:
            kind = "HFSDP" if self.outer_sharding else "HSDP"
            text = f"{kind} {self.replicas}x{self.shard} {text}"
        text += f" TP{self.tp}" if self.tp > 1 else ""
        text += f" W{self.param_gather_dtype}" if self.param_gather_dtype else ""
        text += f" G{self.grad_reduce_dtype}" if self.grad_reduce_dtype else ""
        return text + (" deferred" if self.defer_reductions else "")

    def check(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if min(self.world, self.replicas, self.tp) < 1 or self.world % (self.replicas * self.tp):
            raise ValueError(f"world {self.world} does not split into {self.replicas} replica(s) x "
                             f"{self.tp} tensor-parallel rank(s)")
        if self.outer_sharding and (self.replicas < 2 or self.strategy != "optim_grads_params"):
            raise ValueError("HFSDP (outer sharding) needs replicas > 1 and optim_grads_params")


@dataclass
class RankFigures:
    """One rank's bytes: what it keeps, the high-water of a step, what it sends."""
    persistent: dict[str, int] = field(default_factory=dict)
    """By role: main weights, model weights, gradients, optimizer state."""
    start: int = 0
    """Everything alive when a step begins (persistent + the batch + buffers)."""
    peak: int = 0
    """The high-water mark of the step."""
    engine_transient_peak: int = 0
    """The engine's transient buffers at their high-water."""
    activations_peak: int = 0
    """Tensors born in the step at their high-water: activations, autograd's
    gradients and temporaries, the optimizer's temporaries."""
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes per step: {mesh dimension: {collective: bytes}}."""
    params: int = 0
    schedule: StepTrace | None = field(default=None, repr=False, compare=False)
    """The metered step's ops and collectives, in order (schedule_trace.py): what
    the time model replays. Not part of the JSON figures."""

    def to_json(self) -> dict:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "schedule"}


class Meter(Protocol):
    """Watches a run (``with meter:``) and meters one step of it (``with
    meter.step(known, resizable):``, ``known`` the tensors alive before it,
    ``resizable`` the engine's flat buffers). Afterwards it has ``start``,
    ``peak_total``, ``engine_transient_peak`` and ``other_new_peak`` in bytes."""

    def __enter__(self) -> "Meter": ...
    def __exit__(self, *exc) -> None: ...
    def step(self, known: list, resizable: list) -> contextlib.AbstractContextManager: ...


def make_mesh(layout: Layout, device_type: str = "cpu") -> tuple[DeviceMesh, dict]:
    """The mesh (of ``device_type``) and the fully_shard keywords naming its
    dimensions: ``(dp_outer, dp_shard, tp)``, each only where it has more than
    one rank (dp_shard always)."""
    dims = [("dp_outer", layout.replicas)] * (layout.replicas > 1) + [("dp_shard", layout.shard)]
    dims += [("tp", layout.tp)] * (layout.tp > 1)
    mesh = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims))
    kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard")
    if layout.replicas > 1:
        kwargs["dp_outer_dim"] = "dp_outer"
        if layout.outer_sharding:
            kwargs["outer_dp_sharding_strategy"] = "optim"
    if layout.tp > 1:
        kwargs["tp_dim"] = "tp"
    return mesh, kwargs


def shard(spec: ModelSpec, layout: Layout, mesh_kwargs: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model built on the meta device and sharded as `flatfsdp train` would,
    with its AdamW (weight decay on matrices only)."""
    model = spec.build()
    if layout.tp > 1:
        spec.parallelize(model, mesh_kwargs["device_mesh"]["tp"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if layout.bf16 else None,
                                           reduce_dtype=torch.bfloat16 if layout.reduce_bf16 else torch.float32)
    model, optimizer = flatfsdp.fully_shard(model, optimizer, fsdp_unit_modules=spec.units,
                                            zero_dp_strategy=layout.strategy, mixed_precision_policy=policy,
                                            init_model_with_meta_device=True, meta_init_seed=0,
                                            sync_model_each_microbatch=not layout.defer_reductions,
                                            param_gather_dtype=layout.param_gather_dtype,
                                            grad_reduce_dtype=layout.grad_reduce_dtype, **mesh_kwargs)
    if spec.from_checkpoint or layout.tp > 1:  # tensor-parallel shards are filled, not initialised, on meta
        flatfsdp.mark_initialized(model)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer, spec: ModelSpec, batch: torch.Tensor) -> None:
    # The estimator meters the plain loss over the model's whole logits (its figures model those).
    forward_backward(model, [batch], lambda m, x, y: lm_loss(spec.logits(m, x), y, reduction="sum"), per_token=False)
    apply_step(model, optimizer, global_tokens=1.0, per_token=False, clip_grad=1.0)


def measure(spec: ModelSpec, layout: Layout, mesh_kwargs: dict, meter: Meter, metered_steps: int = 1,
            trace: bool = False) -> RankFigures:
    """Shard, run a first step (lazy set-up, optimizer state), then meter the
    next ``metered_steps``: the steady state every later step repeats.
    ``trace``: also record the last metered step's schedule (``RankFigures.schedule``)."""
    model, optimizer = shard(spec, layout, mesh_kwargs)
    batch = torch.randint(0, spec.vocab_size, (layout.micro_batch, layout.seq_len + 1))
    with meter:
        step(model, optimizer, spec, batch)
        state = _optimizer_state(optimizer)
        known = list(model.parameters()) + list(model.buffers()) + state + [batch] + flatfsdp.held_tensors(model)
        schedule = None
        for _ in range(metered_steps):
            flatfsdp.comm_account().reset()
            with meter.step(known, flatfsdp.resizable_buffers(model)):
                with tracing() if trace else contextlib.nullcontext() as schedule:
                    step(model, optimizer, spec, batch)
    persistent = flatfsdp.persistent_bytes_by_role(model)
    persistent["optimizer state"] = _distinct_bytes(state)
    comm = {dim: {kind: entry["bytes"] for kind, entry in kinds.items()}
            for dim, kinds in flatfsdp.comm_account().by_dim().items()}
    return RankFigures(persistent=persistent, start=meter.start, peak=meter.peak_total,
                       engine_transient_peak=meter.engine_transient_peak,
                       activations_peak=meter.other_new_peak, comm=comm,
                       params=sum(p.numel() for p in model.parameters()), schedule=schedule)


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(s.nbytes() for s in distinct_storages(tensors))
