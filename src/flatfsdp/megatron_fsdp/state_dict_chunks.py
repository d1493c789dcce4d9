"""Every DTensor of a state dict made to say where its part lies, in a few
collectives that ranks holding different entries cannot desynchronise.

Stock Megatron-FSDP runs one collective per DTensor, in key order: when one
rank's optimizer keeps no state for a parameter (its part is empty there) the
ranks' keys differ, the collectives pair up wrong, and the save hangs
(NVIDIA/Megatron-LM#4910). Here:

1. one all-gather over the world of what each rank holds, per mesh (the
   mesh's ranks, the mesh dimensions its entries are sharded over, an example
   key): every rank of a mesh must hold entries on it -- if one holds none it
   would skip that mesh's collectives, so that is refused, on every rank;
2. per mesh, in one agreed order, one all-gather per sharded mesh dimension of
   every entry's record (part_records.py): entries a rank lacks count as empty
   parts there, and every entry's parts must then tile its tensor;
3. one all-gather over the world of what went wrong: any problem anywhere is
   one ``ValueError`` on every rank, and nothing has been changed.

Only then does each uneven DTensor say its part (uneven_chunks.mark); a
DTensor whose parts follow torch's rule is left as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from flatfsdp.megatron_fsdp.chunk_boxes import sharded_dims
from flatfsdp.megatron_fsdp.chunk_exchange import block_coords, gather_records
from flatfsdp.megatron_fsdp.part_records import is_uneven, my_box, record_of, resolve
from flatfsdp.megatron_fsdp.uneven_chunks import mark

MeshKey = tuple
_SHOWN = 5


def dtensor_entries(state_dict: dict, key_chain: list, visit: Callable[[Any], bool]) -> list[list]:
    """The key chains, through nested dicts, of the values ``visit`` accepts, sorted."""
    found = []
    for key, value in state_dict.items():
        if isinstance(value, dict):
            found += dtensor_entries(value, key_chain + [key], visit)
        elif visit(value):
            found.append(key_chain + [key])
    return sorted(found, key=lambda chain: [str(k) for k in chain])


def get_unflattened_state_dict(state_dict: dict, key_chain: list = ()) -> Any:
    """The value at ``key_chain`` (a list of keys through nested dicts)."""
    value = state_dict
    for key in key_chain:
        if not isinstance(value, dict) or key not in value:
            raise KeyError(f"Key {list(key_chain)} not found in state_dict")
        value = value[key]
    return value


def mesh_key(mesh: DeviceMesh) -> MeshKey:
    """A mesh's identity every rank computes alike: device, dimensions, rank table."""
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh_dim_names or ()))


def prepare_state_dict(state_dict: dict) -> dict:
    entries = [(tuple(chain), get_unflattened_state_dict(state_dict, chain))
               for chain in dtensor_entries(state_dict, [], lambda v: isinstance(v, DTensor))]
    by_mesh: dict[MeshKey, list[tuple[tuple, DTensor]]] = {}
    for chain, value in entries:
        by_mesh.setdefault(mesh_key(value.device_mesh), []).append((chain, value))
    dims = _agreed_meshes(by_mesh)
    decided, problems = [], []
    for key in sorted(dims):
        if dist.get_rank() not in key[2]:
            continue
        mine = dict(by_mesh[key])
        mesh = next(iter(mine.values())).device_mesh
        coords = block_coords(mesh, dims[key])
        records = gather_records(mesh, dims[key], {chain: record_of(value) for chain, value in mine.items()})
        for chain in sorted({c for recs in records.values() for c in recs}, key=lambda c: [str(k) for k in c]):
            resolution = resolve({r: recs.get(chain) for r, recs in records.items()}, coords)
            problems += [f"{_name(chain)}: {p}" for p in resolution.problems]
            if chain in mine and not resolution.problems:
                decided.append((mine[chain], resolution))
    _agree_nothing_went_wrong(problems)
    for value, resolution in decided:
        if is_uneven(value) or not resolution.even:
            mark(value, my_box(value, resolution))
    return state_dict


def _agreed_meshes(by_mesh: dict) -> dict[MeshKey, tuple[int, ...]]:
    """Step 1: every mesh some rank holds entries on -> the mesh dimensions any
    rank's entries are sharded over; refused if a rank of a mesh holds none."""
    mine = {key: (tuple(sorted({d for _, v in values for d in sharded_dims(v.placements)})), _name(values[0][0]))
            for key, values in by_mesh.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dims: dict[MeshKey, set] = {}
    holders: dict[MeshKey, list[int]] = {}
    example: dict[MeshKey, str] = {}
    for rank, held in enumerate(everyone):
        for key, (sharded, name) in held.items():
            dims.setdefault(key, set()).update(sharded)
            holders.setdefault(key, []).append(rank)
            example.setdefault(key, name)
    for key in sorted(dims):
        absent = sorted(set(key[2]) - set(holders[key]))
        if absent:
            raise ValueError(f"preprocess_state_dict_for_uneven_dtensor: ranks {absent} hold no DTensor on the mesh "
                             f"of ranks {list(key[2])} (dimensions {key[3]}) that ranks {holders[key]} hold entries "
                             f"on (e.g. {example[key]!r}): every rank of a mesh must take part; nothing was changed")
    return {key: tuple(sorted(d)) for key, d in dims.items()}


def _agree_nothing_went_wrong(problems: list[str]) -> None:
    """Step 3: one verdict for every rank."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems[:_SHOWN])
    found = list(dict.fromkeys(p for part in everyone for p in part))
    if found:
        more = f" (and more; first {_SHOWN} shown)" if len(found) > _SHOWN else ""
        raise ValueError("preprocess_state_dict_for_uneven_dtensor: the parts of these entries do not tile their "
                         f"tensors, nothing was changed{more}: " + " | ".join(found[:_SHOWN]))


def _name(chain: tuple) -> str:
    return ".".join(str(k) for k in chain)

