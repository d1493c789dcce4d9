"""The device checks (tests/device_checks.py) on CUDA under pytest: ``pytest -m cuda``.

Skipped where there is no CUDA device (conftest.py). tools/gpu_check.sh runs
the same checks one process each (tests/run_device_checks.py), so a crash in
one cannot take the others with it; figures go into the JUnit XML here
(``record_property``).
"""

from __future__ import annotations

import pytest
import torch

from device_checks import CHECKS
from device_world import Unavailable


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CHECKS))
def test_device_check_on_cuda(name, tmp_path, record_property):
    device = torch.device("cuda", torch.accelerator.current_device_index())
    try:
        figures = CHECKS[name].run(device, tmp_path)
    except Unavailable as why:
        pytest.skip(str(why))
    for key, value in figures.items():
        record_property(key, value)
