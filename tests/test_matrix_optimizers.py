"""Optimizers that need more than elementwise math on the local chunk.

* ``torch.optim.Muon`` (orthogonalised updates of whole matrices) trains a
  sharded model through DTensor's own operators, at 2 and 4 ranks, ZeRO-1/2/3,
  as close to unsharded training as FSDP2 gets on the same script.
* A block-wise optimizer (int8 momentum, one scale per block of consecutive
  elements) cuts blocks from each rank's local chunk: with ``shard_block`` no
  block straddles two ranks and training equals the unsharded run; without
  it, blocks straddle and it does not.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import flatfsdp
from flatfsdp.models.gpt import TransformerBlock, lm_loss
from harness import run_ranks
from training import batches, full_params, global_mean, local_slice, make_model, max_diff

STEPS = 6
ZERO_STAGES = ["optim", "optim_grads", "optim_grads_params"]


# ---- Muon ------------------------------------------------------------------------------------

def muon_and_adamw(named):
    """Muon on the blocks' matrices (as its authors recommend); AdamW on the rest."""
    named = list(named)
    matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("blocks."))]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3)]


def _train(model, optimizers, data, rank=0, world=1):
    losses = []
    for x in data:
        x = local_slice(x, rank, world)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(global_mean(loss) if world > 1 else loss.item())
    return losses


def muon_worker(rank, world):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    data = batches(STEPS, seed=4)
    ref = make_model()
    out = {"ref_losses": _train(ref, muon_and_adamw(ref.named_parameters()), data)}
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = make_model()
    for block in model.blocks:
        fsdp2_fully_shard(block)
    fsdp2_fully_shard(model)
    _train(model, muon_and_adamw(model.named_parameters()), data, rank, world)
    out["fsdp2"] = max_diff({n: p.full_tensor() for n, p in model.named_parameters()}, ref_params)
    for strategy in ZERO_STAGES:
        model = flatfsdp.fully_shard_model(make_model(), fsdp_unit_modules=[TransformerBlock],
                                           zero_dp_strategy=strategy)
        optimizers = [flatfsdp.fully_shard_optimizer(o, model) for o in muon_and_adamw(model.named_parameters())]
        losses = _train(model, optimizers, data, rank, world)
        out[strategy] = (max_diff(full_params(model), ref_params), losses)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def muon(request):
    return request.param, run_ranks(muon_worker, request.param)[0]


@pytest.mark.parametrize("strategy", ZERO_STAGES)
def test_muon_trains_as_close_to_unsharded_as_fsdp2(muon, strategy):
    world, out = muon
    distance, losses = out[strategy]
    # Muon runs its Newton-Schulz iteration in bf16: sharded or not, the
    # result moves with the last bits of the gradients. FSDP2 on the same
    # script sets the bar.
    assert distance <= max(out["fsdp2"], 1e-6) * 1.25, (world, strategy, distance, out["fsdp2"])
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(out["ref_losses"]), rtol=1e-3, atol=1e-3)


# ---- block-wise optimizer state --------------------------------------------------------------

BLOCK = 256


class BlockwiseInt8Momentum(torch.optim.Optimizer):
    """SGD whose momentum lives in int8, with one absmax scale per block of
    ``block`` consecutive elements of the tensor it is handed -- for a sharded
    parameter, its local chunk. 8-bit optimizers work this way."""

    def __init__(self, params, lr: float, momentum: float, block: int):
        super().__init__(params, dict(lr=lr, momentum=momentum, block=block))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = p.to_local() if isinstance(p, DTensor) else p
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                state = self.state[p]
                blocks = _blocks(grad.reshape(-1), group["block"])
                if "codes" not in state:
                    momentum = blocks.clone()
                else:
                    momentum = state["codes"].float() * state["scales"] * group["momentum"] + blocks
                scales = momentum.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
                state["codes"] = torch.round(momentum / scales).to(torch.int8)
                state["scales"] = scales
                update = (state["codes"].float() * scales).reshape(-1)[:local.numel()]
                local.add_(update.view_as(local), alpha=-group["lr"])


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    rows = max(1, math.ceil(flat.numel() / block))
    padded = flat.new_zeros(rows * block)
    padded[:flat.numel()] = flat
    return padded.view(rows, block)


def _block_aligned(model) -> bool:
    """Every rank's chunk starts on a block boundary of the flattened parameter."""
    aligned = True
    for p in model.parameters():
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        start = sum(o * s for o, s in zip(offset, torch.empty(p.shape).stride())) if offset else 0
        if shape and math.prod(shape) and start % BLOCK:
            aligned = False
    flag = torch.tensor(int(aligned))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def blockwise_worker(rank, world):
    data = batches(STEPS, seed=6, global_batch=12)
    ref = make_model()
    _train(ref, [BlockwiseInt8Momentum(ref.parameters(), lr=0.05, momentum=0.9, block=BLOCK)], data)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out = {}
    for aligned in (True, False):
        model = make_model()
        opt = BlockwiseInt8Momentum(model.parameters(), lr=0.05, momentum=0.9, block=BLOCK)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock],
                                              shard_block=BLOCK if aligned else None)
        out[("replicated", aligned)] = [str(w.message) for w in caught if "stay replicated" in str(w.message)]
        out[("aligned", aligned)] = _block_aligned(model)
        _train(model, [opt], data, rank, world)
        out[aligned] = max_diff(full_params(model), ref_params)
    return out


def test_block_aligned_shards_keep_blockwise_state_whole():
    # 3 ranks: torch.chunk's rows straddle 256-element blocks in most parameters.
    out = run_ranks(blockwise_worker, 3)[0]
    assert out[("aligned", True)] and not out[("aligned", False)]
    # Parameters no dimension splits in whole blocks stay whole, and say so.
    assert out[("replicated", True)] and not out[("replicated", False)]
    # Aligned: the same blocks, scales and codes as unsharded training; only
    # the gradients' last bits differ (now and then flipping one code).
    assert out[True] < 2e-5, out
    # Straddling blocks get other scales, so other int8 codes: training drifts.
    assert out[False] > 20 * max(out[True], 1e-7), out


# ---- tiles: a parameter whose rows would split tiles is chunked by columns ------------------

class _Tiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(32, 6)    # weight (6, 32): 3 rows a rank split 4-row tiles; 16 columns are 2 tiles
        self.head = nn.Linear(6, 8)     # weight (8, 6): 4 rows a rank, whole tiles

    def forward(self, x):
        return self.head(torch.tanh(self.wide(x)))


def tiles_worker(rank, world):
    out = {}
    for strategy in ("optim", "optim_grads_params"):
        for bf16 in (False, True):
            torch.manual_seed(0)
            ref = _Tiled()
            model = _Tiled()
            model.load_state_dict(ref.state_dict())
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the 1-D biases stay replicated, and say so
                model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[], zero_dp_strategy=strategy,
                                                  shard_block=(4, 8), mixed_precision_policy=policy)
            placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
            local_shape = tuple(model.wide.weight.to_local().shape)
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(2 * world, 32, generator=gen)
                ref(x).square().mean().backward()
                ref_opt.step()
                ref_opt.zero_grad()
                model(x[rank * 2:(rank + 1) * 2]).square().mean().backward()
                opt.step()
                opt.zero_grad()
            distance = max_diff({n: p.full_tensor() for n, p in model.named_parameters()},
                                {n: p.detach() for n, p in ref.named_parameters()})
            out[(strategy, bf16)] = placements, local_shape, distance
    return out


def test_tiles_that_rows_would_split_are_chunked_by_columns():
    for (strategy, bf16), (placements, local_shape, distance) in run_ranks(tiles_worker, 2)[0].items():
        assert placements["wide.weight"] == (Shard(1),) and local_shape == (6, 16), (strategy, placements)
        assert placements["head.weight"] == (Shard(0),), (strategy, placements)
        assert distance < (2e-2 if bf16 else 1e-6), (strategy, bf16, distance)
