"""Units that pass tensors in dataclasses, namedtuples, dicts and lists train
like the unsharded model: the engine's hooks see every tensor of a unit's
inputs and outputs. (Before, a unit returning a dataclass got no pre-backward
hook, and its backward ran on released or still-arriving weights: wrong
gradients, silently.)"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

import flatfsdp
from harness import run_ranks
from training import max_diff


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


class Named(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _wrap(kind: str, x, y):
    return {"dataclass": lambda: Pair(x, y), "namedtuple": lambda: Named(x, y),
            "dict": lambda: {"x": x, "y": y}, "list": lambda: [x, y]}[kind]()


def _unwrap(kind: str, value):
    if kind == "dict":
        return value["x"], value["y"]
    if kind == "list":
        return value[0], value[1]
    return value.x, value.y


class Split(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return _wrap(self.kind, x, x.clone())


class Layer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, value):
        x, y = _unwrap(self.kind, value)
        return _wrap(self.kind, torch.tanh(self.a(x)), torch.tanh(self.b(y) + x))


class Join(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, value):
        x, y = _unwrap(self.kind, value)
        return x + y


KINDS = ["dataclass", "namedtuple", "dict", "list"]


def structured_worker(rank, world):
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = nn.Sequential(Split(kind), Layer(kind), Layer(kind), Layer(kind), Join(kind))
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[Layer], bucket_bytes=0)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            x = torch.randn(4 * world, 16, generator=gen)
            ref(x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(x[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        out[kind] = max_diff(full, {n: p.detach() for n, p in ref.named_parameters()})
    return out


@pytest.fixture(scope="module")
def distances():
    return run_ranks(structured_worker, 2)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_units_passing_containers_train_like_unsharded(distances, kind):
    assert distances[kind] < 1e-5, distances
