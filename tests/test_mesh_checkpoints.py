"""Checkpoints across N-D meshes (issue 11, outcome 7): a model saved from
one layout loads into any other with exact values -- HSDP 2x2 -> FSDP 4 ->
TP 2 x DP 2 -> HFSDP 2x2 -> HSDP again -> a plain file -- through the
project's atomic DCP save/load, on 4 real ranks."""

from __future__ import annotations

import functools

import torch

from harness import run_ranks
from test_meshes import MLP, _full, _net, _tp_net


def _layouts():
    from torch.distributed.device_mesh import init_device_mesh

    import flatfsdp

    def hybrid(seed, **kw):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        return flatfsdp.fully_shard(_net(seed), fsdp_unit_modules=[MLP], device_mesh=mesh, dp_shard_dim="dp_shard",
                                    dp_outer_dim="dp_outer", **kw)

    def fsdp(seed):
        return flatfsdp.fully_shard(_net(seed), fsdp_unit_modules=[MLP])

    def tensor_parallel(seed):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _tp_net(mesh["tp"])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(seed)  # different starting values: the load must overwrite every one
        return flatfsdp.fully_shard(model, fsdp_unit_modules=[MLP], device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")

    return [("hsdp", lambda s: hybrid(s)), ("fsdp", fsdp), ("tp", tensor_parallel),
            ("hfsdp", lambda s: hybrid(s, outer_dp_sharding_strategy="optim")), ("hsdp_again", lambda s: hybrid(s))]


def _chain(rank, world, root):
    import torch.distributed as dist

    from flatfsdp.checkpoint import export_checkpoint, load, save

    layouts = _layouts()
    model = layouts[0][1](0)
    model(torch.randn(2, 16)).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=0.01)  # values no layout starts from
    truth = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    diffs, placements = {}, {}
    for i, (name, make) in enumerate(layouts[1:]):
        directory = f"{root}/from_{layouts[i][0]}"
        save({"model": model.state_dict()}, directory)
        model = make(100 + i)
        state = {"model": model.state_dict()}
        load(state, directory)
        model.load_state_dict(state["model"])
        diffs[name] = max((_full(p) - truth[n]).abs().max().item() for n, p in model.named_parameters())
        placements[name] = str(model.blocks[0].w1.weight.placements)
    # Plain full tensors (an unsharded model's state dict) load into every layout too.
    for name, make in layouts[1:]:
        target = make(200)
        target.load_state_dict(truth)
        diffs[f"plain_into_{name}"] = max((_full(p) - truth[n]).abs().max().item()
                                          for n, p in target.named_parameters())
    save({"model": model.state_dict()}, f"{root}/last")
    if rank == 0:
        export_checkpoint(f"{root}/last", f"{root}/plain.pt")
        plain = torch.load(f"{root}/plain.pt", weights_only=True)
        diffs["plain"] = max((plain[n] - truth[n]).abs().max().item() for n in truth)
    dist.barrier()
    return diffs, placements


@functools.lru_cache(maxsize=1)
def _results(root):
    return run_ranks(_chain, 4, root, timeout=600)


def test_checkpoints_move_between_every_layout_with_exact_values(tmp_path_factory):
    results = _results(str(tmp_path_factory.mktemp("mesh_ckpt")))
    diffs, placements = results[0]
    assert diffs == {"fsdp": 0.0, "tp": 0.0, "hfsdp": 0.0, "hsdp_again": 0.0, "plain": 0.0, "plain_into_fsdp": 0.0,
                     "plain_into_tp": 0.0, "plain_into_hfsdp": 0.0, "plain_into_hsdp_again": 0.0}
    for other, _ in results[1:]:
        assert all(v == 0.0 for v in other.values())
    # The layouts really were different ones.
    assert placements == {"fsdp": "(Shard(dim=0),)", "tp": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                          "hfsdp": "(Shard(dim=0), Shard(dim=0))",
                          "hsdp_again": "(Replicate(), Shard(dim=0))"}
