"""Reliability, engine: what used to be silently wrong, to hang or to abort deep
inside gloo is now a clear error or the correct result (docs/reliability.md).
Real processes on gloo; every case asserts what would break without the feature."""

from __future__ import annotations

import os
import warnings
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatfsdp
from flatfsdp.models.gpt import GPTConfig, TransformerBlock
from harness import run_ranks
from training import make_model

SMALL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    return None


# ---- ranks that disagree on the model -----------------------------------------------------------

def disagreement_worker(rank, world):
    out = {}
    wide = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32 if rank == 0 else 48)
    out["shape"] = _error(lambda: flatfsdp.fully_shard(make_model(cfg=wide), fsdp_unit_modules=[TransformerBlock]))

    def dtype():
        model = make_model(cfg=SMALL)
        if rank == 1:
            model.blocks[1].mlp.fc.double()
        flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock])
    out["dtype"] = _error(dtype)

    def frozen():
        model = make_model(cfg=SMALL)
        model.blocks[0].ln1.weight.requires_grad_(rank == 0)
        flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock])
    out["requires_grad"] = _error(frozen)
    deeper = GPTConfig(vocab_size=64, seq_len=16, n_layer=2 + rank, n_head=2, d_model=32)
    out["units"] = _error(lambda: flatfsdp.fully_shard(make_model(cfg=deeper), fsdp_unit_modules=[TransformerBlock]))
    # After all that the group still works, and agreeing ranks shard as before.
    model = flatfsdp.fully_shard(make_model(cfg=SMALL), fsdp_unit_modules=[TransformerBlock])
    out["agreeing"] = float(model(torch.zeros(1, 4, dtype=torch.long)).detach().sum())
    out["replicas_same"] = _error(lambda: flatfsdp.verify_replicas(make_model(seed=3, cfg=SMALL)))
    out["replicas_differ"] = _error(lambda: flatfsdp.verify_replicas(make_model(seed=rank, cfg=SMALL)))
    return out


@pytest.fixture(scope="module")
def disagreement():
    return run_ranks(disagreement_worker, 2)


def test_a_shape_difference_is_named_at_fully_shard_on_every_rank(disagreement):
    for out in disagreement:
        kind, message = out["shape"]
        assert kind == "ReplicaMismatch"
        assert message.startswith("ranks disagree on the model in unit 'blocks.1': parameter 'ln1.weight' is "
                                  "(32,) float32 requires_grad=True on rank 0 but (48,) float32 requires_grad=True "
                                  "on rank 1")  # blocks.1 is the first unit sharded


def test_dtype_requires_grad_and_unit_structure_differences(disagreement):
    kind, message = disagreement[0]["dtype"]
    assert kind == "ReplicaMismatch" and "'mlp.fc.weight' is (128, 32) float32" in message and "float64" in message
    kind, message = disagreement[1]["requires_grad"]
    assert "'ln1.weight' is (32,) float32 requires_grad=True on rank 0" in message
    assert "requires_grad=False on rank 1" in message
    kind, message = disagreement[0]["units"]
    assert "sharding unit 'blocks.1' on rank 0 but unit 'blocks.2' on rank 1" in message  # last block first


def test_agreeing_ranks_still_work_and_replica_values_are_checked(disagreement):
    assert disagreement[0]["agreeing"] == disagreement[1]["agreeing"]
    assert disagreement[0]["replicas_same"] is None
    kind, message = disagreement[1]["replicas_differ"]
    assert kind == "ReplicaMismatch"
    assert message.startswith("replicas start from different weights: 'tok_emb.weight' differs between rank 0 "
                              "and rank(s) 1")


# ---- silent cases that are now correct or an error ---------------------------------------------

def _fp64_run(shard: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    if shard:
        flatfsdp.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 8, dtype=torch.float64, generator=gen)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().full_tensor() if shard else p.detach() for p in model.parameters()]


def silent_worker(rank, world):
    out = {}
    # fp64 parameters are stepped in fp64: the sharded run equals the unsharded one to fp64 rounding.
    sharded, reference = _fp64_run(True), _fp64_run(False)
    out["fp64_dtypes"] = sorted({str(t.dtype) for t in sharded})
    out["fp64_error"] = max(float((a - b).abs().max()) for a, b in zip(sharded, reference))

    # A pretrained (real) embedding in a meta-built unit keeps its values.
    pretrained = torch.arange(80, dtype=torch.float32).reshape(10, 8) / 7
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    model[0].weight = nn.Parameter(pretrained.clone())
    flatfsdp.fully_shard(model, init_model_with_meta_device=True)
    model(torch.arange(4)[None])
    model.reshard()
    out["pretrained_kept"] = torch.equal(model[0].weight.full_tensor(), pretrained)
    out["meta_linear_initialised"] = bool(model[1].weight.full_tensor().abs().sum() > 0)

    out["device"] = _error(lambda: flatfsdp.fully_shard(make_model(cfg=SMALL), device="cuda:3"))
    out["device_ok"] = _error(lambda: flatfsdp.fully_shard(make_model(cfg=SMALL), device="cpu"))

    # An optimizer built on the original parameters and never bound.
    model = make_model(cfg=SMALL)
    stale = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flatfsdp.fully_shard_model(model, fsdp_unit_modules=[TransformerBlock])
    out["unbound"] = _error(lambda: model(torch.zeros(1, 4, dtype=torch.long)))
    flatfsdp.fully_shard_optimizer(stale, model)  # bound: now it trains
    out["bound"] = _error(lambda: model(torch.zeros(1, 4, dtype=torch.long)))
    return out


@pytest.fixture(scope="module")
def silent():
    return run_ranks(silent_worker, 2)


def test_fp64_parameters_stay_fp64_and_train_like_the_unsharded_model(silent):
    for out in silent:
        assert out["fp64_dtypes"] == ["torch.float64"]
        assert out["fp64_error"] < 1e-13  # fp32 stepping would be off by ~1e-8


def test_a_real_parameter_in_a_meta_initialised_unit_keeps_its_values(silent):
    assert all(out["pretrained_kept"] and out["meta_linear_initialised"] for out in silent)


def test_device_that_disagrees_with_the_mesh_is_an_error(silent):
    kind, message = silent[0]["device"]
    assert kind == "ValueError" and "device='cuda:3' disagrees with the device mesh" in message
    assert silent[0]["device_ok"] is None


def test_an_optimizer_on_the_replaced_parameters_is_caught_before_it_steps_nothing(silent):
    kind, message = silent[0]["unbound"]
    assert kind == "ValueError"
    assert "optimizer AdamW holds 28 of the parameters that fully_shard replaced (first: 'tok_emb.weight')" in message
    assert silent[0]["bound"] is None


# ---- NaN / inf ------------------------------------------------------------------------------------

def nonfinite_worker(rank, world):
    model = make_model(cfg=SMALL)
    flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock])
    tokens = torch.arange(8)[None] % 64
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    out = {"clean": float(flatfsdp.local_nonfinite(model, loss)),
           "clean_check": _error(lambda: flatfsdp.check_finite(model, loss, step=1))}
    model.zero_grad(set_to_none=True)
    # Rank 1's loss is inf (its data, say): its gradients, and after the reduction everyone's, turn NaN/inf.
    scale = float("inf") if rank == 1 else 1.0
    loss = model(tokens).float().logsumexp(-1).mean() * scale
    loss.backward()
    out["flag"] = float(flatfsdp.local_nonfinite(model, loss))
    out["check"] = _error(lambda: flatfsdp.check_finite(model, loss, step=7))
    return out


def test_a_nonfinite_step_is_reported_with_step_ranks_and_parameters():
    results = run_ranks(nonfinite_worker, 2)
    assert [r["clean"] for r in results] == [0.0, 0.0] and results[0]["clean_check"] is None
    assert results[1]["flag"] == 1.0  # rank 1 sees it locally, with no communication
    for out in results:
        kind, message = out["check"]
        assert kind == "NonFiniteError"
        assert message.startswith("step 7: the loss is NaN/inf on rank(s) 1; gradients are NaN/inf in 'tok_emb.weight'")


# ---- a collective that never completes ------------------------------------------------------------

def one_sided_forward_worker(rank, world, flag_dir, env_timeout="3"):
    if env_timeout is not None:
        os.environ[flatfsdp.TIMEOUT_ENV] = env_timeout
    model = make_model(cfg=SMALL)
    flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock])
    done = os.path.join(flag_dir, "rank0-done")
    if rank == 0:  # a forward on one rank only: rank 1 never joins the gather
        error = _error(lambda: model(torch.zeros(1, 4, dtype=torch.long)))
        open(done, "w").close()
        return error
    while not os.path.exists(done):  # stay alive (a dead peer is a different error) until rank 0 is done
        time.sleep(0.05)
    return None


def test_a_forward_on_one_rank_fails_in_seconds_naming_unit_phase_and_rank(tmp_path):
    kind, message = run_ranks(one_sided_forward_worker, 2, str(tmp_path), timeout=120)[0]
    assert kind == "CollectiveTimeout"
    assert message.startswith("unit '<root>': forward gather (all_gather) on rank 0 waited 3 s: "
                              "rank(s) 1 did not arrive")
    assert "FLATFSDP_TIMEOUT=3" in message


def test_the_process_groups_own_timeout_rules_when_it_is_shorter(tmp_path):
    """init_process_group(timeout=3 s) and no FLATFSDP_TIMEOUT: the engine's wait
    ends after the group's 3 s (not its own 300 s), naming unit, phase and rank."""
    start = time.monotonic()
    kind, message = run_ranks(one_sided_forward_worker, 2, str(tmp_path), None, timeout=120, group_timeout_s=3)[0]
    assert kind == "CollectiveTimeout"
    assert message.startswith("unit '<root>': forward gather (all_gather) on rank 0 waited 3 s: "
                              "rank(s) 1 did not arrive")
    assert "Limit: the process group's timeout of 3 s" in message
    assert time.monotonic() - start < 60  # without the rule: 300 s, cut off by run_ranks' timeout


def test_flatfsdp_timeout_still_rules_when_it_is_shorter_than_the_groups(tmp_path):
    kind, message = run_ranks(one_sided_forward_worker, 2, str(tmp_path), "2", timeout=120, group_timeout_s=600)[0]
    assert kind == "CollectiveTimeout" and "waited 2 s" in message and "FLATFSDP_TIMEOUT=2" in message


# ---- NaN / inf in a user's own loop ---------------------------------------------------------------

def _own_loop(rank, mode):
    import warnings
    model = make_model(cfg=SMALL)
    flatfsdp.fully_shard(model, fsdp_unit_modules=[TransformerBlock])
    if mode is not None:
        flatfsdp.set_on_nonfinite(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.arange(8)[None] % 64
    out = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(1, 6):
                scale = float("inf") if (step in (2, 4) and rank == 1) else 1.0  # rank 1's data overflows
                loss = model(tokens).float().logsumexp(-1).mean() * scale
                loss.backward()
                opt.step()
                opt.zero_grad()
        except flatfsdp.NonFiniteError as exc:
            out["error"] = (step, str(exc))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, flatfsdp.NonFiniteWarning)]
    return out


def own_loop_nonfinite_worker(rank, world):
    return {mode: _own_loop(rank, mode) for mode in (None, "error", "off")}


@pytest.fixture(scope="module")
def own_loop():
    return run_ranks(own_loop_nonfinite_worker, 2)


def test_a_nonfinite_gradient_in_a_users_loop_is_warned_once_naming_step_and_parameter(own_loop):
    for out in own_loop:
        default = out[None]
        assert default["error"] is None
        assert len(default["warnings"]) == 1, default["warnings"]  # steps 2 and 4 went wrong: one warning
        assert default["warnings"][0].startswith("step 2: gradients are NaN/inf in 'tok_emb.weight'")
        assert out["off"] == {"error": None, "warnings": []}


def test_the_error_mode_stops_every_rank_before_the_next_forward(own_loop):
    for out in own_loop:
        step, message = out["error"]["error"]
        assert step == 3  # raised at the start of the forward that follows the bad step
        assert message.startswith("step 2: gradients are NaN/inf in 'tok_emb.weight'")
        assert out["error"]["warnings"] == []


# ---- an optimizer that stepped before sharding ----------------------------------------------------

def stepped_optimizer_worker(rank, world):
    from flatfsdp.models.gpt import lm_loss
    from training import batches, full_params, make_optimizer, sharded_step
    data = batches(5)
    model = make_model()
    opt = make_optimizer("adamw", model.named_parameters())
    for x in data[:2]:  # two steps on the plain model, on the whole batch (every rank the same)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    model, opt = flatfsdp.fully_shard(model, opt, fsdp_unit_modules=[TransformerBlock])
    moment = opt.state[model.blocks[0].mlp.fc.weight]["exp_avg"]
    out = {"moment": (type(moment).__name__, tuple(moment.to_local().shape), tuple(moment.shape))}
    for x in data[2:]:
        sharded_step(model, opt, x, rank, world)
    out["params"] = full_params(model)
    factored = make_model()
    adafactor = torch.optim.Adafactor(factored.parameters(), lr=1e-2)
    lm_loss(factored(data[0][:, :-1]), data[0][:, 1:]).backward()
    adafactor.step()
    out["factored"] = _error(lambda: flatfsdp.fully_shard(factored, adafactor, fsdp_unit_modules=[TransformerBlock]))
    return out


def test_state_of_an_optimizer_that_stepped_before_sharding_is_carried_into_the_shards():
    from training import max_diff, train_reference
    _, reference = train_reference(5, "adamw")
    for out in run_ranks(stepped_optimizer_worker, 2):
        assert out["moment"] == ("DTensor", (64, 32), (128, 32))  # each rank holds its chunk of Adam's moment
        assert max_diff(out["params"], reference) < 2e-5  # trains on as the unsharded run does
        kind, message = out["factored"]
        assert kind == "ValueError"
        assert message.startswith("Adafactor holds state 'row_var' of shape (64, 1) for parameter 'tok_emb.weight'")


# ---- replicas that start apart, schedules that drift apart -----------------------------------------

class _Routed(nn.Module):
    """Two same-size units whose order the data decides (here: the rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.order = ("a", "b")

    def forward(self, x):
        for name in self.order:
            x = getattr(self, name)(x)
        return x


def replicas_and_schedules_worker(rank, world):
    # The one-call form takes the first rank's weights, as DDP does, and says so once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = flatfsdp.fully_shard(make_model(seed=rank, cfg=SMALL), fsdp_unit_modules=[TransformerBlock])
    out = {"seeds": [str(w.message) for w in caught if "different weights" in str(w.message)]}
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["took_rank0"] = all(torch.equal(full[n], p) for n, p in make_model(seed=0, cfg=SMALL).named_parameters())
    os.environ["FLATFSDP_CHECK_REPLICAS"] = "error"
    out["seeds_strict"] = _error(lambda: flatfsdp.fully_shard(make_model(seed=rank, cfg=SMALL),
                                                               fsdp_unit_modules=[TransformerBlock]))
    del os.environ["FLATFSDP_CHECK_REPLICAS"]
    with torch.device("meta"):  # nothing to compare yet on the meta device: accepted
        meta = make_model(seed=rank, cfg=SMALL)
    out["meta"] = _error(lambda: flatfsdp.fully_shard(meta, fsdp_unit_modules=[TransformerBlock]))
    # The per-module (FSDP2) form shards such replicas as FSDP2 does, with a warning naming them.
    torch.manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flatfsdp.fully_shard(nn.Linear(4, 4))
    out["per_module"] = [str(w.message) for w in caught if "different weights" in str(w.message)]
    os.environ["FLATFSDP_CHECK_REPLICAS"] = "error"
    torch.manual_seed(rank)
    out["per_module_strict"] = _error(lambda: flatfsdp.fully_shard(nn.Linear(4, 4)))
    del os.environ["FLATFSDP_CHECK_REPLICAS"]
    os.environ["FLATFSDP_CHECK_SCHEDULE"] = "1"
    model = flatfsdp.fully_shard(_Routed(), fsdp_unit_modules=[nn.Linear])
    x = torch.ones(2, 8)
    model(x).sum().backward()
    model(x).sum().backward()  # step 2 starts: step 1 compared, equal
    model.order = ("a", "b") if rank == 0 else ("b", "a")
    # Step 3: rank 0's gather of unit a pairs with rank 1's of unit b -- the same size, so
    # without the check nothing fails and each rank computes with the other's weights.
    model(x).sum().backward()
    out["drift"] = _error(lambda: model(x))  # step 4 starts: step 3 compared
    return out


def test_replicas_from_different_seeds_are_named_and_a_drifting_schedule_is_caught():
    for out in run_ranks(replicas_and_schedules_worker, 2):
        assert len(out["seeds"]) == 1, out["seeds"]
        assert out["seeds"][0].startswith("replicas start from different weights in unit 'GPT': 'tok_emb.weight' "
                                          "differs between rank 0 and rank(s) 1; flatfsdp gives every replica the "
                                          "first rank's values, as DDP does")
        assert out["took_rank0"]
        kind, message = out["seeds_strict"]
        assert kind == "ReplicaMismatch"
        assert message.startswith("replicas start from different weights in unit 'blocks.1': 'attn.qkv.weight' "
                                  "differs between rank 0 and rank(s) 1")
        assert out["meta"] is None
        assert len(out["per_module"]) == 1, out["per_module"]
        assert out["per_module"][0].startswith("replicas start from different weights in unit 'Linear': 'weight' "
                                               "differs between rank 0 and rank(s) 1")
        assert out["per_module_strict"][0] == "ReplicaMismatch"
        kind, message = out["drift"]
        assert kind == "ScheduleMismatch", message
        assert message.startswith("step 3: ranks ran different unit collectives: collective #"), message
        assert "is the forward gather of unit 'a' on rank 0 but the forward gather of unit 'b' on rank 1" in message
