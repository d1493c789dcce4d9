"""From torch_dist's tensor names to the parameters an fsdp_dtensor run has.

Three differences, each a rule Megatron-Core applies when it saves:

* **Stacked layers.** torch_dist keeps one tensor per name for all layers of a
  block, the layer as the first dimension (``decoder.layers.mlp.linear_fc1.weight``
  of shape ``(num_layers, 128, 64)``); fsdp_dtensor keeps each layer's parameter
  (``decoder.layers.0.mlp.linear_fc1.weight``). A name is stacked when the
  segment after ``.layers.`` is not a layer number.
* **Layer-norm names.** torch_dist names the two layer norms of a layer by
  TransformerEngine's fused modules (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) whatever the layer spec; a model built
  from Megatron-Core's local spec (``--transformer-impl local``) has them as
  ``input_layernorm.*`` and ``pre_mlp_layernorm.*`` (the spec's
  ``sharded_state_dict_keys_map``), and fsdp_dtensor keeps the model's own names.
* **Gated MLPs** (``--swiglu``). torch_dist keeps ``linear_fc1`` whole, the gate
  rows first (``[W; V]``, also under tensor parallelism); Megatron-LM's fsdp_dtensor
  save splits it into ``linear_fc1.weight_w`` / ``weight_v`` (``bias_w`` / ``bias_v``).

Each output tensor is one box of one saved tensor (`Piece`), so the converter
reads exactly that box and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOCAL_SPEC_RENAMES = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                      ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))
_GATED = re.compile(r"(?:^|\.)mlp\.linear_fc1\.(?:weight|bias)$")
_STACKED = re.compile(r"^(.*?\.layers\.)(?!\d+\.)(.+)$")


@dataclass(frozen=True)
class Piece:
    name: str
    """The parameter's name in the model of the fsdp_dtensor run."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    """The box of the saved tensor it is."""
    shape: tuple[int, ...]
    """Its own shape (the box without a stacked layer's leading 1)."""
    whole: str
    """The parameter it comes from before a gated split (``...linear_fc1.weight``), for optimizer groups."""


def stacked(key: str) -> tuple[str, str] | None:
    """``("decoder.layers.", "mlp.linear_fc1.weight")`` for a layer-stacked name, else None."""
    match = _STACKED.match(key)
    return (match.group(1), match.group(2)) if match else None


def _rename(name: str, local_spec: bool) -> str:
    if local_spec:
        for fused, local in LOCAL_SPEC_RENAMES:
            name = re.sub(rf"(^|\.){re.escape(fused)}(weight|bias)$", rf"\g<1>{local}\g<2>", name)
    return name


def _split_gated(piece: Piece) -> list[Piece]:
    rows = piece.shape[0]
    half = rows // 2
    lead = len(piece.offsets) - len(piece.shape)  # 1 for a stacked layer's box
    out = []
    for suffix, start in (("_w", 0), ("_v", half)):
        offsets = list(piece.offsets)
        sizes = list(piece.sizes)
        offsets[lead] += start
        sizes[lead] = half
        out.append(Piece(piece.name + suffix, tuple(offsets), tuple(sizes), (half, *piece.shape[1:]), piece.whole))
    return out


def pieces(key: str, shape: tuple[int, ...], *, local_spec: bool, gated: bool) -> list[Piece]:
    """The fsdp_dtensor parameters the torch_dist tensor ``key`` of global ``shape`` holds."""
    split = stacked(key)
    if split is None:
        name = _rename(key, local_spec)
        boxes = [Piece(name, (0,) * len(shape), tuple(shape), tuple(shape), name)]
    else:
        prefix, rest = split
        boxes = []
        for layer in range(shape[0]):
            name = _rename(f"{prefix}{layer}.{rest}", local_spec)
            boxes.append(Piece(name, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]), tuple(shape[1:]), name))
    if gated and _GATED.search(boxes[0].name):
        return [half for box in boxes for half in _split_gated(box)]
    return boxes


def is_gated_weight(name: str) -> bool:
    return bool(_GATED.search(name))
