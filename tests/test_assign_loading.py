"""Accelerate's ``cpu_ram_efficient_loading`` path, 2 real ranks: build on the
meta device, shard, read the placements from ``model.state_dict()``, load the
real weights with ``load_state_dict(..., assign=True)``, then build the
optimizer. Run through Accelerate's own loader (``fsdp2_load_full_state_dict``
with a real ``Accelerator``) on a tiny Hugging Face Llama -- whose RMSNorm has
no ``reset_parameters()`` -- and as plain torch calls on a small net, each on
flatfsdp and on stock FSDP2, meta-built and real-built."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from harness import run_ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))  # no reset_parameters(), like LlamaRMSNorm
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x * self.scale)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fully_shard(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from flatfsdp import fully_shard
    return fully_shard


def _build(factory, meta: bool, seed: int):
    if meta:
        with torch.device("meta"):
            return factory()
    torch.manual_seed(seed)  # other values than the ones loaded: a load that is ignored shows
    return factory()


def _plain_sequence(rank: int, impl: str, meta: bool) -> dict:
    from torch.distributed.tensor import distribute_tensor

    fully_shard = _fully_shard(impl)
    torch.manual_seed(0)
    full = Net().state_dict()
    model = _build(Net, meta, seed=5)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    placed = model.state_dict()
    devices = sorted({value.device.type for value in placed.values()})
    model.load_state_dict({k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in placed.items()},
                          assign=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        loss = model(torch.randn(8, 16, generator=gen).chunk(2)[rank]).pow(2).mean()
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return dict(devices=devices, losses=losses)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def _accelerate_sequence(rank: int, impl: str) -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

    fully_shard = _fully_shard(impl)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    full = _tiny_llama().state_dict()
    model = _build(_tiny_llama, meta=True, seed=0)
    model.config.tie_word_embeddings = False
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    fsdp2_load_full_state_dict(accelerator, model, full if rank == 0 else {})
    # The rotary table is a non-persistent buffer: not in any state dict, so
    # a meta-built model recomputes it (as Accelerate does after loading).
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    ids = torch.randint(0, 64, (4, 16), generator=gen).chunk(2)[rank]  # one batch, learnt: the loss must fall
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def _scenarios(rank, world):
    out = {}
    for impl in ("flatfsdp", "torch"):
        for meta in (True, False):
            out[("plain", impl, meta)] = _plain_sequence(rank, impl, meta)
        out[("accelerate", impl)] = _accelerate_sequence(rank, impl)
    return out


@functools.lru_cache(maxsize=1)
def _results():
    return run_ranks(_scenarios, 2, timeout=900)


@pytest.mark.parametrize("meta", [True, False], ids=["meta", "real"])
def test_state_dict_then_assign_trains_like_stock_fsdp2(meta):
    for result in _results():
        ours, stock = result[("plain", "flatfsdp", meta)], result[("plain", "torch", meta)]
        assert ours["devices"] == stock["devices"] == (["meta"] if meta else ["cpu"])
        assert ours["losses"] == pytest.approx(stock["losses"], abs=1e-6)
        assert ours["losses"][-1] < ours["losses"][0]


def test_accelerate_cpu_ram_efficient_loading_trains_like_stock_fsdp2():
    for result in _results():
        ours, stock = result[("accelerate", "flatfsdp")], result[("accelerate", "torch")]
        assert ours == pytest.approx(stock, abs=1e-5)
        assert ours[-1] < ours[0]
