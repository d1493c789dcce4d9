"""The FSDP2 surface of the installed torch, held against flatfsdp's (issue 28).

A newer torch that adds a public ``FSDPModule`` method, a ``fully_shard``
keyword or a ``MixedPrecisionPolicy`` field fails here, naming the torch
version and what flatfsdp does not handle yet -- instead of the call falling
through to torch's implementation (which reads FSDP2's private state) or the
option being silently dropped. Handle it (or refuse it with a named error),
then list it in docs/torch_versions.md."""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed.fsdp as torch_fsdp

import flatfsdp


def test_every_public_fsdp_module_method_is_flatfsdps_own():
    own = set(vars(flatfsdp.FSDPModule))
    missing = [n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_") and n not in own]
    assert not missing, (f"torch {torch.__version__}'s FSDPModule has public methods flatfsdp does not implement: "
                         f"{missing}")


def test_every_fully_shard_keyword_is_accepted():
    theirs = set(inspect.signature(torch_fsdp.fully_shard).parameters)
    ours = set(inspect.signature(flatfsdp.fully_shard).parameters)
    missing = sorted(theirs - ours)
    assert not missing, f"torch {torch.__version__}'s fully_shard takes keywords flatfsdp's does not: {missing}"


def test_every_mixed_precision_field_is_read():
    theirs = {f.name for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)}
    ours = {f.name for f in dataclasses.fields(flatfsdp.MixedPrecisionPolicy)}
    missing = sorted(theirs - ours)
    assert not missing, (f"torch {torch.__version__}'s MixedPrecisionPolicy has fields flatfsdp's does not read: "
                         f"{missing}")


def test_the_handle_types_torch_names_are_flatfsdps():
    """torch's pipeline schedules type-check the handles they wait on."""
    for name in ("UnshardHandle", "GradientReductionHandle"):
        if hasattr(torch_fsdp, name):
            assert hasattr(flatfsdp, name), f"torch {torch.__version__} has {name}; flatfsdp exports none"
    if hasattr(torch_fsdp, "GradientReductionHandle"):
        assert issubclass(flatfsdp.GradientReductionHandle, torch_fsdp.GradientReductionHandle)


def test_collectives_renamed_in_2_13_are_called_only_through_torch_collectives():
    """torch 2.13 added all_gather_single / reduce_scatter_single; 2.11 and 2.12
    have only the older names. engine/comm/torch_collectives.py picks whichever
    exists, so a direct ``dist.<new name>`` anywhere else breaks the older
    torches (the schedule check did, on 2.11)."""
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "flatfsdp"
    direct = re.compile(r"\bdist(?:ributed)?\.(all_gather_single|reduce_scatter_single)\b")
    offenders = [f"{path.relative_to(src)}:{number}" for path in sorted(src.rglob("*.py"))
                 if path.name != "torch_collectives.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if direct.search(line)]
    assert offenders == []
