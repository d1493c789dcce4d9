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
