"""The bench's prediction of each run it makes (``--predict``), printed beside
the measurement: the estimator's time model (flatfsdp.estimator.timeline) on

* the schedule of the very setup the run trains with (``setup_flatfsdp_variant``,
  the floor's trainer), recorded as rank 0 of a fake world of the run's size;
* a probe of this machine, taken in the same session before the runs: the
  bench model's ops timed, the cost of moving bytes between ranks
  (``--predict``); or a named device's published throughput
  (``--predict-device h100``);
* the run's links: loopback as probed, the ``--link`` token bucket, the two
  simulated nodes' egress -- each at the rate a probe of it measured
  (link_probe.py) where the probe has one, else at its nominal rate.

One probe serves every contender and every cell: nothing is fitted to a run.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.device_mesh import init_device_mesh

from flatfsdp.bench.contenders import (FLATFSDP_MESH_NAMES, FLATFSDP_VARIANTS, hybrid_mesh, setup_floor,
                                       setup_flatfsdp_variant)
from flatfsdp.bench.link_probe import link_key, probe_link
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.wire import parse_rate
from flatfsdp.bench.workload import build_model, device, make_batches
from flatfsdp.estimator.compute_cost import Measured, Throughput
from flatfsdp.estimator.devices import DEVICES
from flatfsdp.estimator.fabric import PRESETS, Cluster, Host, Mesh
from flatfsdp.estimator.fake_world import fake_world
from flatfsdp.estimator.probe import MachineProbe, loopback, probe
from flatfsdp.estimator.schedule_trace import StepTrace, tracing
from flatfsdp.estimator.timeline import Prediction, replay

PREDICTED = ("floor",) + tuple(FLATFSDP_VARIANTS)
"""The contenders whose schedule the estimator can record (the others are not flatfsdp's)."""


def probe_step(values: dict):
    """The probe's workload: the floor's unsharded step on the bench model (one rank's rows)."""
    cfg = BenchConfig.from_dict(values)
    dev = device()
    with torch.device(dev):
        model = build_model(cfg)
    trainer = setup_floor(model, cfg)
    x, y = make_batches(replace(cfg, warmup=1, steps=0), 0, 1, dev)[0]
    return lambda: trainer.step(x, y)


def engine_step(values: dict):
    """The same model and batch through the engine (plain flatfsdp) at one rank: nothing travels."""
    cfg = BenchConfig.from_dict(values)
    dev = device()
    with torch.device(dev):
        model = build_model(cfg)
    trainer = setup_flatfsdp_variant("flatfsdp", model, cfg)
    x, y = make_batches(replace(cfg, warmup=1, steps=0), 0, 1, dev)[0]
    return lambda: trainer.step(x, y)


def workload_key(cfg: BenchConfig) -> str:
    """What a probe's engine measurement is for: the model, its batch and precision."""
    tied = "untied" if cfg.untied else "tied-unit" if cfg.tied_unit else "tied"
    return (f"{cfg.model} {cfg.layers}x{cfg.d_model} h{cfg.heads} v{cfg.vocab} {tied}, {cfg.batch}x{cfg.seq_len}, "
            f"{'bf16' if cfg.bf16 else 'fp32'}")


def probe_machine(cfg: BenchConfig, shapes: list[BenchConfig] | None = None,
                  links: list[BenchConfig] | None = None) -> MachineProbe:
    """This machine, for this bench's model at each batch shape of ``shapes``
    (default: its own), ranks side by side one per core, transfers as large as
    the model's fp32 weights (16 to 128 MB), and the engine at one rank; and
    the throttled link of each of ``links`` (default: ``cfg``'s, if it has one)
    with its ranks behind it (link_probe.py)."""
    shapes = shapes or [cfg]
    links = [cfg] if links is None and cfg.link else links or []
    with torch.device("meta"):
        weights = sum(p.numel() for p in build_model(cfg).parameters()) * 4
    machine = probe([(probe_step, (c.as_dict(),)) for c in shapes], threads_per_rank=cfg.threads_per_rank,
                    comm_mbytes=min(128, max(16, weights >> 20)),
                    engine_workloads=[(workload_key(c), engine_step, (c.as_dict(),)) for c in shapes])
    for link in links:
        if link_key(link) not in machine.links:
            machine.links[link_key(link)] = probe_link(link)
    return machine


def engine_overhead(cfg: BenchConfig, machine: MachineProbe) -> float:
    """The engine's host work a step beyond its ops: its step at one rank as the
    probe timed it, less the replay of that step's ops (0 if not probed)."""
    measured = machine.engine_step_s.get(workload_key(cfg))
    if measured is None:
        return 0.0
    alone = replace(cfg, nprocs=1, nodes=1, link=None, contenders=("flatfsdp",))
    predicted = replay(trace_for_prediction(alone, "flatfsdp")[0], *models_for(alone, "flatfsdp", machine, None, 0.0))
    return max(0.0, measured - predicted.step_s)


def trace_run(cfg: BenchConfig, name: str, device_type: str | None = None) -> StepTrace:
    """Rank 0's second step of contender ``name``, recorded in a fake world of
    the run's size, on fake tensors of ``device_type`` (default: the device the
    run trains on). The device matters: the same model runs other ops on
    another -- on a GPU RMSNorm is one fused kernel and attention cuDNN's,
    where a CPU takes five passes for the norm and its own attention -- and a
    probe of the GPU prices the GPU's ops."""
    device_type = device_type or device().type
    world = 1 if name == "floor" and cfg.nodes == 1 and cfg.nprocs == 1 else cfg.nprocs * cfg.nodes
    with fake_world(world) as fake:
        outer = FLATFSDP_VARIANTS.get(name, {}).get("outer")
        # Made here, on real tensors: a mesh reads its rank table.
        mesh = (hybrid_mesh(device_type, cfg, FLATFSDP_MESH_NAMES) if outer
                else init_device_mesh(device_type, (world,)))
        with fake, torch.device(device_type):
            model = build_model(cfg)
            trainer = setup_floor(model, cfg) if name == "floor" else setup_flatfsdp_variant(name, model, cfg, mesh)
            tokens = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long)
            trainer.step(tokens, tokens)
            with tracing() as trace:
                trainer.step(tokens, tokens)
    return trace


def trace_for_prediction(cfg: BenchConfig, name: str, run_type: str | None = None) -> tuple[StepTrace, str]:
    """``trace_run`` on the run's device (``run_type``, default: this rank's),
    else on the host's (a torch built without that device's kernels), and a
    note of which was used."""
    run_type = run_type or device().type
    if run_type == "cpu":
        return trace_run(cfg, name, "cpu"), ""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != run_type:
        # Not tried: autograd on a fake tensor of a device this torch cannot run aborts the process.
        why = f"no {run_type} device here"
    else:
        try:
            return trace_run(cfg, name, run_type), f"schedule traced on fake {run_type} tensors"
        except Exception as exc:  # noqa: BLE001 -- the host's ops are a worse trace, not none
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}" if str(exc) else type(exc).__name__
    return trace_run(cfg, name, "cpu"), (f"schedule traced on fake CPU tensors (on fake {run_type} tensors: {why}); "
                                         f"the CPU's ops priced as the {run_type}'s")


def mesh_of(cfg: BenchConfig, name: str) -> Mesh:
    world = cfg.nprocs * cfg.nodes
    if FLATFSDP_VARIANTS.get(name, {}).get("outer"):
        outer = cfg.nodes if cfg.nodes > 1 else 2
        return Mesh(cfg.nprocs, {"dp_outer": (outer, world // outer), "dp_shard": (world // outer, 1)})
    return Mesh(cfg.nprocs, {"world": (world, 1)})


def models_for(cfg: BenchConfig, name: str, machine: MachineProbe | None, device_name: str | None,
               engine_s: float = 0.0):
    """The compute model and fabric one run is predicted with (``engine_s``: ``engine_overhead``)."""
    mesh = mesh_of(cfg, name)
    if device_name is not None:
        fabric = Cluster(PRESETS["nvlink-h100"], PRESETS["ib-400"], mesh)
        return Throughput(DEVICES[device_name]), fabric
    world = 1 if name == "floor" and cfg.nodes == 1 and cfg.nprocs == 1 else cfg.nprocs * cfg.nodes
    alone = world == 1
    slowdown = 1.0 if alone else max(1.0, world / machine.ranks)
    compute = Measured(machine.alone if alone else machine.side_by_side, slowdown, source="probe of this machine",
                       engine_s=0.0 if name == "floor" else engine_s)
    rate, rate_busy = link_rates(cfg, machine) if name != "floor" else (None, None)
    fabric = Host(loopback(machine), machine.cpu_s_per_byte, mesh, shared_rate=rate if cfg.nodes == 1 else None,
                  node_rate=rate if cfg.nodes > 1 else None, link_rate_busy=rate_busy, slowdown=slowdown,
                  loopback_busy=loopback(machine, True), sum_s_per_byte=machine.sum_s_per_byte)
    return compute, fabric


def link_rates(cfg: BenchConfig, machine: MachineProbe) -> tuple[float | None, float | None]:
    """The run's throttled link (None: none), bytes/s while the ranks wait and
    while they compute: as probed (link_probe.py) where the probe has it, else
    its nominal rate."""
    if not cfg.link:
        return None, None
    probed = _probed_link(cfg, machine)
    if probed is None:
        return parse_rate(cfg.link), None
    return probed["waiting_bytes_s"], probed["computing_bytes_s"]


def _probed_link(cfg: BenchConfig, machine: MachineProbe) -> dict | None:
    """The probe of the run's link (link_probe.carried_rates), if the machine's probe has one."""
    return machine.links.get(link_key(cfg))


def link_note(cfg: BenchConfig, machine: MachineProbe | None) -> str:
    """How the prediction took the run's link, for the assumptions printed."""
    if not cfg.link or machine is None:
        return ""
    probed = _probed_link(cfg, machine)
    if probed is None:
        return f"the link ({link_key(cfg)}) at its nominal rate: not probed"
    return (f"the link ({link_key(cfg)}) as probed: {probed['waiting_bytes_s'] / 1e6:.0f} MB/s while the ranks "
            f"wait, {probed['computing_bytes_s'] / 1e6:.0f} while they compute, of "
            f"{probed['nominal_bytes_s'] / 1e6:.0f} nominal")


def predict_runs(cfg: BenchConfig, machine: MachineProbe | None, device_name: str | None = None
                 ) -> dict[str, dict]:
    """Each predictable contender's predicted step (``Prediction.to_json`` plus
    the assumptions), or why it was not predicted."""
    out = {}
    engine_s = engine_overhead(cfg, machine) if machine is not None else 0.0
    for name in cfg.contenders:
        if name not in PREDICTED or name == "flatfsdp-compiled":
            continue
        try:
            trace, traced_on = trace_for_prediction(cfg, name)
        except Exception as exc:  # noqa: BLE001 -- a schedule the fake world cannot run: say so, bench on
            out[name] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        compute, fabric = models_for(cfg, name, machine, device_name, engine_s)
        prediction: Prediction = replay(trace, compute, fabric)
        notes = [traced_on] + ([link_note(cfg, machine)] if name != "floor" and device_name is None else [])
        out[name] = dict(prediction.to_json(),
                         assumptions=[compute.describe(), fabric.describe()] + [n for n in notes if n])
    return out
