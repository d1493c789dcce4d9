"""flatfsdp.megatron_fsdp: the names and signatures of the installed
megatron_fsdp 0.6.1, and one clear error -- nothing half-done -- for bad input
through its doors (a config field flatfsdp does not know or cannot honour, a
dist_index whose groups disagree with its mesh, a checkpoint of another
model, a stock checkpoint without optimizer state). Also: flatfsdp's own
earlier checkpoints (unprefixed keys) keep loading, and the helpers
Megatron-Core imports answer as stock's do."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

import flatfsdp.megatron_fsdp as ours
from harness import run_ranks

stock = pytest.importorskip("megatron_fsdp", reason="pip install --no-deps megatron-fsdp==0.6.1 (the test extra's note)")

from test_megatron_loop import _stock_megatron_fsdp_on_cpu  # noqa: E402  (the CPU stand-ins, worker-only)


def _parameters(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.KEYWORD_ONLY]


def test_the_eight_public_names_are_stocks():
    public = {n for n in stock.__all__ if not n.startswith("__")} | {"__version__"}
    assert set(ours.__all__) == public
    assert ours.__version__ == stock.__version__


@pytest.mark.parametrize("name", ["fully_shard", "fully_shard_model", "fully_shard_optimizer"])
def test_the_functions_take_stocks_parameters_in_stocks_order(name):
    assert _parameters(getattr(ours, name))[:len(_parameters(getattr(stock, name)))] == \
        _parameters(getattr(stock, name))


@pytest.mark.parametrize("name", ["MegatronFSDP", "FSDPDistributedIndex"])
def test_the_classes_are_constructed_with_stocks_parameters(name):
    assert _parameters(getattr(ours, name).__init__) == _parameters(getattr(stock, name).__init__)


def test_the_package_signatures_are_the_engines_keyword_tables():
    """One table: fully_shard_model's and MegatronFSDP's parameters are the engine's
    (front/keyword_table), as flatfsdp's own doors' are; defaults as stock's."""
    from flatfsdp.engine import MEGATRON_FSDP_CLASS, MEGATRON_KEYWORDS

    for fn, table, leading in ((ours.fully_shard_model, MEGATRON_KEYWORDS, 1),
                               (ours.MegatronFSDP.__init__, MEGATRON_FSDP_CLASS, 2)):
        params = inspect.signature(fn).parameters
        assert list(params)[leading:] == [k.name for k in table]
        assert all(params[k.name].default == k.default for k in table)
    shared = {k.name: k for k in MEGATRON_KEYWORDS}
    for k in MEGATRON_FSDP_CLASS:  # a name both take is one keyword, read the same way
        if k.name in shared:
            assert (k.reads, k.no_op, k.ddp_field) == (shared[k.name].reads, shared[k.name].no_op,
                                                       shared[k.name].ddp_field), k.name
    theirs = inspect.signature(stock.MegatronFSDP.__init__).parameters
    for name, param in inspect.signature(ours.MegatronFSDP.__init__).parameters.items():
        if name not in ("self", "module", "dist_index", "mixed_precision_policy"):
            assert param.default == theirs[name].default, name
    with pytest.raises(TypeError, match=r"fully_shard_model\(\): got an unexpected keyword argument 'dvice_mesh'"):
        ours.fully_shard_model(nn.Linear(2, 2), dvice_mesh=None)
    with pytest.raises(TypeError, match=r"MegatronFSDP\(\): got an unexpected keyword argument 'dist_idx'"):
        ours.MegatronFSDP(nn.Linear(2, 2), dist_idx=None)
    assert list(inspect.signature(ours.MegatronFSDP).parameters) == ["module", *[k.name for k in MEGATRON_FSDP_CLASS]]


@pytest.mark.parametrize("name", ["DistributedDataParallelConfig", "MixedPrecisionPolicy"])
def test_the_config_classes_have_stocks_fields_and_defaults(name):
    fields = lambda cls: {f.name: f.default for f in dataclasses.fields(cls)}  # noqa: E731
    assert fields(getattr(ours, name)) == fields(getattr(stock, name))


def test_every_stock_config_field_is_in_the_table():
    from flatfsdp.megatron_fsdp.config_fields import FIELDS

    assert {f.name for f in dataclasses.fields(stock.DistributedDataParallelConfig)} <= set(FIELDS)


def test_the_helpers_megatron_core_imports_answer_as_stocks():
    import megatron_fsdp.utils as stock_utils

    from flatfsdp.megatron_fsdp import utils

    for name in ("find_megatron_fsdp", "get_mcore_tensor_parallel_partition_dim", "is_mcore_tensor_model_parallel"):
        assert _parameters(getattr(utils, name)) == _parameters(getattr(stock_utils, name))
    for attrs, dim in (({"_tensor_parallel_mode": "column"}, 0), ({"_tensor_parallel_mode": "row"}, 1),
                       ({"tensor_model_parallel": True, "partition_dim": 1}, 1), ({}, None)):
        param = nn.Parameter(torch.zeros(2, 2))
        for key, value in attrs.items():
            setattr(param, key, value)
        assert utils.get_mcore_tensor_parallel_partition_dim(param) == dim
        assert stock_utils.get_mcore_tensor_parallel_partition_dim(param) == dim


def test_the_global_memory_buffer_hands_one_storage_out_per_name_and_grows_it():
    import megatron_fsdp.utils as stock_utils

    from flatfsdp.megatron_fsdp.utils import GlobalMemoryBuffer

    assert _parameters(GlobalMemoryBuffer.get_tensor) == _parameters(stock_utils.GlobalMemoryBuffer.get_tensor)
    buffers = GlobalMemoryBuffer()
    assert buffers.device == torch.device("cpu")  # no accelerator here: the CPU, never torch.cuda by name
    first = buffers.get_tensor((2, 3), torch.float32, "a")
    again = buffers.get_tensor((3,), torch.float32, "a")
    assert again.data_ptr() == first.data_ptr() and first.shape == (2, 3) and again.shape == (3,)
    assert buffers.get_tensor((2, 3), torch.float32, "b").data_ptr() != first.data_ptr()  # names kept apart
    assert buffers.get_tensor((2, 3), torch.bfloat16, "a").dtype == torch.bfloat16  # and dtypes
    grown = buffers.get_tensor((4, 4), torch.float32, "a")
    assert grown.shape == (4, 4) and buffers.buffer[("a", torch.float32)].numel() == 16


# --- on two ranks -------------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self, width: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(4, width), nn.Linear(width, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _mesh(shape=(2,), names=("dp",)):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _error(fn) -> str | None:
    try:
        fn()
    except (Exception, CheckpointException) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _untouched(net: nn.Module) -> bool:
    """Not sharded: plain parameters, the class the user made."""
    return type(net) is Net and all(type(p) is nn.Parameter for p in net.parameters())


def config_worker(rank, world):
    out = {}

    @dataclasses.dataclass
    class NewerConfig(ours.DistributedDataParallelConfig):
        fancy_new_switch: bool = False

    @dataclasses.dataclass
    class Fp8Config(ours.DistributedDataParallelConfig):
        fp8_param_gather: bool = True

    index = ours.FSDPDistributedIndex(device_mesh=_mesh(), dp_shard_dim="dp")
    for name, config in (("unknown", NewerConfig()), ("refused", Fp8Config())):
        net = Net()
        out[name] = (_error(lambda: ours.MegatronFSDP(net, index, config)), _untouched(net))
    mesh = _mesh((2, 1), ("outer", "shard"))
    alone = [dist.new_group([r]) for r in range(world)][rank]
    out["hybrid"] = _error(lambda: ours.FSDPDistributedIndex(mesh, "shard", "outer", hybrid_fsdp_group=alone))
    out["ag"] = _error(lambda: ours.FSDPDistributedIndex(mesh, "shard", "outer", fsdp_group_ag=dist.group.WORLD))
    out["dim"] = _error(lambda: ours.FSDPDistributedIndex(mesh, "dp_cp"))
    # NeMo AutoModel with context parallelism: the shard dimension is a flattened one
    with_cp = _mesh((1, 2), ("dp", "cp"))
    with_cp["dp", "cp"]._flatten("dp_cp")
    flat_index = ours.FSDPDistributedIndex(with_cp, "dp_cp")
    flat_model = ours.MegatronFSDP(Net(), flat_index, ours.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params"))
    out["flattened"] = (dist.get_world_size(flat_index.fsdp_group),
                        [tuple(p.to_local().shape) for p in flat_model.parameters()])
    hfsdp = ours.FSDPDistributedIndex(mesh, "shard", "outer", hsdp_outer_dp_shard=True)
    net = Net()
    out["outer"] = (_error(lambda: ours.MegatronFSDP(net, hfsdp, ours.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params"))), _untouched(net))
    # Megatron-Core's adapter passes its expert data-parallel group with HSDP even for a dense model.
    dense = ours.FSDPDistributedIndex(mesh, "shard", "outer", hybrid_fsdp_expt_group=dist.group.WORLD)
    net = Net()
    out["dense_expert_group"] = _error(lambda: ours.MegatronFSDP(net, dense, ours.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params")))
    return out


@pytest.fixture(scope="module")
def config_errors():
    return run_ranks(config_worker, 2)[0]


def test_a_config_field_flatfsdp_does_not_know_is_named_and_nothing_is_sharded(config_errors):
    error, untouched = config_errors["unknown"]
    assert error.startswith("TypeError") and "fancy_new_switch" in error, error
    assert untouched


def test_a_config_field_flatfsdp_cannot_honour_is_named(config_errors):
    error, untouched = config_errors["refused"]
    assert error.startswith("NotImplementedError") and "fp8_param_gather=True" in error, error
    assert untouched


def test_an_index_whose_groups_disagree_with_its_mesh_is_refused_by_name(config_errors):
    assert "hybrid_fsdp_group holds ranks [" in config_errors["hybrid"] and "disagrees" in config_errors["hybrid"]
    assert "fsdp_group_ag holds ranks [0, 1]" in config_errors["ag"], config_errors["ag"]
    assert "dp_shard_dim: 'dp_cp' is not a dimension" in config_errors["dim"], config_errors["dim"]
    error, untouched = config_errors["outer"]
    assert "hsdp_outer_dp_shard=True" in error and "outer_dp_sharding_strategy" in error, error
    assert untouched


def test_a_flattened_dimension_is_a_shard_dimension_as_in_stock(config_errors):
    assert config_errors["flattened"] == (2, [(4, 4), (4,), (1, 8), (1,)])  # Net's a (8, 4) and b (2, 8), halved


def test_an_expert_group_beside_a_dense_model_is_carried_unused_as_stock_does(config_errors):
    assert config_errors["dense_expert_group"] is None


# --- checkpoints: another model, no optimizer state, flatfsdp's earlier spelling ------------------

def _shard(lib, width=8, seed=0):
    net = Net(width, seed)
    return lib.fully_shard(net, torch.optim.Adam(net.parameters(), lr=0.1), device_mesh=_mesh((2, 1), ("dp", "tp")),
                           dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[nn.Linear], zero_dp_strategy=3,
                           device=torch.device("cpu"))


def _step(model, optimizer, rank):
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local(model) -> dict:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checkpoint_worker(rank, world, tmp):
    import flatfsdp

    out = {}
    model, optimizer = _shard(ours)
    _step(model, optimizer, rank)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=f"{tmp}/ours")
    other, other_opt = _shard(ours, width=6, seed=1)  # another model: a layer of another size
    before = _local(other)
    error = _error(lambda: dcp.load({"model": other.state_dict(), "optimizer": other_opt.state_dict()},
                                    checkpoint_id=f"{tmp}/ours"))
    out["other_dcp"] = (error, _same(before, _local(other)))
    wrong = {k.replace("module.a.", "module.c."): v for k, v in model.state_dict().items()}
    error = _error(lambda: other.load_state_dict(wrong))
    out["other_dict"] = (error, _same(before, _local(other)))
    shaped = dict(model.state_dict())
    error = _error(lambda: other.load_state_dict(shaped))
    out["other_shape"] = (error, _same(before, _local(other)))

    lib = _stock_megatron_fsdp_on_cpu()  # stock saves its model only
    stock_model, stock_opt = _shard(lib)
    _step(stock_model, stock_opt, rank)
    dcp.save({"model": stock_model.state_dict()}, checkpoint_id=f"{tmp}/stock_model_only")
    fresh, fresh_opt = _shard(ours, seed=2)
    before = _local(fresh)
    error = _error(lambda: dcp.load({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()},
                                    checkpoint_id=f"{tmp}/stock_model_only"))
    out["no_optimizer"] = (error, _same(before, _local(fresh)))

    # flatfsdp's own one-call door: unprefixed keys, unchanged -- earlier checkpoints keep loading there,
    # and into the wrapper: an in-memory state dict as it is, DCP through the wrapped model's own state dict.
    net = Net()
    flat, flat_opt = flatfsdp.fully_shard(net, torch.optim.Adam(net.parameters(), lr=0.1), device_mesh=_mesh(),
                                          dp_shard_dim="dp", fsdp_unit_modules=[])
    _step(flat, flat_opt, rank)
    dcp.save({"model": flat.state_dict(), "optimizer": flat_opt.state_dict()}, checkpoint_id=f"{tmp}/flat")
    saved = {k: v.to_local().clone() for k, v in flat.state_dict().items()}
    net2 = Net(seed=3)
    again, again_opt = flatfsdp.fully_shard(net2, torch.optim.Adam(net2.parameters(), lr=0.1), device_mesh=_mesh(),
                                            dp_shard_dim="dp", fsdp_unit_modules=[])
    state = {"model": again.state_dict(), "optimizer": again_opt.state_dict()}
    dcp.load(state, checkpoint_id=f"{tmp}/flat")
    again.load_state_dict(state["model"])
    out["flat_again"] = _same(saved, {k: v.to_local() for k, v in again.state_dict().items()})
    wrapped, _ = _shard(ours, seed=4)
    wrapped.load_state_dict(flat.state_dict())
    out["flat_in_memory"] = _same(saved, {k.removeprefix("module."): v for k, v in _local(wrapped).items()})
    wrapped, _ = _shard(ours, seed=5)
    inner = {"model": wrapped.module.state_dict()}
    dcp.load(inner, checkpoint_id=f"{tmp}/flat")
    wrapped.module.load_state_dict(inner["model"])
    out["flat_dcp"] = _same(saved, {k.removeprefix("module."): v for k, v in _local(wrapped).items()})

    out["found"] = (ours.utils.find_megatron_fsdp(wrapped) is wrapped,
                    ours.utils.find_megatron_fsdp(flat) is None,  # its .module is itself: the walk ends
                    hasattr(wrapped.module, "module"))
    out["registration"] = wrapped.param_and_grad_buffer.manual_buffer_registration()

    # stock's two-call form (NeMo AutoModel's): the optimizer built on the wrapper's parameters once
    # _replace_param_with_distributed_if_needed has run, the model found from them; Megatron-Core's
    # marks on the parameters carried onto the DTensors the optimizer steps
    net = Net(seed=6)
    net.a.weight.is_embedding_or_output_parameter = True
    net.a.weight.tensor_model_parallel, net.a.weight.partition_dim, net.a.weight._tensor_parallel_mode = True, 0, "column"
    net.b.bias.sequence_parallel = True
    model = ours.fully_shard_model(net, device_mesh=_mesh((2, 1), ("dp", "tp")), dp_shard_dim="dp",
                                   tp_dim="tp", fsdp_unit_modules=[nn.Linear])
    model.to(torch.device("cpu"), non_blocking=True)  # NeMo AutoModel moves the sharded model (torch swaps tensors)
    out["after_to"] = [(bool(vars(p).get("__fsdp_param__")), p.megatron_fsdp_slice) for p in model.parameters()]
    model._replace_param_with_distributed_if_needed()
    out["marks"] = {n: {a: getattr(p, a) for a in ("is_embedding_or_output_parameter", "tensor_model_parallel",
                                                   "partition_dim", "_tensor_parallel_mode", "sequence_parallel")
                        if hasattr(p, a)} for n, p in model.named_parameters()}
    out["orig_param"] = [(tuple(p.orig_param.shape), p.orig_param is not p, sorted(vars(p)))
                         for p in model.parameters()]
    optimizer = ours.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    before = _local(model)
    _step(model, optimizer, rank)
    out["two_calls"] = (sorted(optimizer.state_dict()["state"]), not _same(before, _local(model)))
    model.module.b.weight = nn.Parameter(torch.zeros(2, 8))  # a caller puts its own parameter in place
    out["replaced"] = _error(model._replace_param_with_distributed_if_needed)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return run_ranks(checkpoint_worker, 2, str(tmp_path_factory.mktemp("mfsdp_bad")))[0]


def test_a_checkpoint_of_another_model_is_refused_with_nothing_loaded(checkpoints):
    for case in ("other_dcp", "other_dict", "other_shape"):
        error, unchanged = checkpoints[case]
        assert error is not None and unchanged, (case, error)
    assert "module.a.weight" in checkpoints["other_dcp"][0]  # DCP names the mis-sized entry
    assert "nothing was loaded" in checkpoints["other_dict"][0] and "module.c.weight" in checkpoints["other_dict"][0]
    assert "'module.a.bias' has shape (8,) there and (6,) in the model" in checkpoints["other_shape"][0], checkpoints["other_shape"][0]


def test_a_stock_checkpoint_without_optimizer_state_is_refused_by_name_with_nothing_loaded(checkpoints):
    error, unchanged = checkpoints["no_optimizer"]
    assert error is not None and "optimizer." in error, error
    assert unchanged


def test_flatfsdp_checkpoints_with_unprefixed_keys_keep_loading(checkpoints):
    assert checkpoints["flat_again"] and checkpoints["flat_in_memory"] and checkpoints["flat_dcp"]


def test_find_megatron_fsdp_finds_the_wrapper_and_ends_every_walk(checkpoints):
    assert checkpoints["found"] == (True, True, False)


def test_manual_buffer_registration_is_a_no_op(checkpoints):
    assert checkpoints["registration"] is None


# --- the redirect: megatron_fsdp (Megatron-Core's bundled copy, the PyPI name) answered by this package ---

REDIRECTED_SCRIPT = """
import sys
import megatron.core.distributed.fsdp.src.megatron_fsdp as bundled
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import find_megatron_fsdp
import megatron_fsdp as pypi
from megatron_fsdp.fully_shard import fully_shard_optimizer
from megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import split_dtensor
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor
import flatfsdp.megatron_fsdp as ours
import flatfsdp.megatron_fsdp.param_and_grad_buffer
import flatfsdp.megatron_fsdp.uneven_dtensor
try:
    import megatron.core.distributed.fsdp.src.megatron_fsdp.no_such_module
    missing = "imported"
except ImportError:
    missing = "ImportError"
served = (split_dtensor is ours.uneven_dtensor.split_dtensor
          and make_fsdp_dtensor is ours.param_and_grad_buffer.make_fsdp_dtensor)
print(bundled is ours, bundled.MegatronFSDP is ours.MegatronFSDP, find_megatron_fsdp is ours.utils.find_megatron_fsdp,
      served, missing, sys.argv[1:])
print(pypi is ours, fully_shard_optimizer is ours.fully_shard.fully_shard_optimizer,
      MegatronFSDP is ours.MegatronFSDP)
"""


def test_the_redirect_answers_both_names_of_megatron_fsdp_with_this_package(tmp_path):
    import os
    import subprocess
    import sys

    src = tmp_path / "megatron" / "core" / "distributed" / "fsdp" / "src"
    src.mkdir(parents=True)
    for folder in (src, *src.parents):  # a stand-in for megatron-core's package tree (not a test dependency)
        if folder == tmp_path:
            break
        (folder / "__init__.py").write_text("")
    (src / "megatron_fsdp").mkdir()
    (src / "megatron_fsdp" / "__init__.py").write_text("raise RuntimeError('the bundled copy was imported')\n")
    script = tmp_path / "train.py"
    script.write_text(REDIRECTED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "flatfsdp.megatron_fsdp.redirect", str(script), "--x", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-3:-1] == ["True True True True ImportError ['--x', '1']", "True True True"]
    (tmp_path / "sitecustomize.py").write_text("import flatfsdp.megatron_fsdp.redirect as r; r.install()\n")
    site = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert site.returncode == 0, site.stderr
    assert site.stdout.split("\n")[-3:-1] == ["True True True True ImportError []", "True True True"]
    (tmp_path / "sitecustomize.py").unlink()
    late = subprocess.run([sys.executable, "-c", "import megatron.core.distributed.fsdp.src as s, sys; "
                           "sys.modules['megatron.core.distributed.fsdp.src.megatron_fsdp'] = s; "
                           "import flatfsdp.megatron_fsdp.redirect as r; r.install()"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert late.returncode != 0 and "before anything imports megatron_fsdp or megatron.core" in late.stderr
    late_pypi = subprocess.run([sys.executable, "-c", "import sys, types; "
                                "sys.modules['megatron_fsdp'] = types.ModuleType('megatron_fsdp'); "
                                "import flatfsdp.megatron_fsdp.redirect as r; r.install()"],
                               capture_output=True, text=True, env=env, timeout=300)
    assert late_pypi.returncode != 0 and "megatron_fsdp was imported before" in late_pypi.stderr


def test_stocks_two_call_form_finds_the_model_and_trains(checkpoints):
    assert checkpoints["two_calls"] == ([0, 1, 2, 3], True)


def test_moving_the_model_keeps_what_its_parameters_answer(checkpoints):
    """``model.to(device)`` swaps new tensors into the parameter objects
    (torch's swap_tensors, class and attributes included): the marker and
    Megatron-FSDP's members survive, and the optimizer still finds the model."""
    assert checkpoints["after_to"] == [(True, slice(0, 16)), (True, slice(0, 4)), (True, slice(0, 8)), (True, slice(0, 1))]


def test_megatron_cores_marks_reach_the_parameters_its_optimizer_steps(checkpoints):
    assert checkpoints["marks"] == {
        "module.a.weight": {"is_embedding_or_output_parameter": True, "tensor_model_parallel": True,
                            "partition_dim": 0, "_tensor_parallel_mode": "column"},
        "module.a.bias": {}, "module.b.weight": {}, "module.b.bias": {"sequence_parallel": True}}


def test_orig_param_is_the_parameter_the_caller_made_and_nothing_is_set_on_the_dtensors(checkpoints):
    """Megatron-Bridge's weight import reads ``orig_param.shape``; the marks are
    read through it, not copied (the DTensor holds only the one-call marker)."""
    assert checkpoints["orig_param"] == [((8, 4), True, ["__fsdp_param__", "_is_param"]),
                                         ((8,), True, ["__fsdp_param__", "_is_param"]),
                                         ((2, 8), True, ["__fsdp_param__", "_is_param"]),
                                         ((2,), True, ["__fsdp_param__", "_is_param"])]


def test_a_parameter_replaced_after_sharding_is_named_not_trained_unsharded(checkpoints):
    error = checkpoints["replaced"]
    assert error is not None and "['b.weight']" in error and "replaced after fully_shard_model" in error
