"""From run records to medians, ratios and the markdown tables.

Step time of a run: the median of its timed steps (each the slowest rank's).
Across runs: the median of the run medians, with their min-max range. Peak
memory of a run: the largest rank's; across runs likewise. Byte volumes are
deterministic: the last run's.
"""

from __future__ import annotations

import statistics

from flatfsdp.bench.contenders import REGISTRY
from flatfsdp.bench.flops import step_flops
from flatfsdp.bench.options import BenchConfig
from flatfsdp.bench.theory import min_comm_bytes, min_state_bytes
from flatfsdp.bench.wire import parse_rate, wire_figures

MB = 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _label(name: str, cfg: BenchConfig) -> str:
    label = REGISTRY[name].label
    return f"{label} ({cfg.strategy})" if name == "flatfsdp" and cfg.strategy != "optim_grads_params" else label


def _comm(last: dict, cfg: BenchConfig) -> dict:
    """Measured bytes per kind (engine account preferred), the minimum, and their ratio."""
    measured = last["engine_bytes"] if last["engine_bytes"] is not None else last["torch_bytes"]
    source = REGISTRY[last["contender"]].bytes_source if measured is not None else "not counted (--warmup 0)"
    weight_bytes, grad_bytes = cfg.compute_dtype.itemsize, cfg.reduce_dtype.itemsize
    # One rank has nobody to talk to: its minimum is nothing, whatever the strategy.
    stage = last["stage"] if last["world"] > 1 else None
    minimum = min_comm_bytes(stage, last["n_params"], weight_bytes, grad_bytes)
    measured = dict(measured or {})
    total = sum(v["bytes"] for v in measured.values())
    ratio = total / sum(minimum.values()) if minimum and measured else None
    return dict(source=source, measured=measured, torch_layer=last["torch_bytes"], minimum=minimum,
                total_bytes=total, min_total_bytes=sum(minimum.values()), ratio_to_min=ratio)


def summarise_contender(name: str, runs: list[dict], cfg: BenchConfig) -> dict:
    medians = [statistics.median(r["step_times"]) for r in runs]
    peaks = [max(r["peak_bytes"]) for r in runs]
    last = runs[-1]
    step_s = statistics.median(medians)
    flops = step_flops(last["n_params"], cfg.layers, cfg.d_model, cfg.seq_len, cfg.batch * cfg.seq_len)
    return dict(
        name=name, label=_label(name, cfg), runs=len(runs), step_s=step_s, step_s_range=[min(medians), max(medians)],
        tokens_per_s=cfg.batch * cfg.seq_len * last["world"] / step_s,
        step_flops=flops, tflops_per_rank=flops / step_s / 1e12,
        peak_mb=statistics.median(peaks) / MB, peak_mb_range=[min(peaks) / MB, max(peaks) / MB],
        peak_mb_per_rank=[p / MB for p in last["peak_bytes"]],
        state_mb_theory=min_state_bytes(last["stage"], last["n_params"], last["world"], cfg.bf16) / MB,
        first_loss=last["losses"][0], last_loss=last["losses"][-1], losses=last["losses"],
        comm=_comm(last, cfg), memory_method=last["memory_method"], n_params=last["n_params"],
        link=last.get("link"),
        exposed_s=_median_exposed(runs), exposed_by_kind=(last.get("exposed") or {}),
        host_cpu_s=_median_host_cpu(runs), link_timeline=_median_run(runs, medians).get("link_timeline"),
        **_no_link(runs),
    )


def _median_run(runs: list[dict], medians: list[float]) -> dict:
    """The run whose median step is the median of the runs' (the lower one of an even count)."""
    order = sorted(range(len(runs)), key=lambda i: medians[i])
    return runs[order[(len(order) - 1) // 2]]


def _no_link(runs: list[dict]) -> dict:
    """``--link-penalty``: the same contender's runs without the link, and the penalty."""
    plain = [r["no_link"] for r in runs if r.get("no_link")]
    if not plain:
        return {}
    medians = [statistics.median(r["step_times"]) for r in plain]
    step_s = statistics.median(statistics.median(r["step_times"]) for r in runs)
    no_link = statistics.median(medians)
    return dict(no_link_step_s=no_link, no_link_range=[min(medians), max(medians)], link_penalty=step_s / no_link,
                no_link_exposed_s=_median_exposed(plain))


def _median_host_cpu(runs: list[dict]) -> list[float] | None:
    """[main thread, other threads] CPU seconds of a step (host_cpu.py): the mean
    over ranks, the median over runs; None where a run did not measure it."""
    per_run = [r.get("host_cpu_s") for r in runs]
    if not per_run or any(p is None for p in per_run):
        return None
    means = [[statistics.mean(rank[i] for rank in ranks) for i in range(2)] for ranks in per_run]
    return [statistics.median(m[i] for m in means) for i in range(2)]


def _median_exposed(runs: list[dict]) -> float | None:
    totals = [r["exposed"]["total"] for r in runs if r.get("exposed")]
    return statistics.median(totals) if totals else None


def _add_ratios(rows: dict[str, dict]) -> None:
    for base in ("fsdp2", "floor"):
        ref = rows.get(base)
        for row in rows.values():
            row[f"time_vs_{base}"] = row["step_s"] / ref["step_s"] if ref else None
            row[f"mem_vs_{base}"] = row["peak_mb"] / ref["peak_mb"] if ref and ref["peak_mb"] > 0 else None
    floor = rows.get("floor")
    for row in rows.values():
        # The part of a step the wrapper adds to the same unsharded work: (t - floor) / t.
        row["share_over_floor"] = 1 - floor["step_s"] / row["step_s"] if floor else None


def _check_losses(rows: dict[str, dict], tol: float) -> str | None:
    """Mark rows whose loss disagrees with the reference; return the reference's name.

    Data-parallel contenders are compared on the last loss; the floor's
    replicas only share the first step with them (see ``floor``).
    """
    parallel = [n for n in rows if n != "floor"]
    ref = "fsdp2" if "fsdp2" in rows else (parallel[0] if parallel else None)
    for name, row in rows.items():
        if ref is None or name == ref:
            row["loss_ok"] = None if ref is None else True
            continue
        key = "first_loss" if name == "floor" else "last_loss"
        row["loss_diff"] = abs(row[key] - rows[ref][key])
        row["loss_ok"] = row["loss_diff"] <= tol
    return ref


def summarise(cfg: BenchConfig, runs: list[dict], notes: dict[str, str]) -> dict:
    rows = {}
    for name in cfg.contenders:
        mine = [r for r in runs if r["contender"] == name]
        if mine:
            rows[name] = summarise_contender(name, mine, cfg)
    _add_ratios(rows)
    if cfg.link:  # bytes per step are deterministic: the last run's, against the median step
        floor_s = rows["floor"]["step_s"] if "floor" in rows else None
        for row in rows.values():
            row["wire"] = wire_figures(row["step_s"], row["link"], parse_rate(cfg.link), floor_s,
                                       row.get("no_link_step_s"))
    ref = _check_losses(rows, cfg.tolerance)
    return dict(rows=rows, notes=notes, loss_reference=ref, loss_tolerance=cfg.tolerance)
