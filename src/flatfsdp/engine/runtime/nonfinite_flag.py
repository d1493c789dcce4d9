"""NaN/inf in a user's own training loop: noticed, named, without a host sync
on the hot path.

Note [the non-finite flag]
When a reduction lands in a param group's main grads, the root's watch takes
one sum of that shard (`note`): a device tensor, nothing read back. At the
next root forward's start -- the step boundary, where the host waits for the
previous step's reductions anyway -- the sums of the steps since are added
and read (`check`). On CPU that read costs nothing: the sum was computed
there already. On an accelerator the total is copied to the host without
blocking and looked at one step later, once its event says it landed, so
the host never waits for the device. A sum is NaN/inf exactly when an
element is (or when finite gradients overflow it: divergence too).

Only when the flag is up does the slow path run: each flagged group's main
grads (still held: the check runs before ``zero_grad()``'s memory is released)
or, once they are gone, its weights, are read per parameter to name the first
one that is not finite.

What happens then (``on_nonfinite``, per root: `set_on_nonfinite`, else the
``FLATFSDP_ON_NONFINITE`` environment variable, else "warn"):

* "warn": one `NonFiniteWarning` on each rank that sees it, naming the step
  and the parameter -- once per model, not once per step.
* "error": `NonFiniteError` on every rank, before the next forward runs. The
  ranks agree through one all-reduce of the flag per step over the default
  group (each rank sees only its own shard of the gradients); that is this
  mode's cost, and why it assumes every rank of the job trains this model.
* "off": no sums at all (``flatfsdp train`` has its own per-step check).

Steps are counted as backward passes since the model was sharded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from flatfsdp.engine.layout.switches import NONFINITE_ENV, NONFINITE_MODES

MODES = NONFINITE_MODES
MODE_ENV = NONFINITE_ENV
MAX_NAMES = 5
"""Parameters named in a report: the first few in model order say where it started."""


class NonFiniteWarning(UserWarning):
    """A step's gradients held NaN/inf (reported once per model)."""


@dataclass(frozen=True)
class NonFiniteReport:
    loss_ranks: tuple[int, ...]
    """Ranks whose loss was NaN/inf."""
    params: tuple[str, ...]
    """The first parameters (model order, at most MAX_NAMES) with a NaN/inf gradient on some rank."""
    param_count: int
    """How many parameters had one, in all."""

    def describe(self, step: int | None = None) -> str:
        parts = []
        if self.loss_ranks:
            parts.append(f"the loss is NaN/inf on rank(s) {', '.join(map(str, self.loss_ranks))}")
        if self.params:
            more = f" and {self.param_count - len(self.params)} more" if self.param_count > len(self.params) else ""
            parts.append(f"gradients are NaN/inf in {', '.join(repr(n) for n in self.params)}{more}")
        at = f"step {step}: " if step is not None else ""
        return at + ("; ".join(parts) or "a rank reported NaN/inf values")


class NonFiniteError(FloatingPointError):
    """The loss or the gradients of a step hold NaN or inf."""

    def __init__(self, report: NonFiniteReport, step: int | None = None):
        self.report, self.step = report, step
        super().__init__(report.describe(step))


def resolve_mode(chosen: str | None, default: str = "warn") -> str:
    """``chosen`` (``set_on_nonfinite``), else ``default`` (FLATFSDP_ON_NONFINITE,
    read once: layout/switches.py)."""
    mode = chosen if chosen is not None else default
    if mode not in MODES:
        source = "on_nonfinite" if chosen is not None else MODE_ENV
        raise ValueError(f"{source}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


class NonFiniteWatch:
    """One per root context: the sums of the gradients delivered since the last check."""

    def __init__(self):
        self.backwards = 0
        """Backward passes finished under this root (the step count in messages)."""
        self._sums: list[tuple[object, torch.Tensor]] = []
        self._pending: tuple | None = None
        """Accelerator: (host copy, event, step, groups) of a total still on its way."""
        self._warned = False
        self._checked = 0
        """``backwards`` at the last check."""

    def note(self, group, mode: str) -> None:
        """A reduction landed in ``group``'s main grads: keep its sum (no sync)."""
        main_grad = group.main_grads()
        if mode == "off" or main_grad is None or main_grad.numel() == 0 or is_fake(main_grad):
            return  # fake tensors (the estimator's dry run) have no values to check
        self._sums.append((group, main_grad.sum(dtype=torch.float32)))

    def check(self, mode: str, names, group) -> None:
        """The step boundary: report what the sums since the last check say.
        ``names()``: id(sharded parameter) -> its name in the model (asked
        only on the slow path); ``group``:
        the process group the ranks agree over in "error" mode."""
        sums, self._sums = self._sums, []
        stepped, self._checked = self.backwards != self._checked, self.backwards
        if mode == "off" or not stepped:
            # Forwards without a backward between them (evaluation, or a
            # forward on some ranks only) have nothing new to report, and in
            # "error" mode must not enter the agreement's collective.
            self._sums = sums
            if mode == "off":
                self._sums, self._pending = [], None
            return
        flagged = self._flagged_now(sums) if mode == "error" or not sums or sums[0][1].device.type == "cpu" \
            else self._flagged_later(sums)
        if flagged is None:
            return
        step, groups = flagged
        if mode == "error":
            self._raise_if_any_rank(groups, names, group, step)
        elif groups and not self._warned:
            self._warned = True
            report = _report(groups, names())
            warnings.warn(f"{report.describe(step)} (rank {dist.get_rank() if dist.is_initialized() else 0}; the "
                          "optimizer stepped with them: weights may now be NaN/inf; lower the learning rate, clip "
                          "gradients, or call flatfsdp.set_on_nonfinite(model, 'error') to stop at once)",
                          NonFiniteWarning, stacklevel=4)

    def _flagged_now(self, sums: list) -> tuple[int, list] | None:
        groups = _bad_groups(sums)
        return self.backwards, groups

    def _flagged_later(self, sums: list) -> tuple[int, list] | None:
        """Accelerator, "warn": look at the total started one step ago, if it
        has landed; start this step's copy. Never waits for the device."""
        ready = None
        if self._pending is not None and self._pending[1].query():
            host, _, step, groups = self._pending
            ready, self._pending = ((step, groups) if not bool(torch.isfinite(host)) else None), None
        if sums and self._pending is None:
            total = torch.stack([s for _, s in sums]).sum()
            host = torch.empty((), dtype=total.dtype, pin_memory=True)
            host.copy_(total, non_blocking=True)
            event = torch.Event(device=total.device)
            event.record()
            self._pending = (host, event, self.backwards, [g for g, _ in sums])
        if ready is None:
            return None
        step, candidates = ready
        return step, _bad_groups([(g, g.main_grads().sum(dtype=torch.float32)) for g in candidates
                                  if g.main_grads() is not None])

    def _raise_if_any_rank(self, groups: list, names: dict, group, step: int) -> None:
        flag = torch.tensor([1.0 if groups else 0.0])
        if dist.is_initialized() and dist.get_backend(group) != "gloo":
            flag = flag.to(torch.accelerator.current_accelerator())
        if dist.is_initialized():
            dist.all_reduce(flag, group=group)
        if float(flag.sum()) == 0:
            return
        known = names()
        local = _report(groups, known)
        everyone = [local]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, local, group=group)
        ordered = _in_model_order(dict.fromkeys(n for r in everyone for n in r.params), known)
        raise NonFiniteError(NonFiniteReport((), tuple(ordered[:MAX_NAMES]),
                                             max(len(ordered), max(r.param_count for r in everyone))), step)


def _bad_groups(sums: list) -> list:
    if not sums:
        return []
    finite = torch.isfinite(torch.stack([s for _, s in sums]).to("cpu"))  # the one read of the fast path
    if bool(finite.all()):
        return []
    return list(dict.fromkeys(g for (g, _), ok in zip(sums, finite.tolist()) if not ok))


def _report(groups: list, names: dict) -> NonFiniteReport:
    """Name the parameters of the flagged groups whose gradients (while still
    held) or else weights are not finite; a group whose values are gone is
    named by its first parameter."""
    found = []
    for group in groups:
        source = group.main_grads() if group.main_grads_held() else None
        hits = []
        for index, sharded in enumerate(group.sharded_params):
            if source is not None:
                values = group.main_view(source, index)
            else:
                values = sharded.to_local() if isinstance(sharded, DTensor) else sharded
            if values.numel() and not bool(torch.isfinite(values.detach()).all()):
                hits.append(names.get(id(sharded), f"#{index}"))
        found += hits or [names.get(id(group.sharded_params[0]), "#0")]
    found = _in_model_order(found, names)  # groups arrive in backward order
    return NonFiniteReport((), tuple(found[:MAX_NAMES]), len(found))


def _in_model_order(found, names: dict) -> list[str]:
    order = {name: i for i, name in enumerate(names.values())}
    return sorted(found, key=lambda name: order.get(name, len(order)))
