"""Which checkpoint tensor fills which model tensor.

A model tensor may have several names (tied weights: ``lm_head.weight`` is
``model.embed_tokens.weight``); any one of them in the checkpoint fills it --
Hugging Face saves a tied weight once. Names may also differ by a prefix: a
checkpoint of the base model (``layers.0...``) loaded into a model with a
head (``model.layers.0...``), or a model wrapped in a module of the user's.
One rewrite -- strip a prefix from model names, then add one -- is chosen for
the whole model: the one that matches the most names, the identity on a tie.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

Rewrite = tuple[str, str]
"""(prefix stripped from model names, prefix added): checkpoint name = add + name[len(strip):]."""

PEFT_WRAPPED = ".base_layer."
"""Where PEFT keeps the original layer inside the adapter layer that replaced it."""
_SHOWN = 8
"""Names listed per kind of problem in an error message."""


@dataclass
class Target:
    names: list[str]
    """Every name of the tensor in the model (several when tied)."""
    tensor: torch.Tensor
    """The parameter (a DTensor when sharded) or persistent buffer."""


@dataclass
class Plan:
    sources: list[tuple[Target, str]] = field(default_factory=list)
    """(model tensor, checkpoint name filling it)."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    rewrite: Rewrite = ("", "")

    def problems(self, strict: bool) -> str | None:
        parts = []
        for title, names in (("missing from the checkpoint", self.missing), ("shape differs", self.mismatched),
                             ("not in the model", self.unexpected if strict else [])):
            if names:
                shown = ", ".join(names[:_SHOWN]) + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
                parts.append(f"{len(names)} {title}: {shown}")
        return "; ".join(parts) or None


def model_targets(model: nn.Module) -> tuple[list[Target], list[str]]:
    """Parameters and persistent buffers (each once, with all its names), and
    the names of buffers still on the meta device that no checkpoint can fill."""
    by_id: dict[int, Target] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names = by_id.setdefault(id(param), Target([], param)).names
        names.append(name)
        if PEFT_WRAPPED in name:  # a layer PEFT wrapped: the unwrapped model's checkpoint names it plainly
            names.append(name.replace(PEFT_WRAPPED, "."))
    unfillable = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, buf in module._buffers.items():
            if buf is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            if attr in module._non_persistent_buffers_set:
                if buf.is_meta:
                    unfillable.append(name)
                continue
            by_id.setdefault(id(buf), Target([], buf)).names.append(name)
    return list(by_id.values()), sorted(set(unfillable))


def _apply(rewrite: Rewrite, name: str) -> str | None:
    strip, add = rewrite
    return add + name[len(strip):] if name.startswith(strip) else None


def _dotted_prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) + "." for i in range(1, len(parts))]


def choose_rewrite(model_names: list[str], checkpoint_names) -> Rewrite:
    """The prefix rewrite under which the most model names are in the checkpoint."""
    ckpt, mine = set(checkpoint_names), set(model_names)
    votes: Counter = Counter()
    for name in mine:  # model names longer by a prefix
        votes.update((p, "") for p in _dotted_prefixes(name) if name[len(p):] in ckpt)
    for name in ckpt:  # checkpoint names longer by a prefix
        votes.update(("", p) for p in _dotted_prefixes(name) if name[len(p):] in mine)

    def score(rewrite: Rewrite) -> int:
        return sum(_apply(rewrite, n) in ckpt for n in mine)

    best, best_score = ("", ""), score(("", ""))
    for rewrite, _ in votes.most_common(4):
        if (s := score(rewrite)) > best_score:
            best, best_score = rewrite, s
    return best


def plan(targets: list[Target], shapes: dict[str, tuple[int, ...]]) -> Plan:
    """Match every target to a checkpoint tensor (``shapes``: name -> shape)."""
    rewrite = choose_rewrite([n for t in targets for n in t.names], shapes)
    out, used = Plan(rewrite=rewrite), set()
    for target in targets:
        found = [c for c in (_apply(rewrite, n) for n in target.names) if c in shapes]
        used.update(found)
        if not found:
            out.missing.append(target.names[0])
        elif tuple(shapes[found[0]]) != tuple(target.tensor.shape):
            out.mismatched.append(f"{found[0]} is {tuple(shapes[found[0]])} there, "
                                  f"{tuple(target.tensor.shape)} here")
        else:
            out.sources.append((target, found[0]))
    out.unexpected = sorted(set(shapes) - used)
    return out
