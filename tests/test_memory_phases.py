"""bench/memory_phases.py: where in a step each contender's memory peaks,
unit by unit (how the H200's 116 MB above FSDP2 was traced: docs/gpu.md)."""

from __future__ import annotations

from flatfsdp.bench.memory_phases import main

TINY = ["--preset", "gpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "256", "--seq-length", "64", "--micro-batch-size", "1", "--threads-per-rank", "1"]


def test_every_unit_phase_is_marked_in_step_order_for_each_contender():
    table = main(TINY + ["--contenders", "fsdp2,flatfsdp"])
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "phase" not in line]
    assert rows == ["step start", "unit 0 forward start", "unit 0 forward end", "unit 1 forward start",
                    "unit 1 forward end", "unit 1 backward start", "unit 1 backward end", "unit 0 backward start",
                    "unit 0 backward end", "step end (after the optimizer)"]
    for line in table.splitlines()[2:len(rows) + 2]:
        cells = [c.strip() for c in line.split("|")[2:-1]]
        assert all(c != "--" for c in cells), line  # both contenders marked the same phases
    assert "fsdp2: peak" in table and "flatfsdp: peak" in table
