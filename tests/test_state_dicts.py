"""State dicts are local: ``model.state_dict()`` and ``optimizer.state_dict()``
make no collective call (one rank may call them alone) and hold only this
rank's chunks; a DCP save moves no parameter bytes between ranks; torch's
``get_/set_model_state_dict`` and ``get_/set_optimizer_state_dict`` work with
``full_state_dict``, ``cpu_offload`` and ``broadcast_from_rank0`` as
torchtitan and Accelerate call them. (Resharding N -> M and export to plain
files: test_checkpoint_reshard.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_map

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock
from flatfsdp.bench.comm_bytes import CollectiveBytes
from harness import run_ranks
from training import CFG, batches, make_model, make_optimizer, shard_gpt, sharded_step

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _local_only(values) -> bool:
    """Every DTensor holds exactly the chunk its placement gives this rank."""
    for value in values:
        if not isinstance(value, DTensor):
            continue
        shape, _ = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        if tuple(value.to_local().shape) != tuple(shape):
            return False
    return True


WIDE = dataclasses.replace(CFG, d_model=128, vocab_size=256)
"""Wide enough that DCP's own metadata exchange (~30 KB here) is small beside the weights (2 MB)."""


def local_worker(rank, world, root):
    out = {}
    for strategy in STRATEGIES:
        model = make_model(cfg=WIDE)
        opt = make_optimizer("adamw", model.named_parameters())
        policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if strategy == "optim" else None
        model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                          mixed_precision_policy=policy)
        for x in batches(2, cfg=WIDE):
            sharded_step(model, opt, x, rank, world)
        with CommDebugMode() as comm:
            model_sd, optim_sd = model.state_dict(), opt.state_dict()
        optim_values = [v for entry in optim_sd["state"].values() for v in entry.values()]
        if rank == 0:  # alone: a collective in there would hang here
            model.state_dict()
            opt.state_dict()
        dist.barrier()
        flatfsdp.comm_account().reset()
        with CollectiveBytes() as moved:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{strategy}")
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        out[strategy] = dict(
            collectives=comm.get_total_counts(), local=_local_only(list(model_sd.values()) + optim_values),
            engine_bytes=flatfsdp.comm_account().total_bytes(),
            c10d_bytes=sum(v["bytes"] for v in moved.snapshot().values()), param_bytes=param_bytes,
            all_dtensors=all(isinstance(v, DTensor) for v in model_sd.values()))
    return out


def test_state_dicts_are_local_and_a_save_moves_no_parameters(tmp_path):
    for rank, out in enumerate(run_ranks(local_worker, 2, str(tmp_path))):
        for strategy, got in out.items():
            assert got["collectives"] == 0, (rank, strategy)
            assert got["local"] and got["all_dtensors"], (rank, strategy)
            assert got["engine_bytes"] == 0, (rank, strategy)
            # DCP itself exchanges its save plans (metadata): some KB against a
            # model of 2 MB.
            assert got["c10d_bytes"] < 0.05 * got["param_bytes"], (rank, strategy, got)


def _snapshot(model, opt) -> dict:
    """Copies (a replicated DTensor's full_tensor() is a view of the live value)."""
    state = {f"model.{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entry in opt.state.items():
        for key, value in entry.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            state[f"optim.{names[id(p)]}.{key}"] = value.clone()
    return state


def _copied(tree):
    """On CPU, cpu_offload=True hands out the live tensors of replicated values
    (``.cpu()`` of a CPU tensor is itself): copy them, as a save would."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def full_state_worker(rank, world):
    data = batches(4, seed=9)
    out = {}
    for strategy in STRATEGIES:
        for broadcast in (False, True):
            model, opt = shard_gpt(strategy)
            for x in data[:2]:
                sharded_step(model, opt, x, rank, world)
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = _copied(get_model_state_dict(model, options=options))
            optim_sd = _copied(get_optimizer_state_dict(model, opt, options=options))
            held = len(model_sd)
            before = _snapshot(model, opt)
            fresh, fresh_opt = shard_gpt(strategy)
            load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            if broadcast and rank != 0:
                model_sd, optim_sd = {}, {}
            elif not broadcast:
                # Without broadcast every rank needs the full dict: rank 0's.
                shared = [model_sd, optim_sd]
                dist.broadcast_object_list(shared, src=0)
                model_sd, optim_sd = shared
            set_model_state_dict(fresh, model_sd, options=load)
            set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=load)
            after = _snapshot(fresh, fresh_opt)
            continued = [sharded_step(model, opt, x, rank, world).item() for x in data[2:]]
            resumed = [sharded_step(fresh, fresh_opt, x, rank, world).item() for x in data[2:]]
            out[(strategy, broadcast)] = dict(
                held=held, same=before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
                continued=continued, resumed=resumed)
    return out


@pytest.mark.parametrize("broadcast", [False, True], ids=["every-rank", "broadcast_from_rank0"])
def test_full_state_dicts_round_trip_through_torchs_helpers(broadcast):
    per_rank = run_ranks(full_state_worker, 2)
    for rank, out in enumerate(per_rank):
        for strategy in STRATEGIES:
            got = out[(strategy, broadcast)]
            # cpu_offload + full_state_dict: rank 0 alone holds the values.
            assert (got["held"] > 0) == (rank == 0), (rank, strategy)
            assert got["same"], (rank, strategy)
            assert got["continued"] == got["resumed"], (rank, strategy)
