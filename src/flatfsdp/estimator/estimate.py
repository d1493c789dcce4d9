"""``estimate``: per-rank memory and traffic of a model at many world sizes,
from the engine itself run as one rank of a fake world."""

from __future__ import annotations

from typing import Iterable

import torch

from flatfsdp.estimator.fake_world import fake_world
from flatfsdp.estimator.live_bytes import DispatchMeter
from flatfsdp.estimator.models import ModelSpec, resolve_model
from flatfsdp.estimator.rank_step import Layout, RankFigures, make_mesh, measure


def estimate_layout(spec: ModelSpec, layout: Layout, trace: bool = False, device_type: str = "cpu") -> RankFigures:
    """One rank's figures for ``layout``: the model is built on the meta device,
    sharded and stepped twice on fake tensors of ``device_type``; the second
    step is metered (and, ``trace``, its schedule recorded for the time model:
    on the device a probe timed, since a model runs other ops on another
    device -- a GPU's fused RMSNorm is five passes on a CPU)."""
    layout.check()
    with fake_world(layout.world) as fake_mode:
        _, mesh_kwargs = make_mesh(layout, device_type)  # real: a DeviceMesh reads its rank table
        with fake_mode, torch.device(device_type):
            return measure(spec, layout, mesh_kwargs, DispatchMeter(), trace=trace)


def estimate(model: str | ModelSpec, world_sizes: Iterable[int], *, strategy: str = "optim_grads_params",
             shard_size: int | None = None, outer_sharding: bool = False, tp: int = 1, bf16: bool = False,
             reduce_bf16: bool = False, defer_reductions: bool = False, param_gather_dtype: str | None = None,
             grad_reduce_dtype: str | None = None, micro_batch: int = 1, seq_len: int = 1024,
             units: list[str] | None = None, recompute: str = "none", trace: bool = False,
             device_type: str = "cpu") -> list[tuple[Layout, RankFigures]]:
    """Figures for each world size. ``shard_size``: HSDP, each replica's
    parameters sharded over that many data-parallel ranks; ``outer_sharding``:
    HFSDP; ``tp``: tensor-parallel ranks inside each data-parallel rank.
    ``model``: a name `resolve_model` understands, or a spec. ``trace``: record
    each row's step for the time model (``RankFigures.schedule``; predict.py);
    ``device_type``: the fake tensors' device (the one a probe timed; the
    figures in bytes are the same on any)."""
    spec = model if isinstance(model, ModelSpec) else resolve_model(model, units=units, recompute=recompute)
    if tp > 1 and spec.parallelize is None:
        raise ValueError(f"{spec.name}: no tensor-parallel plan for this model")
    rows = []
    for world in world_sizes:
        if world % tp:
            raise ValueError(f"world {world} is not a multiple of the tensor-parallel size {tp}")
        replicas = 1
        if shard_size is not None:
            if (world // tp) % shard_size:
                raise ValueError(f"world {world} is not a multiple of the HSDP shard size {shard_size}"
                                 + (f" x tensor-parallel size {tp}" if tp > 1 else ""))
            replicas = world // tp // shard_size
        layout = Layout(world=world, strategy=strategy, replicas=replicas, tp=tp,
                        outer_sharding=outer_sharding and replicas > 1, bf16=bf16, reduce_bf16=reduce_bf16,
                        defer_reductions=defer_reductions, param_gather_dtype=param_gather_dtype,
                        grad_reduce_dtype=grad_reduce_dtype, micro_batch=micro_batch, seq_len=seq_len)
        rows.append((layout, estimate_layout(spec, layout, trace, device_type)))
    return rows
