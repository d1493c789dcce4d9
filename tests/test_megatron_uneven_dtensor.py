"""flatfsdp.megatron_fsdp.uneven_dtensor: megatron_fsdp 0.6.1's functions on
any DTensor, held to the whole tensor, to stock's own answers, and to torch's
distributed checkpoint.

Four gloo ranks in one launch (a 1-D mesh of 4 and a 2 x 2 one): DTensors
even by torch's rule, uneven ones laid out by hand (as stock's flat-buffer
chunks are), zero-size parts, replicas, pieces of ``split_dtensor``. Each
must gather to the whole tensor; where stock reads the layout right, each
rank's offsets must be stock's; a state dict prepared here and one prepared
by stock must save checkpoints that load the same values into another
layout. Then what stock cannot do: ranks holding different entries (one
rank's optimizer keeps no state for a parameter whose part is empty there,
NVIDIA/Megatron-LM#4910) save and load; parts that do not tile a tensor, or a
rank missing from a mesh, are one error on every rank with nothing changed.
The layout arithmetic itself is tested alone, in this process.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flatfsdp.megatron_fsdp.chunk_boxes import Box, flat_range, innermost_first, nested_boxes
from harness import run_ranks

stock_module = pytest.importorskip("megatron_fsdp.uneven_dtensor",
                                   reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")


# ---- the arithmetic, alone ------------------------------------------------------------------------

COORDS_2X2 = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


def test_parts_nest_innermost_first_in_torchs_order_or_the_order_a_mesh_names():
    rows = {0: (3, 2), 1: (1, 2), 2: (0, 2), 3: (4, 2)}
    torch_order = innermost_first((Shard(0), Shard(0)))
    assert torch_order == (1, 0)  # torch: placements nest left to right, the last mesh dimension innermost
    boxes = nested_boxes((8, 2), (Shard(0), Shard(0)), torch_order, COORDS_2X2, rows).boxes
    assert [boxes[r].offsets[0] for r in range(4)] == [0, 3, 4, 4]
    stocks = innermost_first((Shard(0), Shard(0)), shard_order=[1, 0])  # stock's HFSDP meshes say this
    assert stocks == (0, 1)
    boxes = nested_boxes((8, 2), (Shard(0), Shard(0)), stocks, COORDS_2X2, rows).boxes
    assert [boxes[r].offsets[0] for r in range(4)] == [0, 3, 3, 4]  # rank 2 beside rank 0, then column b=1


def test_parts_of_two_dimensions_and_replicas_get_their_boxes():
    parts = {0: (2, 4), 1: (2, 1), 2: (3, 4), 3: (3, 1)}
    layout = nested_boxes((5, 5), (Shard(0), Shard(1)), innermost_first((Shard(0), Shard(1))), COORDS_2X2, parts)
    assert layout.problems == ()
    assert layout.boxes[3] == Box((2, 4), (3, 1)) and layout.boxes[1] == Box((0, 4), (2, 1))
    replicas = nested_boxes((5, 3), (Replicate(), Shard(0)), (1,), COORDS_2X2,
                            {0: (1, 3), 1: (4, 3), 2: (1, 3), 3: (4, 3)})
    assert replicas.boxes[2] == replicas.boxes[0] == Box((0, 0), (1, 3)) and replicas.boxes[3].offsets == (1, 0)


def test_parts_that_do_not_tile_the_tensor_are_named():
    coords = {r: (r,) for r in range(3)}
    too_many = nested_boxes((5, 2), (Shard(0),), (0,), coords, {0: (2, 2), 1: (2, 2), 2: (2, 2)})
    assert "make (6, 2), not the global shape (5, 2)" in too_many.problems[0]
    ragged = nested_boxes((5, 2), (Shard(0),), (0,), coords, {0: (2, 2), 1: (2, 3), 2: (1, 2)})
    assert any("differ outside tensor dimension 0" in p for p in ragged.problems)
    lacking = nested_boxes((5, 2), (Shard(0),), (0,), coords, {0: (2, 2), 1: None, 2: (1, 2)})
    assert "ranks [1] hold no entry" in lacking.problems[0]
    empty_there = nested_boxes((3, 2), (Shard(0),), (0,), coords, {0: (2, 2), 1: None, 2: (1, 2)})
    assert empty_there.problems == () and empty_there.boxes[2] == Box((2, 0), (1, 2))


def test_a_box_is_a_flat_range_only_where_its_elements_run_on():
    assert flat_range((6, 4), Box((2, 0), (3, 4))) == slice(8, 20)
    assert flat_range((6, 4), Box((3, 0), (0, 4))) == slice(12, 12)
    assert flat_range((6, 4), Box((2, 1), (1, 2))) == slice(9, 11)
    assert flat_range((6, 4), Box((2, 1), (2, 2))) is None


# ---- four ranks -----------------------------------------------------------------------------------

def _arange(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _by_hand(whole, mesh, placements, lengths):
    """This rank's part of ``whole``, cut by hand: ``lengths[mesh_dim]`` lists the
    part sizes along each sharded mesh dimension (innermost last, as torch nests)."""
    part = whole
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            sizes, at = lengths[mesh_dim], mesh.get_local_rank(mesh_dim)
            part = part.narrow(placement.dim, sum(sizes[:at]), sizes[at])
    return DTensor.from_local(part.clone(), mesh, placements, shape=whole.shape, stride=whole.stride(),
                              run_check=False)


def _cases(flat, square):
    """name -> (DTensor, the whole tensor, whether stock reads its layout as torch does)."""
    return {
        "torch_even_1d": (distribute_tensor(_arange(10, 3), flat, [Shard(0)]), _arange(10, 3), True),
        "uneven_dim0": (_by_hand(_arange(10, 3), flat, [Shard(0)], {0: [4, 0, 5, 1]}), _arange(10, 3), True),
        "uneven_dim1": (_by_hand(_arange(3, 7), flat, [Shard(1)], {0: [2, 3, 0, 2]}), _arange(3, 7), True),
        "uneven_2d": (_by_hand(_arange(5, 5), square, [Shard(0), Shard(1)], {0: [2, 3], 1: [4, 1]}),
                      _arange(5, 5), True),
        "hsdp_like": (_by_hand(_arange(5, 3), square, [Replicate(), Shard(0)], {1: [1, 4]}), _arange(5, 3), True),
        # torch-even, same dimension sharded twice: stock reads the nesting the other way round
        "torch_even_nested": (distribute_tensor(_arange(8, 3), square, [Shard(0), Shard(0)]), _arange(8, 3), False),
    }


def _error(fn, *args):
    try:
        fn(*args)
    except (TypeError, ValueError, RuntimeError, NotImplementedError, CheckpointException) as err:  # DCP's is a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def _gathers(ours, flat, square) -> dict:
    out = {}
    for name, (dtensor, whole, stock_reads_it) in _cases(flat, square).items():
        meta = ours.gather_and_compute_chunk_metadata(dtensor)
        torch_offsets = tuple(compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh,
                                                                    dtensor.placements)[1])
        stock_offsets = tuple(stock_module.gather_and_compute_chunk_metadata(dtensor).offsets)
        replicated = ours.redistribute_uneven_dtensor_to_replicated(dtensor)
        out[name] = {"full_ok": torch.equal(ours.uneven_dtensor_to_full_tensor(dtensor), whole),
                     "offsets": tuple(meta.offsets), "sizes": tuple(meta.sizes),
                     "local": tuple(dtensor.to_local().shape), "stock_offsets": stock_offsets,
                     "stock_reads_it": stock_reads_it, "torch_offsets": torch_offsets,
                     "replicated_ok": all(isinstance(p, Replicate) for p in replicated.placements)
                     and torch.equal(replicated.to_local(), whole)}
        ours.validate_uneven_dtensor(dtensor)
    return out


def _splits(ours, flat) -> dict:
    dtensor, whole = _by_hand(_arange(10, 3), flat, [Shard(0)], {0: [4, 0, 5, 1]}), _arange(10, 3)
    pieces = list(ours.split_dtensor(dtensor, [3, 6, 1], dim=0))
    fulls = [torch.equal(ours.uneven_dtensor_to_full_tensor(p), ref) for p, ref in zip(pieces, whole.split([3, 6, 1]))]
    chunks = [(tuple(p.__create_chunk_list__()[0].offsets), tuple(p.to_local().shape)) for p in pieces]
    shares = all(p.to_local().numel() == 0 or p.to_local().data_ptr() >= dtensor.to_local().data_ptr() for p in pieces)
    replicated = distribute_tensor(_arange(6, 10), flat, [Replicate()])
    locals_ok = [torch.equal(p.to_local(), ref) for p, ref in
                 zip(ours.split_dtensor(replicated, 4, dim=1), _arange(6, 10).split(4, dim=1))]
    copies = [copy.deepcopy(pieces[1]), pickle.loads(pickle.dumps(pieces[1]))]
    return {"fulls": fulls, "chunks": chunks, "shares_storage": shares, "replicated_locals": locals_ok,
            "full_tensor_of_a_piece": torch.equal(pieces[1].full_tensor(), whole[3:9]),
            "copies": [(type(c) is DTensor, torch.equal(c.to_local(), pieces[1].to_local())) for c in copies]}


def _bad_input(ours, flat) -> dict:
    rows = 4  # four ranks each claiming 4 rows of a 10-row tensor
    overlapping = DTensor.from_local(torch.zeros(rows, 3), flat, [Shard(0)], shape=(10, 3), stride=(3, 1),
                                     run_check=False)
    from flatfsdp.megatron_fsdp import FSDPDistributedIndex
    from flatfsdp.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    good = _by_hand(_arange(10, 3), flat, [Shard(0)], {0: [4, 0, 5, 1]})
    tp = FSDPDistributedIndex(device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                              dp_shard_dim="dp", tp_dim="tp")
    dp = FSDPDistributedIndex(device_mesh=flat, dp_shard_dim="dp")
    meta = torch.empty(6, 4, device="meta")
    return {"tensor_parallel": _error(make_fsdp_dtensor, torch.zeros(8), meta, tp),
            "not_rows": _error(make_fsdp_dtensor, torch.zeros(6), meta, dp),
            "not_whole": _error(lambda: make_fsdp_dtensor(torch.zeros(8), meta, dp, is_sharded_param=False)),
            "not_a_dtensor": _error(ours.uneven_dtensor_to_full_tensor, torch.ones(2)),
            "overlapping_full": _error(ours.uneven_dtensor_to_full_tensor, overlapping),
            "overlapping_validate": _error(ours.validate_uneven_dtensor, overlapping),
            "bad_sections": _error(lambda: list(ours.split_dtensor(good, [3, 3], dim=0)))}


def _checkpoints(ours, flat, square, tmp) -> dict:
    """One state dict prepared by flatfsdp and one by stock save the same values;
    both load into torch-even DTensors of another layout."""
    from flatfsdp.megatron_fsdp import FSDPDistributedIndex
    from flatfsdp.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    def state(with_nested: bool):
        c = _cases(flat, square)
        model = {"w": c["uneven_dim0"][0], "e": c["torch_even_1d"][0], "r": c["hsdp_like"][0],
                 "two": c["uneven_2d"][0]}
        if with_nested:
            model["n"] = c["torch_even_nested"][0]
        return {"model": model, "optimizer": {"state": {"w": {"exp_avg": c["uneven_dim1"][0], "step": torch.ones(())}}}}

    ours_state = state(True)
    ours.preprocess_state_dict_for_uneven_dtensor(ours_state)
    dcp.save(ours_state, checkpoint_id=f"{tmp}/ours")
    stock_state = state(False)
    stock_module.preprocess_state_dict_for_uneven_dtensor(stock_state)
    dcp.save(stock_state, checkpoint_id=f"{tmp}/stock")

    wholes = {"w": _arange(10, 3), "e": _arange(10, 3), "r": _arange(5, 3), "two": _arange(5, 5), "n": _arange(8, 3)}
    loaded = {}
    for who in ("ours", "stock"):
        target = {"model": {k: distribute_tensor(torch.zeros_like(v), flat, [Shard(1 if k == "two" else 0)])
                            for k, v in wholes.items() if who == "ours" or k != "n"},
                  "optimizer": {"state": {"w": {"exp_avg": distribute_tensor(torch.zeros(3, 7), square,
                                                                             [Shard(1), Replicate()]),
                                                "step": torch.zeros(())}}}}
        dcp.load(target, checkpoint_id=f"{tmp}/{who}")
        loaded[who] = {k: torch.equal(v.full_tensor(), wholes[k]) for k, v in target["model"].items()}
        loaded[who]["exp_avg"] = torch.equal(target["optimizer"]["state"]["w"]["exp_avg"].full_tensor(),
                                             _arange(3, 7))
    index = FSDPDistributedIndex(device_mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), dp_shard_dim="dp")
    rows = [5, 0, 0, 1][dist.get_rank()]
    pending = make_fsdp_dtensor(torch.zeros(rows * 2), torch.empty(6, 2, device="meta"), index,
                                update_uneven_dtensor_chunk_meta=True, run_check=True)
    unprepared = _error(lambda: dcp.save({"p": pending}, checkpoint_id=f"{tmp}/unprepared"))
    return {"loaded": loaded, "unprepared": unprepared}


def _ranks_that_differ(ours, flat, tmp) -> dict:
    """#4910: rank 3's part of "opt" is empty and it holds no entry for it; then
    a rank that lacks an entry whose part is not empty; then a rank that holds
    nothing on the mesh at all."""
    rank = dist.get_rank()
    lengths = {0: [4, 4, 2, 0]}
    holds = {"opt": _by_hand(_arange(10, 3), flat, [Shard(0)], lengths)} if rank != 3 else {}
    sd = {"optimizer": {"state": holds}, "model": {"e": distribute_tensor(_arange(4, 2), flat, [Shard(0)])}}
    ours.preprocess_state_dict_for_uneven_dtensor(sd)
    dcp.save(sd, checkpoint_id=f"{tmp}/differ")
    target = {"optimizer": {"state": {"opt": distribute_tensor(torch.zeros(10, 3), flat, [Shard(0)])}}}
    dcp.load(target, checkpoint_id=f"{tmp}/differ")
    saved_and_loaded = torch.equal(target["optimizer"]["state"]["opt"].full_tensor(), _arange(10, 3))

    lacking = {"opt": _by_hand(_arange(10, 3), flat, [Shard(0)], {0: [4, 3, 2, 1]})} if rank != 3 else {}
    other = _by_hand(_arange(10, 3), flat, [Shard(0)], {0: [1, 2, 3, 4]})
    not_covered = _error(ours.preprocess_state_dict_for_uneven_dtensor, {"o": lacking, "m": {"x": other}})
    nothing_changed = type(other) is DTensor  # the good entry beside the bad one was not touched
    absent = {"m": {"x": _by_hand(_arange(4, 2), flat, [Shard(0)], {0: [1, 1, 1, 1]})}} if rank != 3 else {}
    no_mesh = _error(ours.preprocess_state_dict_for_uneven_dtensor, absent)
    return {"saved_and_loaded": saved_and_loaded, "not_covered": not_covered, "nothing_changed": nothing_changed,
            "no_mesh": no_mesh}


def uneven_worker(rank, world, tmp):
    import flatfsdp.megatron_fsdp.uneven_dtensor as ours

    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return {"gathers": _gathers(ours, flat, square), "splits": _splits(ours, flat), "bad": _bad_input(ours, flat),
            "checkpoints": _checkpoints(ours, flat, square, tmp), "differ": _ranks_that_differ(ours, flat, tmp)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(uneven_worker, 4, str(tmp_path_factory.mktemp("uneven")))


def test_every_dtensor_gathers_to_the_whole_tensor(four_ranks):
    for rank, result in enumerate(four_ranks):
        for name, case in result["gathers"].items():
            assert case["full_ok"] and case["replicated_ok"], (rank, name)
            assert case["sizes"] == case["local"], (rank, name)


def test_each_rank_finds_stocks_offsets_where_stock_reads_the_layout_as_torch_does(four_ranks):
    for rank, result in enumerate(four_ranks):
        for name, case in result["gathers"].items():
            if case["stock_reads_it"]:
                assert case["offsets"] == case["stock_offsets"], (rank, name)
        nested = result["gathers"]["torch_even_nested"]
        assert nested["offsets"] == nested["torch_offsets"], rank  # torch's even layout, read as torch reads it


def test_split_pieces_view_the_part_and_say_where_it_lies(four_ranks):
    starts = [0, 4, 4, 9]  # uneven_dim0's parts: rows [0,4), [4,4), [4,9), [9,10)
    for rank, result in enumerate(four_ranks):
        splits = result["splits"]
        assert all(splits["fulls"]) and all(splits["replicated_locals"]) and splits["full_tensor_of_a_piece"]
        assert splits["shares_storage"]
        assert splits["copies"] == [(True, True), (True, True)]  # a copy or pickle of a piece is a plain DTensor
        for (offset, shape), (lo, hi) in zip(splits["chunks"], [(0, 3), (3, 9), (9, 10)]):
            part = (max(starts[rank], lo), min(starts[rank] + [4, 0, 5, 1][rank], hi))
            if part[1] > part[0]:
                assert offset[0] == part[0] - lo and shape[0] == part[1] - part[0], (rank, lo)


def test_bad_input_is_one_clear_error_on_every_rank(four_ranks):
    for result in four_ranks:
        bad = result["bad"]
        assert bad["not_a_dtensor"].startswith("TypeError") and "expected a DTensor" in bad["not_a_dtensor"]
        for key in ("overlapping_full", "overlapping_validate"):
            assert bad[key].startswith("ValueError") and "(16, 3), not the global shape (10, 3)" in bad[key], key
        assert "sections [3, 3] do not add up to the size 10" in bad["bad_sections"]
        assert bad["tensor_parallel"].startswith("NotImplementedError") and "tensor-parallel size 2" in \
            bad["tensor_parallel"]
        assert bad["not_rows"].startswith("ValueError") and "6 elements is not whole rows of" in bad["not_rows"]
        assert "not sharded is whole on every rank" in bad["not_whole"]


def test_checkpoints_prepared_here_and_by_stock_load_the_same_values(four_ranks):
    for rank, result in enumerate(four_ranks):
        loaded = result["checkpoints"]["loaded"]
        assert all(loaded["ours"].values()), (rank, loaded["ours"])
        assert all(loaded["stock"].values()), (rank, loaded["stock"])
        assert loaded["ours"].keys() - loaded["stock"].keys() == {"n"}


def test_a_piece_whose_part_is_not_found_yet_names_the_fix_instead_of_a_hidden_collective(four_ranks):
    for result in four_ranks:
        error = result["checkpoints"]["unprepared"]
        assert error is not None and "preprocess_state_dict_for_uneven_dtensor" in error


def test_ranks_holding_different_entries_save_and_load_where_stock_hangs(four_ranks):
    for result in four_ranks:
        assert result["differ"]["saved_and_loaded"]


def test_entries_a_rank_lacks_or_a_rank_missing_from_a_mesh_are_named_on_every_rank(four_ranks):
    for result in four_ranks:
        differ = result["differ"]
        assert differ["not_covered"].startswith("ValueError") and "ranks [3] hold no entry" in differ["not_covered"]
        assert "o.opt" in differ["not_covered"] and differ["nothing_changed"]
        assert "ranks [3] hold no DTensor on the mesh of ranks [0, 1, 2, 3]" in differ["no_mesh"]
