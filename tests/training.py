"""Shared pieces for the multi-rank tests: a tiny GPT, deterministic batches,
an unsharded reference trainer and helpers to read a sharded model back."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import flatfsdp
from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock, lm_loss

# Every parameter's numel is a multiple of 32, so with align 8 and up to 4
# ranks no padding appears and buffer sizes equal the theory exactly.
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH = 4


def make_model(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(steps: int, seed: int = 1, cfg: GPTConfig = CFG, global_batch: int = GLOBAL_BATCH) -> list:
    """Arithmetic sequences with a random start and stride: learnable, so the
    loss visibly falls within a few steps."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(cfg.seq_len + 1)
    out = []
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (global_batch, 1), generator=gen)
        out.append((start + stride * positions) % cfg.vocab_size)
    return out


def local_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per]


def make_optimizer(name: str, params_source) -> torch.optim.Optimizer:
    """Two param groups (no weight decay on vectors), as real recipes do."""
    named = list(params_source)
    decay = [p for n, p in named if p.ndim >= 2 or "weight" in n and "ln" not in n and "emb" in n]
    no_decay = [p for n, p in named if not any(p is q for q in decay)]
    if name == "adamw":
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, foreach=True)
    if name == "adam":
        return torch.optim.Adam([{"params": decay}, {"params": no_decay, "lr": 1e-3}], lr=3e-3)
    if name == "sgd":
        return torch.optim.SGD([{"params": decay}, {"params": no_decay, "lr": 0.05}], lr=0.1, momentum=0.9)
    raise ValueError(name)


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_reference(steps: int, opt_name: str, bf16: bool = False, data=None,
                    device: torch.device | str = "cpu") -> tuple[list, dict]:
    """Unsharded training on the global batch. bf16: fp32 master weights, a bf16
    copy computes, gradients are cast up onto the master weights."""
    master = make_model().to(device)
    opt = make_optimizer(opt_name, master.named_parameters())
    compute = copy.deepcopy(master).to(torch.bfloat16) if bf16 else master
    losses = []
    for x in data or batches(steps):
        x = x.to(device)
        loss = lm_loss(compute(x[:, :-1]), x[:, 1:])
        loss.backward()
        if bf16:
            for p, q in zip(master.parameters(), compute.parameters()):
                p.grad = q.grad.float()
                q.grad = None
        opt.step()
        opt.zero_grad()
        if bf16:
            with torch.no_grad():
                for p, q in zip(master.parameters(), compute.parameters()):
                    q.copy_(p)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def train_quantized_reference(fmt, data: list, device: torch.device | str = "cpu") -> list[float]:
    """Unsharded training that computes each step with the quantize-dequantize
    (block format ``fmt``) of its fp32 weights, the gradients applied to those
    weights: what a low-bit weight gather must compute exactly."""
    from flatfsdp.engine.layout.block_formats import quantize_dequantize

    master = make_model().to(device)
    opt = make_optimizer("adamw", master.named_parameters())
    losses = []
    for x in data:
        x = x.to(device)
        compute = copy.deepcopy(master)
        with torch.no_grad():
            for p in compute.parameters():
                p.copy_(quantize_dequantize(p, fmt))
        loss = lm_loss(compute(x[:, :-1]), x[:, 1:])
        loss.backward()
        for p, q in zip(master.parameters(), compute.parameters()):
            p.grad = q.grad
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def shard_gpt(strategy, bf16: bool = False, opt_name: str = "adamw", **kwargs):
    model = make_model()
    opt = make_optimizer(opt_name, model.named_parameters())
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    return flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy,
                                mixed_precision_policy=policy, **kwargs)


def sharded_step(model, opt, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """One step on this rank's rows of the global batch ``x``; the local loss."""
    x = local_slice(x, rank, world)
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train_with_account(model, opt, rank: int, world: int, data: list) -> tuple[list, dict]:
    """Losses, and the communication account of the last step."""
    losses = []
    for x in data:
        flatfsdp.comm_account().reset()
        x = local_slice(x, rank, world)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses, flatfsdp.comm_account().snapshot()


def train_sharded(model, opt, rank: int, world: int, data: list) -> list:
    return train_with_account(model, opt, rank, world, data)[0]


def full_params(model) -> dict:
    """Every parameter at full size, gathered from the shards (model weights)."""
    units = [m for m in model.modules() if isinstance(m, flatfsdp.FSDPModule)]
    for unit in units:
        unit.unshard()
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for unit in units:
        unit.reshard()
    return params


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)
