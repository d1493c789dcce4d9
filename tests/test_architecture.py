"""The layers of docs/architecture.md, enforced on the source: the engine imports
nothing from the applications around it, each engine module only imports
modules of its own layer or below, the pure layout layer knows no torch, and
applications reach the engine through the public ``flatfsdp`` API only.

Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "flatfsdp"
ENGINE = SRC / "engine"

# Bottom-up; keep in step with docs/architecture.md.
LAYERS = {
    "layout": 0, "strategy": 0, "training_state": 0, "comm_account": 0, "unit_controls": 0,
    "device": 1, "precision": 1, "buffer": 1, "views": 1, "mesh": 1, "host_memory": 1, "placement": 1,
    "structures": 1, "watchdog": 1, "fsdp2_args": 1, "offload": 1,
    "exchange": 2, "collectives": 2, "fingerprint": 2,
    "gather": 3, "coalesce": 3, "reduction_queue": 3, "outer_shard": 3,
    "param_group": 4,
    "root_context": 5, "unit_state": 5, "fsdp_module": 5, "meta_init": 5, "tied_params": 5, "state_dict": 5,
    "unit_classes": 5, "stale_optimizers": 5, "conversion": 5,
    "replaced_params": 5,
    "shard_unit": 6, "optimizer": 6, "memory": 6, "finite_check": 6,
    "api": 7, "__init__": 8,
}


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (absolute names), at any depth of the file."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # "from a.b import c": a.b.c names the submodule c, or a symbol of a.b.
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _engine_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] == ["flatfsdp", "engine"]:
        return parts[2] if len(parts) > 2 else "__init__"
    return None


def test_every_engine_module_has_a_layer():
    modules = {p.stem for p in ENGINE.glob("*.py")}
    assert modules == set(LAYERS), f"place these in LAYERS and docs/architecture.md: {sorted(modules ^ set(LAYERS))}"


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_engine_imports_only_its_own_layer_or_below(module):
    for name in _imports(ENGINE / f"{module}.py"):
        if name == "flatfsdp" or (name.startswith("flatfsdp.") and _engine_module(name) is None):
            pytest.fail(f"engine module {module} imports {name}: the engine must not depend on the applications")
        target = _engine_module(name)
        if target is None or target not in LAYERS:  # torch, stdlib, or a symbol imported from engine/__init__
            continue
        assert LAYERS[target] <= LAYERS[module], f"{module} (layer {LAYERS[module]}) imports {target} " \
                                                 f"(layer {LAYERS[target]}): a lower layer cannot see a higher one"


def test_the_layout_layer_is_pure_arithmetic():
    for name in _imports(ENGINE / "layout.py"):
        assert name.split(".")[0] in {"__future__", "math", "dataclasses"}, name


APPLICATIONS = sorted(p for p in SRC.rglob("*.py") if ENGINE not in p.parents and p != SRC / "__init__.py")


@pytest.mark.parametrize("path", APPLICATIONS, ids=lambda p: str(p.relative_to(SRC)))
def test_applications_use_the_public_api_only(path):
    for name in _imports(path):
        assert _engine_module(name) is None, f"{path.relative_to(SRC)} imports {name}: use `flatfsdp` (the public API)"
