"""Low-bit weight gathers (param_gather_dtype): the sharded model computes
with exactly the deterministic quantize-dequantize of its main weights, made
once per optimizer step, and the account shows the bytes that moved.

Reference: an unsharded model whose forward weights are
``quantize_dequantize(master)`` each step (gradients applied to the fp32
master, as the sharded run applies them to its main weights)."""

from __future__ import annotations

import pytest

import flatfsdp
from flatfsdp.engine.layout.block_formats import BlockFormat, block_format, quantize_dequantize
from flatfsdp.models.gpt import TransformerBlock, lm_loss
from harness import run_ranks
from training import (batches, full_params, global_mean, local_slice, make_model, make_optimizer,
                      train_quantized_reference)

BLOCK = 16
STEPS = 3


def shard(front: str, strategy: str, **lowbit):
    model = make_model()
    if front == "one-call":
        opt = make_optimizer("adamw", model.named_parameters())
        return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                    lowbit_block=BLOCK, **lowbit)
    if front in ("hsdp", "hfsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        opt = make_optimizer("adamw", model.named_parameters())
        return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                    device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                    outer_dp_sharding_strategy="optim" if front == "hfsdp" else 0,
                                    lowbit_block=BLOCK, **lowbit)
    for block in model.blocks:
        flatfsdp.fully_shard(block, zero_dp_strategy=strategy, lowbit_block=BLOCK, **lowbit)
    flatfsdp.fully_shard(model, zero_dp_strategy=strategy, lowbit_block=BLOCK, **lowbit)
    return model, make_optimizer("adamw", model.named_parameters())


def plans(model) -> list:
    units = [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)]
    return [g.buffers.gather_codec for u in units for g in u._flatfsdp_state.groups
            if g.buffers.wire.gathers_codes and u is u._flatfsdp_state.modules[0]]


def gathered_vs_quantized_main(model, fmt: BlockFormat) -> float:
    """Largest distance between what the module computes with and the
    quantize-dequantize of the (gathered) main weights."""
    main = {n: p.full_tensor() for n, p in model.named_parameters()}
    gathered = full_params(model)
    return max((gathered[n] - quantize_dequantize(main[n], fmt)).abs().max().item() for n in main)


def run_config(rank, world, kind, front, strategy, grad=None):
    fmt = block_format(kind, BLOCK)
    extra = {} if grad is None else {"grad_reduce_dtype": grad}
    model, opt = shard(front, strategy, param_gather_dtype=kind, **extra)
    losses, distance = [], []
    for x in batches(STEPS):
        flatfsdp.comm_account().reset()
        x = local_slice(x, rank, world)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        kept_after_step = [p.kept is not None for p in plans(model)]
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        account = flatfsdp.comm_account().snapshot()
        distance.append(gathered_vs_quantized_main(model, fmt))
        by_dim = flatfsdp.comm_account().by_dim()  # with the next weights' codes, made for the check
    encodes = [p.encodes for p in plans(model)]
    rows = [p.nbytes for p in plans(model)]
    return dict(losses=losses, distance=distance, encodes=encodes, rows=rows, account=account, account_by_dim=by_dim,
                kept_after_step=kept_after_step)


def zero3_worker(rank, world):
    return {(kind, front): run_config(rank, world, kind, front, "optim_grads_params")
            for kind, front in (("int8", "one-call"), ("fp8", "one-call"), ("int8", "per-module"))}


@pytest.fixture(scope="module")
def zero3():
    return run_ranks(zero3_worker, 2)


@pytest.mark.parametrize("kind, front", [("int8", "one-call"), ("fp8", "one-call"), ("int8", "per-module")])
def test_zero3_computes_with_exactly_the_quantized_main_weights(zero3, kind, front):
    out = zero3[0][kind, front]
    assert max(out["distance"]) <= 1e-6, out["distance"]
    reference = train_quantized_reference(block_format(kind, BLOCK), batches(STEPS))
    assert abs(out["losses"][0] - reference[0]) <= 1e-6 * abs(reference[0])  # same weights, bit for bit
    assert max(abs(a - b) / b for a, b in zip(out["losses"], reference)) < 1e-5, (out["losses"], reference)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_once_per_step_and_the_account_shows_the_bytes(zero3, kind):
    out = zero3[0][kind, "one-call"]
    # ZeRO-3 gathers the blocks twice a step (forward, backward); the codes are
    # made once per optimizer step: one per step, and one more for the weights
    # after the last step, which the check reads.
    assert out["encodes"] == [STEPS + 1] * 3
    # The account counts each gather at its row bytes, once a step for every
    # unit: the blocks' backward gathers decode the codes kept from forward
    # (Note [kept codes]) and move nothing; the last block and the root stay
    # gathered from forward to backward anyway.
    root, block_0, block_1 = out["rows"]
    assert out["account"]["all_gather"]["bytes"] == block_0 + block_1 + root
    assert out["kept_after_step"] == [False] * 3  # no codes held past the backward that used them
    # Row bytes from the shapes (2 ranks, block 16, no padding in this model):
    # a matrix's rows as 1-byte codes plus one fp32 scale per 16; vectors in fp32.
    model = make_model()
    matrices = sum(p.numel() for p in model.blocks[0].parameters() if p.dim() >= 2)
    vectors = sum(p.numel() for p in model.blocks[0].parameters() if p.dim() < 2)
    assert block_0 == matrices + 4 * matrices // BLOCK + 4 * vectors
    assert block_0 < (matrices + vectors) * 4 * 0.35  # against 4 bytes an element in fp32


def strategies_worker(rank, world):
    if world == 4:
        return {(front, "int8"): run_config(rank, world, "int8", front, "optim_grads_params")
                for front in ("hsdp", "hfsdp")}
    return {(strategy, kind): run_config(rank, world, kind, "one-call", strategy)
            for strategy, kind in (("optim", "fp8"), ("optim_grads", "int8"))}


@pytest.mark.parametrize("world, config", [(2, ("optim", "fp8")), (2, ("optim_grads", "int8")), (4, ("hsdp", "int8")),
                                           (4, ("hfsdp", "int8"))])
def test_every_strategy_and_outer_dimension_computes_with_the_quantized_main_weights(world, config):
    out = _strategies(world)[0][config]
    assert max(out["distance"]) <= 1e-6, out["distance"]
    reference = train_quantized_reference(block_format(config[1], BLOCK), batches(STEPS))
    assert abs(out["losses"][0] - reference[0]) <= 1e-6 * abs(reference[0])
    assert max(abs(a - b) / b for a, b in zip(out["losses"], reference)) < 1e-5, (out["losses"], reference)
    # ZeRO-1/2 gather once per optimizer step anyway; HSDP/HFSDP (ZeRO-3 inside) twice: codes once either way.
    assert out["encodes"] == [STEPS + 1] * 3
    if config[0] == "hfsdp":
        # The outer dimension carries the step's codes too: three byte gathers
        # (codes, scales, vectors) per group, not the fp32 weights.
        outer = out["account_by_dim"]["dp_outer"]["all_gather"]
        assert outer["count"] == 3 * 3 and outer["bytes"] < 0.35 * 4 * sum(p.numel() for p in make_model().parameters())


_CACHE: dict = {}


def _strategies(world):
    if world not in _CACHE:
        _CACHE[world] = run_ranks(strategies_worker, world)
    return _CACHE[world]


def batched_ranks_worker(rank, world):
    """The same int8 training with passes as an accelerator takes them (not
    cache-sized: every whole-chunk rank dequantized in one pass), and as the
    host takes them (one pass a rank, cache-sized)."""
    from unittest import mock

    from flatfsdp.engine.comm import block_gather
    from flatfsdp.engine.layout import block_formats

    host = run_config(rank, world, "int8", "one-call", "optim_grads_params")
    batched = []
    original = block_gather.BlockScaledGather._ranks_at_once

    def counted(self, *args):
        batched.append(original(self, *args))
        return batched[-1]

    with mock.patch.object(block_formats, "passes_in_cache", lambda x: False), \
            mock.patch.object(block_gather, "passes_in_cache", lambda x: False), \
            mock.patch.object(block_gather.BlockScaledGather, "_ranks_at_once", counted):
        accelerator_like = run_config(rank, world, "int8", "one-call", "optim_grads_params")
    return dict(host=host, accelerator_like=accelerator_like, batched=batched)


def test_ranks_dequantized_in_one_pass_compute_with_the_same_weights():
    """Three ranks: uneven chunks, so a partial rank is still done alone after the batch."""
    out = run_ranks(batched_ranks_worker, 3)[0]
    assert max(out["batched"]) >= 2  # the one-pass path ran, over several ranks at once
    assert max(out["accelerator_like"]["distance"]) <= 1e-6
    assert out["accelerator_like"]["losses"] == out["host"]["losses"]
