"""Megatron-FSDP's front doors as flatfsdp takes them: every keyword, by name
and in Megatron-FSDP's positional order, its MixedPrecisionPolicy field by
field, and fully_shard_optimizer's one-argument form (docs/megatron.md)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.functional import mse_loss

import flatfsdp
from flatfsdp.engine.front import keyword_table, keywords
from flatfsdp.engine.front.keyword_table import EVERY, MEGATRON, GivenKeywords, Keyword
from flatfsdp.engine.front.megatron_buffers import DistributedDataParallelConfig
from flatfsdp.engine.layout.precision import resolve_policy
from harness import run_ranks


MEGATRON_KEYWORDS = [k.name for k in MEGATRON]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "megatron.md"


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def test_the_front_doors_take_megatron_fsdps_parameters_in_its_order():
    assert _positional(flatfsdp.fully_shard) == ["module", "optimizer", *MEGATRON_KEYWORDS]
    assert _positional(flatfsdp.fully_shard_model) == ["module", *MEGATRON_KEYWORDS]
    assert _positional(flatfsdp.fully_shard_optimizer) == ["optimizer", "preproc_state_dict_for_dcp_ckpt"]
    # Everything flatfsdp adds (FSDP2's and its own keywords) is keyword-only, so no position moves.
    for fn in (flatfsdp.fully_shard, flatfsdp.fully_shard_model, flatfsdp.fully_shard_optimizer):
        extra = [p for p in inspect.signature(fn).parameters.values() if p.name not in _positional(fn)]
        assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in extra), fn.__name__


def test_every_keyword_says_how_it_is_read_or_why_it_is_a_no_op():
    assert all(bool(k.reads) != bool(k.no_op) for k in EVERY)
    with pytest.raises(ValueError, match="say how it is read or why it is a no-op"):
        Keyword("x", None, "Any", reads="the mesh", no_op="nothing")
    with pytest.raises(ValueError, match="say how it is read or why it is a no-op"):
        Keyword("x", None, "Any")
    assert len({k.name for k in EVERY}) == len(EVERY), "a keyword written twice"


def test_the_signatures_are_the_tables():
    for fn, tables in ((flatfsdp.fully_shard, keyword_table.FSDP2 + keyword_table.OWN),
                       (flatfsdp.fully_shard_model, keyword_table.OWN)):
        params = inspect.signature(fn).parameters
        for k in MEGATRON + tables:
            assert params[k.name].default == k.default, (fn.__name__, k.name)
        assert [p.name for p in params.values() if p.kind is p.KEYWORD_ONLY] == [k.name for k in tables]


def test_a_keyword_not_in_the_table_is_an_error_not_a_none():
    given = GivenKeywords()
    assert given.zero_dp_strategy == 3 and given.sync_model_each_microbatch is True
    with pytest.raises(AttributeError, match="dvice_mesh"):
        given.dvice_mesh
    with pytest.raises(TypeError, match=r"fully_shard_model\(\) got unexpected keyword argument\(s\) \['dvice_mesh'\]"):
        flatfsdp.fully_shard_model(nn.Linear(2, 2), dvice_mesh=None)
    with pytest.raises(TypeError, match="mesh"):
        flatfsdp.fully_shard_model(nn.Linear(2, 2), mesh=None)  # FSDP2's keyword: the per-module door's only
    with pytest.raises(TypeError, match="too many positional arguments"):
        flatfsdp.fully_shard_model(nn.Linear(2, 2), *([None] * (len(MEGATRON) + 1)))
    with pytest.raises(TypeError, match="multiple values for argument 'device_mesh'"):
        flatfsdp.fully_shard(nn.Linear(2, 2), None, None, device_mesh=None)


def test_every_options_field_is_mapped_or_a_keyword_of_that_name():
    assert set(keywords._COPIED) <= {k.name for k in EVERY}


def test_ddp_config_is_checked_against_the_table():
    """One class: megatron_fsdp 0.6.1's fields and defaults; every keyword's
    ``ddp_field`` is one of them (the values a call sets: the positional test)."""
    stock = pytest.importorskip("megatron_fsdp").DistributedDataParallelConfig
    fields = {f.name: f.default for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert fields == {f.name: f.default for f in dataclasses.fields(stock)}
    for k in MEGATRON:
        if k.ddp_field is not None:
            assert k.ddp_field in fields, k.name


def _documented_rows() -> list[tuple[list[str], str]]:
    """(keywords, text) of each row of the front doors' table in docs/megatron.md."""
    section = DOCS.read_text().split("## The front doors", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([a-z_0-9]+)`", cells[0]), cells[1]))
    return rows


def test_docs_table_names_every_megatron_keyword_once_and_says_which_are_no_ops():
    rows = _documented_rows()
    named = [name for names, _ in rows for name in names]
    assert sorted(named) == sorted(MEGATRON_KEYWORDS)
    by_name = {k.name: k for k in MEGATRON}
    for names, text in rows:
        for name in names:
            assert text.startswith("no-op") == bool(by_name[name].no_op), (name, text)


def test_the_signatures_match_the_installed_megatron_fsdp():
    megatron_fsdp = pytest.importorskip("megatron_fsdp")
    for ours, theirs in ((flatfsdp.fully_shard, megatron_fsdp.fully_shard),
                         (flatfsdp.fully_shard_model, megatron_fsdp.fully_shard_model),
                         (flatfsdp.fully_shard_optimizer, megatron_fsdp.fully_shard_optimizer)):
        their_params = list(inspect.signature(theirs).parameters.values())
        assert _positional(ours) == [p.name for p in their_params], theirs.__name__
        ours_params = inspect.signature(ours).parameters
        for p in their_params:
            # Theirs defaults to their policy object, ours to None (the same policy); fully_shard's
            # optimizer is optional here (FSDP2's per-module form takes none).
            if p.name != "mixed_precision_policy" and p.default is not inspect.Parameter.empty:
                assert ours_params[p.name].default == p.default, (theirs.__name__, p.name)


# ---- the policy --------------------------------------------------------------------------------------

@dataclasses.dataclass
class MegatronPolicy:
    """The shape of megatron_fsdp.MixedPrecisionPolicy (0.6.1): what resolve_policy reads by name."""
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None


@dataclasses.dataclass
class NewerMegatronPolicy(MegatronPolicy):
    quantize_grads: str | None = None


def _policy_classes():
    classes = [MegatronPolicy]
    try:
        import megatron_fsdp
        classes.append(megatron_fsdp.MixedPrecisionPolicy)
    except ImportError:
        pass
    return classes


@pytest.mark.parametrize("cls", _policy_classes(), ids=lambda c: c.__module__)
def test_megatron_mixed_precision_policy_is_read_field_by_field(cls):
    default = resolve_policy(cls())
    assert (default.param_dtype, default.main_params_dtype, default.reduce_dtype) == (None, torch.float32, None)
    assert default.reduction_dtype(torch.bfloat16) == torch.bfloat16  # main_grads None: the parameters' dtype
    assert default.grads_dtype(torch.bfloat16) == torch.float32  # ... and main grads as precise as the main weights
    policy = resolve_policy(cls(main_params_dtype=torch.float64, main_grads_dtype=torch.float32))
    assert (policy.main_dtype(torch.float32), policy.grads_dtype(torch.float32)) == (torch.float64, torch.float32)
    assert policy.reduction_dtype(torch.float32) == torch.float32  # no grad_comm_dtype: main_grads_dtype
    policy = resolve_policy(cls(main_params_dtype=None, main_grads_dtype=torch.float32,
                                grad_comm_dtype=torch.bfloat16))
    assert policy.main_dtype(torch.bfloat16) == torch.bfloat16
    assert policy.reduction_dtype(torch.bfloat16) == torch.bfloat16
    assert policy.grads_dtype(torch.bfloat16) == torch.float32
    # Megatron-FSDP's own flags still refine it, as they do flatfsdp's policy.
    assert resolve_policy(cls(), preserve_fp32_weights=False).main_params_dtype is None


def test_a_megatron_policy_field_flatfsdp_does_not_know_is_refused_by_name():
    assert resolve_policy(NewerMegatronPolicy()).main_params_dtype == torch.float32  # unset: harmless
    with pytest.raises(TypeError, match=r"field\(s\) \['quantize_grads'\] are not understood"):
        resolve_policy(NewerMegatronPolicy(quantize_grads="mxfp8"))
    with pytest.raises(TypeError, match="main_grads_dtype must be a floating torch.dtype"):
        resolve_policy(MegatronPolicy(main_grads_dtype="fp32"))


def test_flatfsdps_policy_speaks_megatron_fsdps_names_too():
    ours = flatfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                         grad_comm_dtype=torch.bfloat16)
    assert ours.reduce_dtype == torch.bfloat16 and ours.grads_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="name the same thing"):
        flatfsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32, grad_comm_dtype=torch.bfloat16)


# ---- every keyword, positionally, on 2 ranks ---------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def _every_keyword_positionally(mesh, policy):
    """Megatron-FSDP's fully_shard_model arguments by position, each set away
    from its default where the engine reads it."""
    values = dict(device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp", fsdp_unit_modules=[Block],
                  zero_dp_strategy="optim_grads", device=torch.device("cpu"), mixed_precision_policy=policy,
                  overlap_grad_reduce=False, overlap_param_gather=False, report_nan_in_param_grad=True,
                  average_in_collective=True, disable_bucketing=True, keep_fp8_transpose_cache=True,
                  nccl_ub=True, fsdp_double_buffer=True, fsdp_db_use_persist_buf_on_alloc_fail=True,
                  disable_symmetric_registration=True, enable_fine_grained_param_gather=True,
                  cuda_graph_mode=True, maxpool_double_buffer=True, fsdp_group_ag=mesh["fsdp"].get_group())
    defaults = inspect.signature(flatfsdp.fully_shard_model).parameters
    return [values.get(name, defaults[name].default) for name in MEGATRON_KEYWORDS]


def positional_worker(rank, world):
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    policy = MegatronPolicy(main_params_dtype=torch.float64, main_grads_dtype=torch.float32)
    model = flatfsdp.fully_shard_model(_net(), *_every_keyword_positionally(mesh, policy))
    optimizer = flatfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), False)
    state = model._flatfsdp_state
    out = {"bucket_bytes": state.options.bucket_bytes, "on_nonfinite": state.controls.on_nonfinite,
           "strategy": model.ddp_config.data_parallel_sharding_strategy, "policy": model.mp_policy is policy,
           "as_given": {name: getattr(model.ddp_config, name) for name in (
               "overlap_grad_reduce", "check_for_nan_in_grad", "nccl_ub", "fsdp_manual_registration")}}
    buffers = model.param_and_grad_buffer.parameter_groups
    out["dtypes"] = (buffers[0].main_weight_buffer.data.dtype, buffers[0].main_grad_buffer.data.dtype)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    mse_loss(model(x), y).backward()
    out["grad_dtype"] = model[2].weight.grad.dtype
    optimizer.step()
    optimizer.zero_grad()
    # report_nan_in_param_grad: NaN gradients are an error at the next forward, on every rank.
    (model(x).sum() * float("nan")).backward()
    try:
        model(x)
        out["nan"] = None
    except flatfsdp.NonFiniteError as err:
        out["nan"] = str(err).splitlines()[0]
    out["errors"] = {}
    for name, kwargs in (("use_decoupled_grad", dict(use_decoupled_grad=True)),
                         ("fsdp_group_ag", dict(fsdp_group_ag="not a group")),
                         ("hybrid_fsdp_expt_group", dict(hybrid_fsdp_expt_group=mesh["fsdp"].get_group()))):
        try:
            flatfsdp.fully_shard_model(_net(), fsdp_unit_modules=[Block], **kwargs)
        except Exception as err:  # the test asserts on type and message
            out["errors"][name] = (type(err).__name__, str(err))
    return out


def test_every_megatron_keyword_by_position_on_two_ranks():
    for out in run_ranks(positional_worker, 2):
        assert out["bucket_bytes"] == 0  # disable_bucketing
        assert out["on_nonfinite"] == "error"  # report_nan_in_param_grad
        assert out["strategy"] == "optim_grads" and out["policy"]
        # ddp_config records the keywords as given (the last was never a keyword: its class default)
        assert out["as_given"] == dict(overlap_grad_reduce=False, check_for_nan_in_grad=True, nccl_ub=True,
                                       fsdp_manual_registration=False)
        assert out["dtypes"] == (torch.float64, torch.float32)  # main weights fp64, main grads fp32
        assert out["grad_dtype"] == torch.float64  # the optimizer reads them cast to the main weights' dtype
        assert out["nan"].startswith("step 2: gradients are NaN/inf in '0.fc.weight'"), out["nan"]
        kind, message = out["errors"]["use_decoupled_grad"]
        assert kind == "NotImplementedError" and "FusedAdam" in message
        assert out["errors"]["fsdp_group_ag"][0] == "TypeError"
        assert out["errors"]["hybrid_fsdp_expt_group"] == (
            "ValueError", "hybrid_fsdp_expt_group is a group of expert parameters: it needs expt_device_mesh=")


# ---- main grads narrower than the main weights train as the reference ---------------------------------

def main_grads_worker(rank, world, main_params, main_grads, comm):
    model = flatfsdp.fully_shard_model(_net(), fsdp_unit_modules=[Block], mixed_precision_policy=MegatronPolicy(
        main_params_dtype=main_params, main_grads_dtype=main_grads, grad_comm_dtype=comm))
    optimizer = flatfsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        loss = mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _reference_losses(world):
    model = _net().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    losses = [[] for _ in range(world)]
    for _ in range(3):
        for r in range(world):
            x, y = torch.randn(4, 8, generator=gens[r]), torch.randn(4, 2, generator=gens[r])
            loss = mse_loss(model(x.double()), y.double())
            (loss / world).backward()
            losses[r].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("main_params, main_grads, comm", [
    (torch.float64, torch.float32, None), (torch.float32, torch.float32, torch.bfloat16), (None, None, None)])
def test_megatron_precision_policies_train_as_the_reference(main_params, main_grads, comm):
    tolerance = 2e-2 if comm is torch.bfloat16 else 1e-5
    reference = _reference_losses(2)
    for rank, losses in enumerate(run_ranks(main_grads_worker, 2, main_params, main_grads, comm)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[rank], dtype=torch.float32),
                                   rtol=tolerance, atol=tolerance)
