"""What every contender trains: the same GPT from the same seed, the same
batches, the same optimizer. Only the parallel wrapper differs."""

from __future__ import annotations

import torch
from torch import nn

from flatfsdp.bench.options import BenchConfig
from flatfsdp.models.gpt import GPT, GPTConfig
from flatfsdp.models.llama import Llama, LlamaConfig


def device() -> torch.device:
    """This rank's device: the accelerator's current one, else the CPU (never names CUDA)."""
    if torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def gpt_config(cfg: BenchConfig) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab, seq_len=cfg.context, n_layer=cfg.layers, n_head=cfg.heads,
                     d_model=cfg.d_model, tie_embeddings=not cfg.untied)


def llama_config(cfg: BenchConfig) -> LlamaConfig:
    return LlamaConfig.shaped(n_layer=cfg.layers, d_model=cfg.d_model, n_head=cfg.heads, vocab_size=cfg.vocab)


def build_model(cfg: BenchConfig) -> nn.Module:
    """The fp32 model (``cfg.model``), identical on every rank and for every
    contender (seeded init, on the default device: the CPU unless the caller
    says otherwise). Its units are ``unit_modules(model)``."""
    torch.manual_seed(cfg.seed)
    return Llama(llama_config(cfg)) if cfg.model == "llama" else GPT(gpt_config(cfg))


def embedding_units(model: GPT, tied_unit: bool = False) -> list[nn.Module | list[nn.Module]]:
    """The token table and the output head, where each may be a sharding unit
    of its own. Apart from the root, the head is gathered while the blocks run
    and its gradient reduced at the start of backward, not with the root at
    the end; the root keeps only the position table and the final norm. A
    tied weight is one parameter: with ``tied_unit`` the table and the head
    are one unit of two modules (``fully_shard([tok_emb, lm_head])``; the
    one-call form makes the same unit of the two classes), else the root's."""
    if model.lm_head.weight is model.tok_emb.weight:
        return [[model.tok_emb, model.lm_head]] if tied_unit else []
    return [model.tok_emb, model.lm_head]


def unit_modules(model: nn.Module, tied_unit: bool = False) -> list[nn.Module | list[nn.Module]]:
    """The units every sharding contender makes below the root, bottom-up: the
    blocks, and the GPT's embedding units (``embedding_units``; a list is one
    unit of several modules)."""
    extra = embedding_units(model, tied_unit) if isinstance(model, GPT) else []
    return list(model.blocks) + extra


def unit_classes(model: nn.Module, tied_unit: bool = False) -> list[type]:
    """``unit_modules`` as the one-call front door's ``fsdp_unit_modules`` names them."""
    modules = [m for unit in unit_modules(model, tied_unit) for m in (unit if isinstance(unit, list) else [unit])]
    return list(dict.fromkeys(type(m) for m in modules))


def schedule_embedding_units(model: nn.Module, rows_only: bool = False) -> None:
    """After sharding ``unit_modules`` (either engine: FSDP2's unit controls).
    The token table's backward needs no weights (a lookup's gradient is the
    incoming gradient scattered into rows), nor does the head's (the chunked
    loss made its gradients in forward): not gathered for it. The head now
    runs last in forward, so the last block keeps its weights from forward to
    backward, as it does when it runs last: no extra gather per step.
    ``rows_only`` (flatfsdp, ZeRO-3 with plain gathers): the token table's
    forward gathers only the rows of the batch's ids (``set_lookup_rows_only``;
    a tied unit then gathers the whole table for the head while the blocks run)."""
    if not (isinstance(model, GPT) and hasattr(model.tok_emb, "set_unshard_in_backward")):
        return  # the root's: no unit of their own
    model.tok_emb.set_unshard_in_backward(False)
    model.blocks[-1].set_reshard_after_forward(False)
    if rows_only:
        model.tok_emb.set_lookup_rows_only(True)


def param_count(model: nn.Module) -> int:
    """Unique parameters (the tied embedding counted once), the basis of every theory figure."""
    return sum(p.numel() for p in model.parameters())


def build_optimizer(params, cfg: BenchConfig) -> torch.optim.Optimizer:
    """AdamW for everyone; foreach so no contender pays a per-tensor Python loop."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01, foreach=True)


def make_batches(cfg: BenchConfig, rank: int, world: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) for every step, drawn before timing starts.

    Each step draws one global batch of ``batch * world`` sequences from a
    generator seeded by (seed, step) and each rank keeps its own rows, so every
    contender sees the same data whatever the order of runs.
    """
    out = []
    for step in range(cfg.warmup + cfg.steps):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch * world, cfg.seq_len + 1), generator=gen)
        mine = tokens[rank * cfg.batch:(rank + 1) * cfg.batch].to(dev)
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out
