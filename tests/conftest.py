import os
import sys

import pytest
import torch

# Spawned ranks import workers by module name from this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a CUDA device is (docs/gpu.md)."""
    if torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tools/gpu_check.sh runs these where one is lent)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
