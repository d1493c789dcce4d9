"""A small checkpoint in Megatron-Core's torch_dist layout, written without Megatron-Core.

Laid out as Megatron-LM's ``save_checkpoint(--ckpt-format torch_dist
--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable)`` lays out a
GPT of the local layer spec on two data-parallel ranks (compared entry by entry
with one written by Megatron-LM 0.19.2 on this machine): ``metadata.json`` naming
the torch_dist backend; each layer-stacked tensor (layer first) written as one
chunk per layer, as the two ranks wrote them; the distributed optimizer's
``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>`` beside the weights; the
per-layer ``_extra_state`` objects; and the ShardedObjects ``common_state``
(args, iteration, optimizer groups, scheduler) and ``rng_state``, each saved as
the one-item list Megatron-Core's writer makes of it. The argument namespace
holds an enum of a module that is importable only while the checkpoint is
written (Megatron-Core's enums are not importable where the converter runs).
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import os
import random
import sys
import types
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

V, H, F, LAYERS, S = 32, 8, 16, 2, 8
ITERATION = 7
STEP = 7.0
STAND_IN = "megatron_stand_in_enums"
"""The module the saved enum belongs to; importable only inside `stand_in_module()`."""


class AttnBackend(enum.Enum):
    auto = 5


@contextmanager
def stand_in_module():
    """The enum's module, importable for the duration (to write, or to compare what was carried)."""
    module = types.ModuleType(STAND_IN)
    module.AttnBackend = AttnBackend
    AttnBackend.__module__ = STAND_IN
    sys.modules[STAND_IN] = module
    try:
        yield module
    finally:
        del sys.modules[STAND_IN]


def layer_shapes(gated: bool) -> dict[str, tuple[int, ...]]:
    """One layer's tensors, named as torch_dist names them (TransformerEngine's fused names)."""
    fc1 = 2 * F if gated else F
    return {"self_attention.linear_qkv.layer_norm_weight": (H,), "self_attention.linear_qkv.layer_norm_bias": (H,),
            "self_attention.linear_qkv.weight": (3 * H, H), "self_attention.linear_qkv.bias": (3 * H,),
            "self_attention.linear_proj.weight": (H, H), "self_attention.linear_proj.bias": (H,),
            "mlp.linear_fc1.layer_norm_weight": (H,), "mlp.linear_fc1.layer_norm_bias": (H,),
            "mlp.linear_fc1.weight": (fc1, H), "mlp.linear_fc1.bias": (fc1,),
            "mlp.linear_fc2.weight": (H, F), "mlp.linear_fc2.bias": (H,)}


def model_tensors(gated: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embedding.word_embeddings.weight": (V, H), "embedding.position_embeddings.weight": (S, H),
              **{f"decoder.layers.{k}": (LAYERS, *s) for k, s in layer_shapes(gated).items()},
              "decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,),
              "output_layer.weight": (V, H)}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _boxes(key: str, shape) -> list[tuple[tuple, tuple]]:
    if key.startswith("decoder.layers."):  # one layer per rank
        return [((layer,) + (0,) * (len(shape) - 1), (1, *shape[1:])) for layer in range(shape[0])]
    if len(shape) == 2 and shape[0] > 4:  # uneven rows, as a bucket boundary splits them
        return [((0, 0), (5, shape[1])), ((5, 0), (shape[0] - 5, shape[1]))]
    return [((0,) * len(shape), tuple(shape))]


def chunked(full: torch.Tensor, boxes) -> torch.Tensor:
    """``full`` written as the chunks ``boxes`` (DCP's own hooks, which DTensor implements)."""
    t = full.clone()
    props = TensorProperties.create_from_tensor(full)

    def items(fqn, _obj):
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), torch.Size(s)),
                                                      properties=props, size=full.size())) for o, s in boxes]

    def shard(index):
        sizes = dict((tuple(o), s) for o, s in boxes)[tuple(index.offset)]
        box = full
        for dim, (start, length) in enumerate(zip(index.offset, sizes)):
            box = box.narrow(dim, start, length)
        return box.contiguous()

    t.__create_write_items__, t.__get_tensor_shard__ = items, shard
    return t


class _RawBytesPlanner(DefaultSavePlanner):
    """Megatron-Core's planner writes its ShardedObjects' bytes as they are."""

    def transform_object(self, write_item, obj):
        return obj if isinstance(obj, io.BytesIO) else super().transform_object(write_item, obj)


def _saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save([value], buffer)  # Megatron-Core: torch.save([sh_obj.data for sh_obj in sh_objs])
    buffer.seek(0)
    return buffer


def groups() -> list[dict]:
    base = dict(is_expert_parallel=False, default_config=True, lr_mult=1.0, is_decoupled_lr=False, max_lr=0.01,
                min_lr=0.001, lr=0.0091, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.1, amsgrad=False,
                maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                decoupled_weight_decay=True, step=STEP)
    return [{**base, "wd_mult": 1.0}, {**base, "wd_mult": 0.0}]


def args(gated: bool = False, **changes) -> argparse.Namespace:
    """The run's arguments (a few of Megatron-LM's hundreds), with ``changes`` made."""
    fields = dict(num_layers=LAYERS, hidden_size=H, ffn_hidden_size=F, num_attention_heads=2, padded_vocab_size=V,
                  swiglu=gated, bf16=False, fp16=False, transformer_impl="local", attention_backend=AttnBackend.auto,
                  consumed_train_samples=56, ckpt_format="torch_dist")
    return argparse.Namespace(**{**fields, **changes})


def rng_state() -> dict:
    return {"random_rng_state": random.Random(3).getstate(), "np_rng_state": np.random.RandomState(3).get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.arange(16, dtype=torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": torch.arange(8, dtype=torch.uint8)}}


def common_state(run_args, optimizer_format: str = "fully_reshardable") -> dict:
    return {"args": run_args, "checkpoint_version": 3.0, "iteration": ITERATION,
            "num_floating_point_operations_so_far": 12345,
            "opt_param_scheduler": {"max_lr": 0.01, "num_steps": 56, "lr_decay_style": "cosine"},
            "optimizer": {"optimizer": {"param_groups": groups()}, "param_state_sharding_type": optimizer_format},
            "content_metadata": {"distrib_optim_sharding_type": optimizer_format, "singleton_local_shards": False}}


def write_torch_dist(root: str, *, gated: bool = False, run_args=None, drop: tuple[str, ...] = (),
                     optimizer_format: str = "fully_reshardable") -> dict:
    """A ``--save`` folder at ``root`` (tracker + ``iter_0000007``); returns every tensor written, by key."""
    model = model_tensors(gated)
    gen = torch.Generator().manual_seed(1)
    tensors = dict(model)
    for key, value in model.items():
        tensors[f"optimizer.state.param.{key}"] = value + 0.5  # the fp32 main weights, told apart from the model's
        tensors[f"optimizer.state.exp_avg.{key}"] = torch.randn(value.shape, generator=gen)
        tensors[f"optimizer.state.exp_avg_sq.{key}"] = torch.rand(value.shape, generator=gen)
    for key in drop:
        del tensors[key]
    with stand_in_module():
        state = {k: chunked(v, _boxes(k.split(".", 3)[-1] if k.startswith("optimizer.") else k, v.shape))
                 for k, v in tensors.items()}
        for layer_module in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                             "mlp.linear_fc2"):
            for rank in range(2):
                state[f"decoder.layers.{layer_module}._extra_state/shard_{rank}_2"] = _saved(None)
        state["common_state/shard_0_1"] = _saved(common_state(run_args or args(gated), optimizer_format))
        state["rng_state/shard_0.0_1.1"] = _saved([rng_state()])
        folder = os.path.join(root, f"iter_{ITERATION:07d}")
        dcp.save(state, storage_writer=FileSystemWriter(folder), planner=_RawBytesPlanner(), no_dist=True)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    return tensors
