"""Planning a torch_dist -> fsdp_dtensor conversion: every entry of the output, and where it comes from.

The output is the state dict Megatron-LM's ``save_checkpoint`` builds for
``--ckpt-format fsdp_dtensor`` (``generate_state_dict``), nested as it nests it,
so DCP flattens it to the same entry names Megatron-LM's load asks for:

* ``model.module.<param>`` <- ``optimizer.state.param.<name>`` (the fp32 main
  weights; the model's own ``<name>`` when no optimizer was saved), per layer
  (megatron_names.py);
* ``optimizer.state.<prefix><param>.<exp_avg, ...>`` <- ``optimizer.state.<exp_avg, ...>.<name>``;
* ``optimizer.state.<prefix><param>.step`` <- the step of the parameter's optimizer group;
* ``optimizer.param_to_group_meta.<prefix><param>.<field>`` <- that group's fields (megatron_groups.py);
* ``args``, ``iteration``, ``checkpoint_version``, ``opt_param_scheduler.*``,
  ``num_floating_point_operations_so_far`` <- the common state, as saved;
* ``rng_state.(<pp>, <tp>).<i>.*`` <- each ``rng_state/shard_<pp>.<tp>_...`` object.

``<prefix>`` is the parameter's name as Megatron-LM's optimizer sees it
(``module.module.``, one more ``module.`` when the run's ``--bf16``/``--fp16``
wraps the model in ``Float16Module``). Per-layer ``_extra_state`` (TransformerEngine's
fp8 metadata; empty otherwise) and the rerun state machine's state are left
out: fsdp_dtensor runs do not save the first and Megatron-LM never restores the second.
Tensors are not read here: each is a meta placeholder and a `Region` to read when written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from flatfsdp.checkpoint import megatron_groups
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.foreign_read import ForeignCheckpoint, Region
from flatfsdp.checkpoint.inert_pickle import fields
from flatfsdp.checkpoint.megatron_names import pieces, stacked

MAIN_PARAM_STATE = "param"
READABLE_OPTIMIZER_FORMAT = "fully_reshardable"
_RNG_KEY = re.compile(r"rng_state/shard_(\d+)\.(\d+)_\d+\.\d+")


@dataclass
class Plan:
    state_dict: dict
    sources: dict[str, tuple[Region, tuple[int, ...]]]
    """Flattened entry name -> the box to read and the shape to give it."""
    iteration: int | str
    report: dict = field(default_factory=dict)


def _sharded_object(value, key: str, where: str):
    """Megatron-Core saves each ShardedObject as the list of its data on the saving rank: one item."""
    if not isinstance(value, list) or len(value) != 1:
        raise CheckpointError(f"{where}: entry {key!r} is not a saved ShardedObject (a one-item list)")
    return value[0]


def read_common(src: ForeignCheckpoint) -> dict:
    keys = [k for k in src.object_keys() if k.split("/")[0] == "common_state"]
    if len(keys) != 1:
        raise CheckpointError(f"{src.directory}: expected one common_state entry (args, iteration, optimizer "
                              f"groups), found {len(keys)}: not a checkpoint of Megatron-LM's save_checkpoint")
    common = _sharded_object(src.read_objects(keys)[keys[0]], keys[0], src.directory)
    for needed in ("args", "iteration", "checkpoint_version"):
        if not isinstance(common, dict) or needed not in common:
            raise CheckpointError(f"{src.directory}: missing key {needed!r} in its common state ({keys[0]})")
    return common


def _options(args: dict, transformer_impl: str | None, swiglu: bool | None) -> dict:
    impl = transformer_impl or args.get("transformer_impl", "transformer_engine")
    if impl not in ("local", "transformer_engine"):
        raise CheckpointError(f"unknown transformer implementation {impl!r} (local or transformer_engine)")
    return {"layer_norm_names": impl, "gated": bool(args.get("swiglu")) if swiglu is None else swiglu,
            "float16_module": bool(args.get("bf16") or args.get("fp16"))}


def _optimizer_format(common: dict, where: str) -> str | None:
    optimizer = common.get("optimizer")
    if optimizer is None:
        return None
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type") or optimizer.get(
        "param_state_sharding_type")
    if kind != READABLE_OPTIMIZER_FORMAT:
        raise CheckpointError(
            f"{where}: its optimizer state is stored as {kind!r}, in the distributed optimizer's own flat buckets "
            "(they do not say which parameter each range belongs to). Re-save it with Megatron-LM's "
            "--dist-ckpt-optim-fully-reshardable (load it at the same data-parallel size, save once), or convert "
            "the weights alone with --model-only")
    return kind


def _model_keys(src: ForeignCheckpoint, where: str) -> list[str]:
    keys = [k for k in src.tensor_keys() if not k.startswith("optimizer.") and not k.startswith("rng_state")]
    experts = [k for k in keys if ".experts." in k]
    if experts:
        raise CheckpointError(f"{where}: {experts[0]} is an expert (MoE) parameter; converting mixture-of-experts "
                              "checkpoints is not supported")
    if not keys:
        raise CheckpointError(f"{where} holds no model weights")
    return sorted(keys)


def _check_model(src: ForeignCheckpoint, keys: list[str], args: dict, gated: bool, where: str) -> None:
    """The weights must be the model the checkpoint's own arguments describe."""
    shape = {k: tuple(src.entries[k].size) for k in keys}
    layers = args.get("num_layers")
    for key in keys:
        split = stacked(key)
        if split and split[0] == "decoder.layers." and layers is not None and shape[key][0] != layers:
            raise CheckpointError(f"{where}: {key} stacks {shape[key][0]} layers, but the run's arguments say "
                                  f"num_layers={layers} (a checkpoint of another model?)")
        if key.endswith("mlp.linear_fc1.weight") and args.get("ffn_hidden_size") and split:
            rows, want = shape[key][1], args["ffn_hidden_size"] * (2 if gated else 1)
            if rows != want:
                kind = "gated (--swiglu)" if gated else "plain"
                raise CheckpointError(f"{where}: {key} has {rows} rows per layer; a {kind} MLP of "
                                      f"ffn_hidden_size={args['ffn_hidden_size']} has {want}")
    embedding = shape.get("embedding.word_embeddings.weight")
    if embedding and args.get("hidden_size") and embedding[1] != args["hidden_size"]:
        raise CheckpointError(f"{where}: embedding.word_embeddings.weight is {embedding}, but the run's arguments "
                              f"say hidden_size={args['hidden_size']} (a checkpoint of another model?)")


def _optimizer_states(src: ForeignCheckpoint, keys: list[str], where: str) -> list[str]:
    names = sorted({k.split(".")[2] for k in src.tensor_keys() if k.startswith("optimizer.state.")}
                   - {MAIN_PARAM_STATE})
    for key in keys:
        for state in [MAIN_PARAM_STATE, *names]:
            wanted = f"optimizer.state.{state}.{key}"
            if wanted not in src.entries:
                raise CheckpointError(f"{where}: missing key {wanted!r} (the optimizer state of {key})")
    return names


def _param_groups(common: dict, where: str) -> list[dict]:
    try:
        groups = common["optimizer"]["optimizer"]["param_groups"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: missing key 'optimizer.optimizer.param_groups' in its common state "
                              "(several chained optimizers are not supported)") from None
    for i, group in enumerate(groups):
        if "step" not in group:
            raise CheckpointError(f"{where}: missing key 'step' in optimizer group {i}")
    return groups


def _rng_states(src: ForeignCheckpoint) -> dict:
    """``{"(pp, tp)": [rng state per data-parallel rank]}``, fsdp_dtensor's layout of the same objects."""
    keys = [k for k in src.object_keys() if _RNG_KEY.fullmatch(k)]
    values = src.read_objects(keys)
    out = {}
    for key in keys:
        pp, tp = _RNG_KEY.fullmatch(key).groups()
        out[f"({pp}, {tp})"] = _sharded_object(values[key], key, src.directory)
    return out


def _placeholder(src: ForeignCheckpoint, key: str, shape) -> torch.Tensor:
    return torch.empty(shape, dtype=src.entries[key].properties.dtype, device="meta")


def build(src: ForeignCheckpoint, *, transformer_impl: str | None = None, swiglu: bool | None = None,
          model_only: bool = False) -> Plan:
    """The conversion of ``src`` (a torch_dist folder); nothing is read but the common state and rng."""
    where = src.directory
    common = read_common(src)
    args = fields(common["args"])
    opts = _options(args, transformer_impl, swiglu)
    with_optimizer = not model_only and _optimizer_format(common, where) is not None
    keys = _model_keys(src, where)
    _check_model(src, keys, args, opts["gated"], where)
    states = _optimizer_states(src, keys, where) if with_optimizer else []
    model, sources, params = {}, {}, {}
    for key in keys:
        main = f"optimizer.state.{MAIN_PARAM_STATE}.{key}" if with_optimizer else key
        for piece in pieces(key, tuple(src.entries[key].size), local_spec=opts["layer_norm_names"] == "local",
                            gated=opts["gated"]):
            model[f"module.{piece.name}"] = _placeholder(src, main, piece.shape)
            sources[f"model.module.{piece.name}"] = (Region(main, piece.offsets, piece.sizes), piece.shape)
            params[piece.name] = (key, piece)
    state_dict = {k: common[k] for k in ("args", "checkpoint_version", "iteration") if k in common}
    state_dict["model"] = model
    for extra in ("opt_param_scheduler", "num_floating_point_operations_so_far"):
        if extra in common:
            state_dict[extra] = common[extra]
    if with_optimizer:
        state_dict["optimizer"] = _optimizer_entries(src, common, args, opts, states, params, sources)
    rng = _rng_states(src)
    if rng:
        state_dict["rng_state"] = rng
    report = {"parameters": len(params), "optimizer_states": states, "skipped": _skipped(src, keys), **opts}
    return Plan(state_dict, sources, common["iteration"], report)


def _optimizer_entries(src, common, args, opts, states, params, sources) -> dict:
    prefix = "module.module." + ("module." if opts["float16_module"] else "")
    groups = _param_groups(common, src.directory)
    judged = {name: (piece.whole, len(piece.shape)) for name, (_key, piece) in params.items()}
    membership = megatron_groups.assign(judged, groups, args, src.directory)
    state, meta = {}, {}
    for name, (key, piece) in params.items():
        group = groups[membership[name]]
        entry = {"step": torch.tensor(float(group["step"]), dtype=torch.float32)}
        for name_of_state in states:
            saved = f"optimizer.state.{name_of_state}.{key}"
            entry[name_of_state] = _placeholder(src, saved, piece.shape)
            sources[f"optimizer.state.{prefix}{name}.{name_of_state}"] = (
                Region(saved, piece.offsets, piece.sizes), piece.shape)
        state[f"{prefix}{name}"] = entry
        # Group entries stay under the whole parameter's name: Megatron-LM splits a gated MLP's
        # weight only for the model and the optimizer state, not for the group metadata.
        meta[f"{prefix}{piece.whole}"] = megatron_groups.per_parameter(group)
    return {"state": state, "param_to_group_meta": meta}


def _skipped(src: ForeignCheckpoint, model_keys: list[str]) -> list[str]:
    used = set(model_keys)
    return sorted(k for k in src.entries if k not in used and not k.startswith(("optimizer.state.", "rng_state/",
                                                                                  "common_state/")))


__all__ = ["Plan", "build", "read_common"]
