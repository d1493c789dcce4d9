"""Where in a step a contender's memory peaks, unit by unit: ``python -m
flatfsdp.bench.memory_phases --preset gpu --contenders fsdp2,flatfsdp``.

The bench gives one peak a run; when two contenders' peaks differ, this says
in which phase. Each contender trains the bench's model (its flags, one rank,
a fresh process) for two untimed steps, then one step in which every unit's
forward start and end, backward start and end and the optimizer step are
marks: at each mark, the bytes allocated and the most allocated since the
previous mark (on the CPU: the resident set and its high-water mark, reset
at each mark). The table puts the contenders side by side, phase by phase.

Backward's marks are tensor hooks on the unit's output (its gradient arrives:
the unit's backward starts) and input (its gradient is made: it ends), so no
module hook of the contender's own is wrapped or reordered.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from flatfsdp.bench.memory import _reset_high_water_mark, _status_kib
from flatfsdp.bench.options import PROG, parse
from flatfsdp.bench.workload import build_model, device, make_batches, unit_modules
from flatfsdp.cli.flags import parse_or_exit


class PhaseMeter:
    """Marks through one step: ``marks`` holds (label, allocated, peak since the last mark)."""

    def __init__(self, dev: torch.device):
        self.on_cpu = dev.type == "cpu"
        self.marks: list[tuple[str, int, int]] = []
        self._restart()

    def _allocated(self) -> int:
        if self.on_cpu:
            return _status_kib("VmRSS") * 1024
        torch.accelerator.synchronize()
        return torch.accelerator.memory_allocated()

    def _peak(self) -> int:
        return _status_kib("VmHWM") * 1024 if self.on_cpu else torch.accelerator.max_memory_allocated()

    def _restart(self) -> None:
        if self.on_cpu:
            _reset_high_water_mark()
        else:
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()

    def mark(self, label: str) -> None:
        allocated = self._allocated()
        self.marks.append((label, allocated, max(self._peak(), allocated)))
        self._restart()


def _tensor_of(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_tensor_of, value) if t is not None), None)
    return None


def _watch_unit(unit: torch.nn.Module, name: str, meter: PhaseMeter) -> list:
    def before(module, args):
        meter.mark(f"{name} forward start")
        x = _tensor_of(args)
        if x is not None and x.requires_grad:
            x.register_hook(lambda grad: meter.mark(f"{name} backward end"))

    def after(module, args, out):
        meter.mark(f"{name} forward end")
        y = _tensor_of(out)
        if y is not None and y.requires_grad:
            y.register_hook(lambda grad: meter.mark(f"{name} backward start"))

    return [unit.register_forward_pre_hook(before), unit.register_forward_hook(after)]


def measure(cfg, name: str) -> list[tuple[str, int, int]]:
    """One rank's marks through a step of contender ``name`` (after two untimed steps)."""
    from flatfsdp.bench.contenders import REGISTRY

    dev = device()
    meter = PhaseMeter(dev)
    start = meter._allocated()
    with torch.device(dev):
        model = build_model(cfg)
    units = [u for u in unit_modules(model) if isinstance(u, torch.nn.Module)]
    trainer = REGISTRY[name].setup(model, cfg)
    batches = make_batches(replace(cfg, warmup=3, steps=0), 0, 1, dev)
    for x, y in batches[:2]:
        trainer.step(x, y)
    handles = [h for i, unit in enumerate(units) for h in _watch_unit(unit, f"unit {i}", meter)]
    meter.mark("step start")
    x, y = batches[2]
    trainer.step(x, y)
    meter.mark("step end (after the optimizer)")
    for h in handles:
        h.remove()
    return [(label, allocated - start, peak - start) for label, allocated, peak in meter.marks]


def table(results: dict[str, list]) -> str:
    names = list(results)
    labels = [label for label, _, _ in results[names[0]]]
    lines = ["| phase ending at | " + " | ".join(f"{n} peak MB (held MB)" for n in names)
             + (f" | {names[-1]} - {names[0]} peak MB |" if len(names) > 1 else " |"),
             "|---|" + "---|" * (len(names) + (len(names) > 1))]
    for i, label in enumerate(labels):
        rows = [results[n][i] if i < len(results[n]) and results[n][i][0] == label else None for n in names]
        cells = [f"{r[2] / 1e6:,.0f} ({r[1] / 1e6:,.0f})" if r else "--" for r in rows]
        diff = (f" | {(rows[-1][2] - rows[0][2]) / 1e6:+,.0f}" if len(names) > 1 and rows[0] and rows[-1] else
                (" | --" if len(names) > 1 else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + diff + " |")
    for n in names:
        top = max(results[n], key=lambda r: r[2])
        lines.append(f"\n{n}: peak {top[2] / 1e6:,.0f} MB in the phase ending at '{top[0]}'")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    from flatfsdp.launch import launch

    cfg, _ = parse_or_exit(parse, argv, PROG)
    cfg = replace(cfg, nprocs=1)
    results = {name: launch(measure, 1, cfg, name, threads_per_rank=cfg.threads_per_rank) for name in cfg.contenders}
    out = table(results)
    print(out, flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
