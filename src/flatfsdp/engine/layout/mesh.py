"""Turn the user's mesh arguments into the data-parallel meshes the engine
shards and reduces over.

A ``DataParallelMesh`` names up to two 1-D meshes:

* ``shard`` -- the ranks a parameter's chunks are split over (``dp_shard``, or
  a flattened ``(dp_shard, cp)`` dimension with context parallelism);
* ``outer`` -- ranks holding the same chunks (HSDP: ``dp_outer``), across
  which gradients are all-reduced; None on a 1-D mesh.

and ``spmd``, the mesh the sharded parameters' DTensors live on: ``shard``,
or the 2-D ``(outer, shard)`` mesh with HSDP. Tensor-parallel dimensions of a
parameter are appended to it per parameter (see ``combined_mesh``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._subclasses.fake_tensor import unset_fake_temporarily

from flatfsdp.engine.layout.device import default_device_type


@dataclass(frozen=True)
class DataParallelMesh:
    shard: DeviceMesh
    outer: DeviceMesh | None = None
    spmd: DeviceMesh | None = None
    """The DTensor mesh of data-parallel placements (defaults to ``shard``)."""
    grad_world: int | None = None
    """How many data-parallel ranks' gradients are averaged (defaults to
    shard x outer; expert parameters use the global data-parallel size)."""
    replicas_split_optimizer: bool = False
    """HFSDP (Megatron-FSDP's ``outer_dp_sharding_strategy="optim"``): the
    optimizer's share is split across ``outer`` too."""
    hybrid_spmd: DeviceMesh | None = None
    """HFSDP: the ``(shard, outer)`` mesh (``spmd`` transposed) its pieces are
    placed ``(Shard(0), Shard(0))`` on (see groups/replicas.py)."""

    def __post_init__(self):
        if self.spmd is None:
            object.__setattr__(self, "spmd", self.shard)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else self.outer.size()

    @property
    def size(self) -> int:
        """Every data-parallel rank: shard x outer."""
        return self.shard.size() * self.outer_size

    @property
    def average_over(self) -> int:
        return self.size if self.grad_world is None else self.grad_world

    @property
    def device_type(self) -> str:
        return self.shard.device_type

    def dim_names(self) -> tuple[str, ...]:
        """Names of the spmd mesh's dimensions (for error messages and the account)."""
        return tuple(self.spmd.mesh_dim_names or (f"dim{i}" for i in range(self.spmd.ndim)))

    def with_split_replicas(self) -> "DataParallelMesh":
        """HFSDP, with the transposed ``(shard, outer)`` mesh its pieces are
        placed on. New process groups are collective over the world, so every
        replica's transposed mesh is built together, from every rank's view."""
        if self.outer is None:
            return self
        # Rank tables are real data even while the caller runs on fake tensors
        # (the estimator shards under torch's FakeTensorMode).
        with unset_fake_temporarily():
            mine = self.spmd.mesh.transpose(0, 1).tolist()
            if self.spmd.mesh.numel() == dist.get_world_size():
                replicas = [mine]  # the only replica: nothing to learn from the other ranks
            else:
                views: list = [None] * dist.get_world_size()
                dist.all_gather_object(views, mine)
                replicas = sorted({tuple(map(tuple, v)) for v in views}, key=lambda v: min(min(row) for row in v))
            names = self.dim_names()
            stacked = torch.tensor(replicas, dtype=torch.int64)
            whole = DeviceMesh(self.device_type, stacked, mesh_dim_names=("_hfsdp_replica", names[1], names[0]))
            transposed = whole[(names[1], names[0])]  # this rank's replica
        return DataParallelMesh(self.shard, self.outer, self.spmd, self.grad_world, replicas_split_optimizer=True,
                                hybrid_spmd=transposed)


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flatfsdp needs torch.distributed initialised first "
                           "(torch.distributed.init_process_group, or run under torchrun)")


def resolve_dp_mesh(mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None,
                    dp_outer_dim: str | None = None) -> DataParallelMesh:
    """The data-parallel meshes from Megatron-FSDP's or FSDP2's arguments.

    * no mesh: a 1-D mesh over the default process group;
    * a 1-D mesh: shard over it;
    * FSDP2's 2-D ``(replicate, shard)`` mesh, without ``dp_shard_dim``: HSDP;
    * an N-D mesh with ``dp_shard_dim`` (and ``dp_outer_dim`` for HSDP) naming
      its dimensions; a flattened dimension (``_flatten``) may be named.
    """
    require_initialized()
    if mesh is None:
        for name, value in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
            if value is not None:
                raise ValueError(f"{name}={value!r} was given without a device_mesh")
        return DataParallelMesh(init_device_mesh(default_device_type(), (dist.get_world_size(),)))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if dp_shard_dim is None:
        if dp_outer_dim is not None:
            raise ValueError(f"dp_outer_dim={dp_outer_dim!r} needs dp_shard_dim too (the dimension to shard over)")
        if mesh.ndim == 1:
            return DataParallelMesh(mesh)
        if mesh.ndim == 2 and mesh.mesh_dim_names:
            outer_name, shard_name = mesh.mesh_dim_names
            return DataParallelMesh(mesh[shard_name], mesh[outer_name], mesh)
        raise ValueError(f"a {mesh.ndim}-D device_mesh (dims {mesh.mesh_dim_names}) needs dp_shard_dim "
                         "to say which dimension to shard over")
    shard = sub_mesh(mesh, dp_shard_dim, "dp_shard_dim")
    if dp_outer_dim is None:
        return DataParallelMesh(shard)
    if dp_outer_dim == dp_shard_dim:
        raise ValueError(f"dp_outer_dim and dp_shard_dim are both {dp_shard_dim!r}: they must be different dimensions")
    outer = sub_mesh(mesh, dp_outer_dim, "dp_outer_dim")
    return DataParallelMesh(shard, outer, sub_mesh(mesh, (dp_outer_dim, dp_shard_dim), "dp_outer_dim/dp_shard_dim"))


def sub_mesh(mesh: DeviceMesh, names: str | tuple[str, ...], argument: str) -> DeviceMesh:
    """``mesh[names]``, where a name may be a dimension flattened with
    ``_flatten`` (torch warns that slicing those from the root will change; the
    engine keeps working either way, so the warning is not the user's concern)."""
    named = list(mesh.mesh_dim_names or ())
    root = _root(mesh)
    flattened = sorted(set(getattr(root, "_flatten_mapping", None) or {}) - set(named))
    wanted = (names,) if isinstance(names, str) else names
    missing = [n for n in wanted if n not in named and n not in flattened]
    if missing:
        also = f" (flattened: {flattened})" if flattened else ""
        raise ValueError(f"{argument}: {missing[0]!r} is not a dimension of the device mesh; "
                         f"its dimensions are {named}{also}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flattened dim.*")
        try:
            return mesh[names]
        except (KeyError, RuntimeError, ValueError):
            if root is None or root is mesh:
                raise
            return root[names]


def _root(mesh: DeviceMesh) -> DeviceMesh | None:
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else None


def spans_data_parallel(mesh: DeviceMesh, dp: DataParallelMesh) -> bool:
    """``mesh`` is FSDP2's SPMD mesh (``dp_mesh_dims``): it has the data-parallel
    dimensions among its own, rather than being a tensor-parallel submesh."""
    return data_parallel_dims(mesh, dp) != ()


def data_parallel_dims(mesh: DeviceMesh, dp: DataParallelMesh) -> tuple[int, ...]:
    """Indices of ``mesh``'s data-parallel dimensions, outer first (empty: none)."""
    names = list(mesh.mesh_dim_names or ())
    wanted = [m.mesh_dim_names[0] for m in (dp.outer, dp.shard) if m is not None and m.mesh_dim_names]
    if not names or not wanted or any(n not in names for n in wanted) or _root(mesh) != _root(dp.shard):
        return ()
    return tuple(names.index(n) for n in wanted)


def combined_mesh(dp: DeviceMesh, tp: DeviceMesh, param: str) -> DeviceMesh:
    """The mesh of a tensor-parallel parameter once it is also sharded over
    data parallelism: the data-parallel dimensions, then the tensor-parallel
    ones, sliced from the root mesh both came from."""
    dp_names, tp_names = dp.mesh_dim_names, tp.mesh_dim_names
    root_dp, root_tp = _root(dp), _root(tp)
    if not dp_names or not tp_names or root_dp is None or root_tp is None or root_dp != root_tp:
        raise ValueError(f"parameter '{param}' is a DTensor on {tp}, which is not part of the same named device mesh "
                         f"as the data-parallel mesh {dp}: build both from one init_device_mesh(..., "
                         "mesh_dim_names=...) and pass its dimensions (tp_dim=, dp_shard_dim=)")
    overlap = set(dp_names) & set(tp_names)
    if overlap:
        raise ValueError(f"parameter '{param}' is already distributed over mesh dimension(s) {sorted(overlap)}, "
                         "which flatfsdp was asked to shard over too")
    return sub_mesh(root_dp, tuple(dp_names) + tuple(tp_names), f"parameter '{param}'")


def expert_dp_mesh(mesh: DeviceMesh, dp_shard_dim: str | None, global_dp: int) -> DataParallelMesh:
    """Expert parameters' data-parallel mesh: ``expt_device_mesh``'s
    ``dp_shard_dim`` (or the mesh itself when 1-D). Their gradients are still
    averaged over the global data-parallel size: every rank's tokens reach
    some expert, so the global batch is what the loss averages over."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expt_device_mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 and (dp_shard_dim is None or dp_shard_dim not in names):
        shard = mesh
    else:
        # The README's example names the model's dimension "dp_shard_cp" and
        # the expert mesh's "dp_shard": take dp_shard_dim where the expert mesh
        # has it, else its "dp_shard".
        name = dp_shard_dim if dp_shard_dim in names else "dp_shard"
        if name not in names:
            raise ValueError(f"expt_device_mesh (dims {list(names)}) needs a data-parallel dimension named "
                             f"{dp_shard_dim!r} (dp_shard_dim) or 'dp_shard'")
        shard = sub_mesh(mesh, name, "expt_device_mesh")
    return DataParallelMesh(shard, grad_world=global_dp)


def check_hybrid_group(group, dp: DataParallelMesh) -> None:
    """Megatron-FSDP's ``hybrid_fsdp_group``: the process group of every
    data-parallel rank (outer x shard). The engine derives it from the mesh;
    a group that disagrees is a mistake worth naming."""
    if group is None:
        return
    if dp.outer is None:
        raise ValueError("hybrid_fsdp_group was given without an outer dimension (dp_outer_dim=): it only "
                         "means something with HSDP")
    if group.size() != dp.size:
        raise ValueError(f"hybrid_fsdp_group has {group.size()} ranks, but dp_outer x dp_shard is "
                         f"{dp.outer_size} x {dp.shard.size()} = {dp.size}")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device tensors sharded over ``mesh`` live on, on this rank."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def check_device(device, mesh: DeviceMesh) -> None:
    """Megatron-FSDP's ``device=``: the shards live where the mesh says, so a
    device that disagrees is an error rather than silently ignored."""
    if device is None:
        return
    wanted, actual = torch.device(device), mesh_device(mesh)
    if wanted.type != actual.type or (wanted.index is not None and wanted.index != actual.index):
        raise ValueError(f"device={str(device)!r} disagrees with the device mesh, whose shards live on "
                         f"{actual} on this rank: pass a mesh of that device type, or leave device= out")
