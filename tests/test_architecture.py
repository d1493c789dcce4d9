"""The layers of docs/architecture.md, enforced on the source.

The engine is five sub-packages stacked bottom-up (layout, comm, groups,
runtime, front); a module imports only its own package or packages below, and
inside the engine only modules of its own layer or below. The engine imports
no application; applications reach the engine through ``flatfsdp`` or
``flatfsdp.engine`` only. No two files of ``src/flatfsdp`` import each other
round a circle, no file grows past 400 lines, and an instance's class is
swapped in one place (runtime/class_swap).

Every import counts: those inside functions and under ``TYPE_CHECKING`` too.
Each rule is a function over a source tree, so the tests can also plant a
violation in a copy of the tree and see it caught.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "flatfsdp"

# Bottom-up; keep in step with docs/architecture.md.
PACKAGES = {"layout": 1, "comm": 2, "groups": 3, "runtime": 4, "front": 5}
LAYERS = {
    "layout.arithmetic": 0, "layout.strategy": 0, "layout.block_formats": 0, "layout.switches": 0,
    "layout.device": 1, "layout.local_dtensor": 0, "layout.precision": 1, "layout.buffer": 1, "layout.views": 1, "layout.mesh": 1,
    "layout.placement": 1, "layout.main_home": 2, "layout.options": 2,
    "comm.comm_account": 0, "comm.schedule_log": 0, "comm.torch_collectives": 0, "comm.watchdog": 1,
    "comm.exchange": 2, "comm.collectives": 2, "comm.fingerprint": 2, "comm.schedule_check": 2,
    "comm.wire": 3, "comm.gather": 3, "comm.cast_gather": 3, "comm.outer_shard": 3,
    "comm.coalesce": 4, "comm.lookup_rows": 4, "comm.paced_gather": 4, "comm.block_gather": 4, "comm.block_reduce": 4, "comm.user_comms": 4,
    "comm.reduction_queue": 5,
    "groups.slots": 4, "groups.subclass_gather": 4, "groups.wire_choice": 5, "groups.group_tensors": 4,
    "groups.replicas": 5, "groups.group_core": 5,
    "groups.buffers": 6, "groups.gradients": 7, "groups.subclass_buffers": 7,
    "groups.param_group": 8, "groups.subclass_group": 8,
    "runtime.training_state": 0, "runtime.unit_controls": 0, "runtime.structures": 1, "runtime.unit_hooks": 2, "runtime.host_memory": 1,
    "runtime.nonfinite_flag": 1, "runtime.class_swap": 0, "runtime.deferred_init": 1, "runtime.gather_units": 5,
    "runtime.root_context": 9, "runtime.unit_state": 9, "runtime.fsdp_module": 9, "runtime.meta_init": 9,
    "runtime.tied_params": 9, "runtime.state_dict": 9, "runtime.stale_optimizers": 9, "runtime.conversion": 9,
    "runtime.replaced_params": 9, "runtime.torch_fsdp2_view": 9,
    "front.fsdp2_args": 10, "front.unit_classes": 10, "front.tied_units": 10, "front.shard_unit": 10, "front.optimizer": 10,
    "front.memory": 10, "front.finite_check": 10, "front.spmd_mesh": 10, "front.subclass_check": 10,
    "front.optimizer_state": 10, "front.keyword_table": 10, "front.keywords": 10, "front.megatron_buffers": 10,
    "front.megatron_model": 10, "front.megatron_optimizer": 10, "front.optimizer_load_check": 10,
    "front.hand_driven": 10,
    "front.api": 11,
    "__init__": 12,
}
MAX_LINES = 400
# flatfsdp/__init__ re-exports the engine's API and, as the one documented
# exception, load_pretrained: an application built on that API, offered at the
# top level because users look for it there. Nothing in flatfsdp.pretrained
# imports flatfsdp itself, so the exception closes no circle.
PACKAGE_INIT_MAY_IMPORT = {"flatfsdp.engine", "flatfsdp.pretrained"}


# --- reading a tree ---------------------------------------------------------

def modules_of(root: Path) -> dict[str, Path]:
    """Dotted name (``flatfsdp.engine.comm.gather``; a package by its own name) -> file."""
    found = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # "from a.b import c" imports the submodule a.b.c if there is one, else a symbol of a.b.
            candidates = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                names.add(name)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules_of(root)
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _engine_name(module: str) -> str | None:
    """``flatfsdp.engine.comm.gather`` -> ``comm.gather``; the engine package -> ``__init__``."""
    if module == "flatfsdp.engine":
        return "__init__"
    return module.removeprefix("flatfsdp.engine.") if module.startswith("flatfsdp.engine.") else None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up a layer, into an application, or past the public API."""
    found = []
    for module, targets in sorted(graph.items()):
        source = _engine_name(module)
        for target in sorted(targets):
            dest = _engine_name(target)
            if source is None:
                if module != "flatfsdp" and dest is not None and dest != "__init__":
                    found.append(f"{module} imports {target}: applications use `flatfsdp` or "
                                 f"`flatfsdp.engine` (the public API)")
                continue
            if dest is None:
                found.append(f"engine module {module} imports {target}: the engine must not depend on the "
                             f"applications")
                continue
            src_pkg, dst_pkg = source.split(".")[0], dest.split(".")[0]
            if src_pkg in PACKAGES and dst_pkg in PACKAGES and PACKAGES[dst_pkg] > PACKAGES[src_pkg]:
                found.append(f"{module} (package {src_pkg}) imports {target} (package {dst_pkg}): "
                             f"a lower package cannot see a higher one")
            elif source in LAYERS and dest in LAYERS and LAYERS[dest] > LAYERS[source]:
                found.append(f"{module} (layer {LAYERS[source]}) imports {target} (layer {LAYERS[dest]}): "
                             f"a lower layer cannot see a higher one")
    return found


def package_init_imports(root: Path) -> set[str]:
    return import_graph(root)[root.name]


def oversized_files(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}: {n} lines" for path in sorted(root.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES]


# --- the rules on the real tree ---------------------------------------------

def test_every_engine_module_has_a_layer():
    engine = {_engine_name(m) for m in modules_of(SRC) if _engine_name(m) is not None}
    modules = {m for m in engine if "." in m or m == "__init__"}
    assert modules == set(LAYERS), f"place these in LAYERS and docs/architecture.md: {sorted(modules ^ set(LAYERS))}"
    assert engine - modules == set(PACKAGES), "every engine sub-package has a place in PACKAGES"


def test_docs_architecture_lists_every_module_the_test_knows():
    """docs/architecture.md draws the layers; a module missing there is a module nobody was told about."""
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    missing = [m for m in LAYERS if m != "__init__" and f"{m.split('.')[0]}/{m.split('.')[1]}" not in doc]
    assert missing == [], f"describe these in docs/architecture.md: {missing}"


def test_module_layers_agree_with_package_order():
    """A module's layer never puts it below a package it sits above, or the other way round."""
    by_package = {}
    for module, layer in LAYERS.items():
        if "." in module:
            by_package.setdefault(module.split(".")[0], []).append(layer)
    ordered = sorted(by_package, key=PACKAGES.get)
    for lower, upper in zip(ordered, ordered[1:]):
        assert max(by_package[lower]) <= max(by_package[upper]), (lower, upper)


def test_no_import_circle_anywhere_in_flatfsdp():
    assert circles(import_graph(SRC)) == []


def test_every_import_respects_the_layers():
    assert layering_violations(import_graph(SRC)) == []


def test_the_package_init_imports_the_api_and_the_one_documented_exception():
    assert package_init_imports(SRC) == PACKAGE_INIT_MAY_IMPORT


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_sub_package_opens_with_what_lives_there_and_what_it_may_import(package):
    init = SRC / "engine" / package / "__init__.py"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree)
    assert doc and "May import" in doc, f"{init}: say what lives here and what it may import"
    assert len(tree.body) == 1, f"{init}: a sub-package's __init__ is its description only (re-exports hide layers)"


def test_no_source_file_is_over_the_line_limit():
    assert oversized_files(SRC) == []


def test_the_layout_arithmetic_is_pure():
    path = SRC / "engine" / "layout" / "arithmetic.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(n.split(".")[0] in {"__future__", "math", "dataclasses"} for n in names), names


def test_public_names_still_import():
    import flatfsdp
    import flatfsdp.bench.__main__  # noqa: F401  (python -m flatfsdp.bench)
    from flatfsdp.cli import main  # noqa: F401  (the flatfsdp command)

    missing = [name for name in flatfsdp.__all__ if not hasattr(flatfsdp, name)]
    assert missing == []
    assert {"fully_shard", "FSDPModule", "load_pretrained"} <= set(flatfsdp.__all__)


# --- the rules catch what they are for --------------------------------------

@pytest.fixture
def tree_copy(tmp_path):
    root = tmp_path / "flatfsdp"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _plant(root: Path, relative: str, line: str) -> None:
    path = root / relative
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_a_planted_circle_is_found(tree_copy):
    assert circles(import_graph(tree_copy)) == []
    _plant(tree_copy, "engine/runtime/root_context.py", "from flatfsdp.engine.runtime.unit_state import UnitState")
    assert circles(import_graph(tree_copy)) == [["flatfsdp.engine.runtime.root_context",
                                                  "flatfsdp.engine.runtime.unit_state"]]


@pytest.mark.parametrize("relative, line, expected", [
    ("engine/layout/views.py", "from flatfsdp.engine.comm.collectives import all_gather_into",
     "(package layout) imports flatfsdp.engine.comm.collectives (package comm)"),
    ("engine/groups/slots.py", "import flatfsdp.engine.runtime.unit_state",
     "(package groups) imports flatfsdp.engine.runtime.unit_state (package runtime)"),
    ("engine/comm/comm_account.py", "from flatfsdp.engine.comm.gather import GatherPlan",
     "(layer 0) imports flatfsdp.engine.comm.gather (layer 3)"),
    ("engine/runtime/state_dict.py", "from flatfsdp.checkpoint import save",
     "the engine must not depend on the applications"),
    ("bench/__main__.py", "from flatfsdp.engine.groups.param_group import ParamGroup",
     "applications use `flatfsdp` or `flatfsdp.engine`"),
])
def test_a_planted_upward_import_is_found(tree_copy, relative, line, expected):
    assert layering_violations(import_graph(tree_copy)) == []
    _plant(tree_copy, relative, line)
    found = layering_violations(import_graph(tree_copy))
    assert len(found) == 1 and expected in found[0], found


def test_a_planted_application_import_in_the_package_init_is_found(tree_copy):
    _plant(tree_copy, "__init__.py", "from flatfsdp.train import run")
    assert package_init_imports(tree_copy) - PACKAGE_INIT_MAY_IMPORT == {"flatfsdp.train"}


def test_a_planted_long_file_is_found(tree_copy):
    _plant(tree_copy, "engine/layout/strategy.py", "pass\n" * MAX_LINES)
    assert [entry.split(":")[0] for entry in oversized_files(tree_copy)] == ["engine/layout/strategy.py"]


def class_swap_sites(root: Path) -> list[str]:
    """Files that assign an instance's ``__class__`` (a class swap)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets):
                found.append(str(path.relative_to(root)))
                break
    return found


def test_classes_are_swapped_in_one_place():
    """A sharded unit, the one-call root and a bound optimizer all get their
    subclass from runtime/class_swap (one cache of made classes)."""
    assert class_swap_sites(SRC) == ["engine/runtime/class_swap.py"]


def test_a_planted_class_swap_is_found(tree_copy):
    _plant(tree_copy, "engine/front/megatron_optimizer.py", "object().__class__ = object")
    assert class_swap_sites(tree_copy) == ["engine/front/megatron_optimizer.py", "engine/runtime/class_swap.py"]
