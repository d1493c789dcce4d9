"""Bytes and memory per rank of N-D layouts on one model, flatfsdp against
PyTorch FSDP2, all in one run: ``python -m flatfsdp.bench.meshes``.

Layouts (4 ranks): FSDP over 4; HSDP 2 x 2; flatfsdp's HFSDP 2 x 2 (FSDP2 has
no counterpart); FSDP 2 x TP 2 (column- then row-parallel MLPs). Bytes are
counted the same way for both engines, at the c10d operators every
collective passes through (bench/comm_bytes.py), for one training step after
a warm-up step; flatfsdp also reports them per mesh dimension. Memory is what
each engine keeps on a rank between steps: its sharded parameters (FSDP2) or
persistent buffers (flatfsdp), gradients, and the optimizer's state.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from flatfsdp.launch import launch

LAYOUTS = ("fsdp", "hsdp", "hfsdp", "fsdp_tp")


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class _Model(nn.Module):
    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(_MLP(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _shard(engine: str, layout: str, model: _Model):
    """Shard ``model`` per unit, FSDP2-style, with either engine's fully_shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import flatfsdp

    world = dist.get_world_size()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = flatfsdp.fully_shard
    if layout == "hfsdp":  # Megatron-FSDP's keywords: flatfsdp only
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        return flatfsdp.fully_shard(model, fsdp_unit_modules=[_MLP], device_mesh=mesh, dp_shard_dim="dp_shard",
                                    dp_outer_dim="dp_outer", outer_dp_sharding_strategy="optim")
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        full = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, full["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        mesh = full["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _measure(engine: str, layout: str, dim: int, blocks: int) -> dict:
    import flatfsdp
    from flatfsdp.bench.comm_bytes import CollectiveBytes

    torch.manual_seed(0)
    model = _shard(engine, layout, _Model(dim, blocks))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, dim)
    for step in range(2):  # the second step is measured: lazy initialisation is behind us
        counter = CollectiveBytes()
        flatfsdp.comm_account().reset()
        with counter:
            model(x).pow(2).mean().backward()
            opt.step()
            grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
            opt.zero_grad()
    state = _local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    if engine == "flatfsdp":
        kept = flatfsdp.persistent_buffer_bytes(model)  # weights, main weights, main grads
    else:
        kept = _local_bytes(model.parameters()) + grads
    return {"bytes": counter.snapshot(), "by_dim": flatfsdp.comm_account().by_dim() if engine == "flatfsdp" else None,
            "memory": kept + state, "optimizer_state": state}


def run(dim: int = 512, blocks: int = 4, world: int = 4) -> list[dict]:
    rows = []
    for layout in LAYOUTS:
        for engine in ("fsdp2", "flatfsdp"):
            if engine == "fsdp2" and layout == "hfsdp":
                continue
            record = launch(_measure, world, engine, layout, dim, blocks)
            rows.append({"layout": layout, "engine": engine, **record})
    return rows


def _kinds(row: dict) -> dict[str, int]:
    """Bytes per collective kind. flatfsdp runs gathers and reduce-scatters as
    point-to-point exchanges on gloo, which the c10d counter sees as sends:
    its own account (same unit: the full buffer a collective covers) is used."""
    if row["by_dim"] is None:
        return {k: v["bytes"] for k, v in row["bytes"].items()}
    totals: dict[str, int] = {}
    for kinds in row["by_dim"].values():
        for kind, entry in kinds.items():
            totals[kind] = totals.get(kind, 0) + entry["bytes"]
    return totals


def _table(rows: list[dict]) -> str:
    lines = ["| layout | engine | all_gather MB | reduce_scatter MB | all_reduce MB | memory / rank MB |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        kinds = _kinds(row)
        mb = {k: kinds.get(k, 0) / 2**20 for k in ("all_gather", "reduce_scatter", "all_reduce")}
        lines.append(f"| {row['layout']} | {row['engine']} | {mb['all_gather']:.2f} | {mb['reduce_scatter']:.2f} | "
                     f"{mb['all_reduce']:.2f} | {row['memory'] / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m flatfsdp.bench.meshes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    rows = run(args.dim, args.blocks)
    print(json.dumps(rows, indent=1) if args.json else _table(rows))
    for row in rows:
        if row["by_dim"]:
            print(f"flatfsdp {row['layout']} per mesh dimension: {json.dumps(row['by_dim'])}")
    return rows


if __name__ == "__main__":
    main()
