"""What Megatron-LM reads on a ``MegatronFSDP`` besides its methods: the
``ddp_config``, the ``dist_index`` (process groups and meshes) and the
``param_and_grad_buffer`` (parameter groups and their buffers).

Each is a view of flatfsdp's own state, built when asked and never a second
copy: a buffer's ``.data`` is the very tensor the engine reads and writes
(the model weights' shard or kept copy, the main weights, the main grads), so
what Megatron-LM writes there the engine sees. Names follow megatron_fsdp
0.6.1 (``param_and_grad_buffer.py``, ``utils.FSDPDistributedIndex``,
``distributed_data_parallel_config.py``); docs/megatron.md says where the
views differ from the buffers they stand for.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from flatfsdp.engine.front.keyword_table import MEGATRON, GivenKeywords
from flatfsdp.engine.groups.group_core import ParamGroupFace
from flatfsdp.engine.groups.group_tensors import GroupTensors
from flatfsdp.engine.layout.mesh import sub_mesh
from flatfsdp.engine.layout.options import ShardOptions
from flatfsdp.engine.layout.strategy import ShardingStrategy

_STRATEGY_NAMES = {ShardingStrategy.NO_SHARD: "no_shard", ShardingStrategy.OPTIM: "optim",
                   ShardingStrategy.OPTIM_GRADS: "optim_grads",
                   ShardingStrategy.OPTIM_GRADS_PARAMS: "optim_grads_params"}


@dataclasses.dataclass
class DistributedDataParallelConfig:
    """Megatron-FSDP's ``DistributedDataParallelConfig``: 0.6.1's fields and
    defaults (a test holds them to the installed megatron_fsdp's), the one
    class of its name in flatfsdp -- ``flatfsdp.megatron_fsdp`` exports it.

    On a one-call model (``ddp_config``) it is a record of what was asked,
    made by ``from_keywords``: the engine read the keywords once
    (front/keywords.py), so changing a field there changes nothing, as in
    Megatron-FSDP, which reads its config at construction. A field a keyword
    sets as given is that keyword's ``ddp_field`` in front/keyword_table."""

    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    check_for_nan_in_grad: bool = False
    bucket_size: int | None = None
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False

    @classmethod
    def from_keywords(cls, given: GivenKeywords, options: ShardOptions) -> "DistributedDataParallelConfig":
        """The fields the engine's reading decides, then those each keyword
        sets as given (keyword_table's ``ddp_field``)."""
        policy = options.policy
        outer = "optim" if options.mesh.replicas_split_optimizer else "no_shard"
        as_given = {k.ddp_field: bool(getattr(given, k.name)) for k in MEGATRON if k.ddp_field is not None}
        return cls(
            data_parallel_sharding_strategy=_STRATEGY_NAMES[options.strategy], outer_dp_sharding_strategy=outer,
            bucket_size=options.bucket_bytes or None,
            megatron_fsdp_main_params_dtype=policy.main_params_dtype,
            megatron_fsdp_main_grads_dtype=policy.main_grads_dtype,
            megatron_fsdp_grad_comm_dtype=policy.reduce_dtype, **as_given)


class DistributedIndexGroups:
    """The questions Megatron-LM asks of an ``FSDPDistributedIndex``, over
    the groups it holds: shared by the one-call model's index (below) and
    flatfsdp.megatron_fsdp's constructor-facing one."""

    def get_dp_group(self, is_expert_parallel: bool = False):
        """Every data-parallel rank (the hybrid group with HSDP)."""
        if is_expert_parallel:
            return self.hybrid_fsdp_expt_group if self.use_hybrid_fsdp else self.expt_fsdp_group
        return self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False, independent_all_gather: bool = False):
        """The ranks a parameter's chunks are split over."""
        if is_expert_parallel:
            return self.expt_fsdp_group_ag if independent_all_gather else self.expt_fsdp_group
        return self.fsdp_group_ag if independent_all_gather else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False):
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False):
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh

    def get_submesh(self, mesh_dim_names, is_expert_parallel: bool = False):
        """The sub-mesh of the named dimension(s) (Megatron-Core's checkpoint code asks for ``[tp_dim]``);
        a dimension flattened with ``_flatten`` counts (sub_mesh names a missing one)."""
        mesh = self.expt_device_mesh if is_expert_parallel else self.device_mesh
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if mesh is None:
            raise ValueError(f"{type(self).__name__}: no sub-mesh {names} (expert={is_expert_parallel}): no mesh")
        return sub_mesh(mesh, names if len(names) > 1 else names[0],
                        f"{type(self).__name__}.get_submesh{names}")


class DistributedIndex(DistributedIndexGroups):
    """Megatron-FSDP's ``FSDPDistributedIndex``: the meshes and process groups
    the model is sharded and reduced over."""

    def __init__(self, given: GivenKeywords, options: ShardOptions):
        mesh = options.mesh
        self.device_mesh = given.device_mesh if given.device_mesh is not None else mesh.spmd
        self.dp_shard_dim = given.dp_shard_dim
        self.dp_outer_dim = given.dp_outer_dim
        self.tp_dim = given.tp_dim
        self.use_hybrid_fsdp = mesh.outer is not None
        self.hsdp_outer_dp_shard = mesh.replicas_split_optimizer
        self.expt_device_mesh = given.expt_device_mesh
        self.fsdp_group = mesh.shard.get_group()
        self.outer_fsdp_group = mesh.outer.get_group() if mesh.outer is not None else None
        self._hybrid_fsdp_group = given.hybrid_fsdp_group
        self._spmd = mesh.spmd
        self.hybrid_fsdp_expt_group = given.hybrid_fsdp_expt_group
        expert = options.expert_mesh
        self.expt_fsdp_group = expert.shard.get_group() if expert is not None else None
        self.expt_outer_fsdp_group = None
        self.fsdp_group_ag = given.fsdp_group_ag
        self.expt_fsdp_group_ag = given.expt_fsdp_group_ag

    @property
    def hybrid_fsdp_group(self):
        """Every data-parallel rank's group: the one given, else (HSDP) made
        from the mesh at first use -- a collective, so every rank must ask
        (as Megatron-LM does); without HSDP, the shard group."""
        if self._hybrid_fsdp_group is None:
            self._hybrid_fsdp_group = self.fsdp_group if not self.use_hybrid_fsdp else _flat_group(self._spmd)
        return self._hybrid_fsdp_group

def _flat_group(mesh):
    """The process group of every rank of a 2-D (outer, shard) mesh (made
    collectively, at fully_shard, on every rank alike)."""
    try:
        return mesh._flatten().get_group()
    except (AttributeError, RuntimeError, ValueError):  # torch without _flatten: Megatron-FSDP needs it given
        return None


class BufferView:
    """One of a parameter group's buffers (Megatron-FSDP's ``DataParallelBuffer``):
    ``data`` is flatfsdp's tensor itself (for a group of tensor-subclass
    weights, a flat copy of their plain values: groups/group_tensors.py).
    ``is_data_distributed``: it holds this rank's chunks only (else every
    parameter whole)."""

    def __init__(self, data: torch.Tensor, group: ParamGroupFace, tensors: GroupTensors,
                 is_data_distributed: bool, kind: str):
        self.data = data
        self.dtype = data.dtype
        self.device = data.device
        self.is_data_distributed = is_data_distributed
        self.params = list(group.params)
        self.param_idx = {p: i for i, p in enumerate(self.params)}
        self.data_parallel_group = tensors.process_group
        self.dp_rank = tensors.rank_index
        self.dp_world_size = tensors.world
        self._tensors, self._kind = tensors, kind

    def get_item(self, item_id: int, only_shard: bool = False) -> torch.Tensor:
        """Parameter ``item_id``'s values in this buffer: this rank's chunk
        (flat) where the buffer is sharded or ``only_shard``, else the whole
        parameter (flat)."""
        t = self._tensors
        if self._kind == "main":
            return t.main_item(item_id)
        if self._kind == "grad":
            return t.grad_item(item_id)
        return t.model_item(item_id, only_shard)


class ParameterGroupView:
    """One flatfsdp param group as Megatron-FSDP's ``ParameterGroup``."""

    def __init__(self, group: ParamGroupFace, unit_id: int, expert: bool, main_params_dtype: torch.dtype | None):
        t = group.tensors()
        self.params = list(group.params)
        self.dtype = t.compute_dtype
        self.requires_grad = group.trainable
        self.grad_dtype = t.main_grads.dtype if group.trainable else None
        self.is_expert_param = expert
        self.fsdp_unit_id = unit_id
        self.chunk_size_factor = 1
        self.transpose_weight_buffer = None
        self.hfsdp_helper_wbuf = self.hfsdp_helper_wtbuf = self.hfsdp_helper_gbuf = self.hsdp_comm_gbuf = None
        self.model_weight_buffer = BufferView(t.model_weights, group, t, t.model_weights_sharded, "model")
        # Megatron-FSDP keeps main weights apart only when main_params_dtype asks for them.
        separate_main = group.trainable and main_params_dtype is not None
        self.main_weight_buffer = BufferView(t.main_weights, group, t, t.sharded, "main") if separate_main else None
        self.main_grad_buffer = BufferView(t.main_grads, group, t, t.sharded, "grad") if group.trainable else None


class ParamAndGradBufferView:
    """Megatron-FSDP's ``ParamAndGradBuffer``: the parameter groups of every
    unit (the root's first, then the units in module order), and the few
    operations Megatron-LM calls on it, each on flatfsdp's buffers."""

    def __init__(self, model_view, states: list, names: dict[int, str], expert_ids: set[int],
                 main_params_dtype: torch.dtype | None):
        self._model = model_view
        self.parameter_groups: list[ParameterGroupView] = []
        self.param_to_param_group: dict[nn.Parameter, int] = {}
        self.optimizer_named_parameters: list[tuple[str, nn.Parameter]] = []
        for unit_id, state in enumerate(states):
            for group in state.groups:
                expert = any(id(p) in expert_ids for p in group.sharded_params)
                view = ParameterGroupView(group, unit_id, expert, main_params_dtype)
                for p in group.params:
                    self.param_to_param_group[p] = len(self.parameter_groups)
                self.parameter_groups.append(view)
                self.optimizer_named_parameters += [(names.get(id(p), slot.fqn), p)
                                                    for slot, p in zip(group.slots, group.sharded_params)]

    @property
    def num_buckets(self) -> int:
        return len(self.parameter_groups)

    def copy_main_weights_to_model_weights(self) -> None:
        self._model.install_optimized_model_weights()

    def zero_grad(self) -> None:
        self._model.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        self._model.scale_gradients(scaling_factor)

    def manual_buffer_registration(self) -> None:
        """A no-op: Megatron-FSDP registers its communication buffers with
        NCCL's user-buffer pool here (``nccl_ub`` with ``fsdp_manual_registration``);
        flatfsdp allocates no NCCL user buffers, so there is nothing to register."""

    def update_main_grads(self) -> None:
        """Hand the reduced gradients to the optimizer: flatfsdp does it when
        they land, so this waits for those in flight."""
        self._model.synchronize_gradient_reduce()
