"""``--link-timeline``: when the link carried bytes during a step and when it
sat idle. The arithmetic on made-up counters (exact), the sampler on this
host's own loopback (bytes sent through a socket are counted), and, as root,
a bench run behind a 2 Gbit/s namespace whose timeline accounts for the
bytes its interface counted."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from flatfsdp.bench.link_activity import Counter, StepMarks, activity, split_steps, step_activity
from flatfsdp.bench.link_sampler import LinkSampler
from flatfsdp.bench.netsim import missing_for_link
from flatfsdp.bench.options import parse
from flatfsdp.cli.flags import UsageError

RATE = 1000.0  # bytes per second: one byte a millisecond at full rate


def _counter(busy, ms: int = 100) -> Counter:
    """Samples every millisecond; ``busy(t_ms)`` is the share of RATE carried in millisecond t."""
    sent, total = [0], 0.0
    for t in range(ms):
        total += busy(t) * RATE / 1000
        sent.append(round(total * 1000))  # counted in milli-bytes, so shares stay exact integers
    return Counter(tuple(t / 1000 for t in range(ms + 1)), tuple(sent))


def _idle_between(*gaps):
    return lambda t: 0.0 if any(a <= t < b for a, b in gaps) else 1.0


def test_counter_interpolates_and_clamps():
    counter = Counter((1.0, 2.0, 4.0), (0, 100, 300))
    assert counter.bytes_at(1.5) == 50 and counter.bytes_at(3.0) == 200
    assert counter.bytes_at(0.0) == 0 and counter.bytes_at(9.0) == 300
    with pytest.raises(ValueError, match="two or more"):
        Counter((1.0,), (0,))


def _flat(spans):
    return [edge for span in spans for edge in span]


def test_idle_spans_merge_neighbours_and_clip_to_the_window():
    rate = RATE * 1000  # the counter above counts milli-bytes
    counter = _counter(lambda t: 0.0 if 20 <= t < 45 else 0.3 if 70 <= t < 72 else 1.0)
    assert _flat(counter.idle_spans(0.0, 0.1, rate)) == pytest.approx([0.020, 0.045, 0.070, 0.072])
    assert _flat(counter.idle_spans(0.030, 0.071, rate)) == pytest.approx([0.030, 0.045, 0.070, 0.071])
    assert counter.idle_spans(0.050, 0.060, rate) == []
    # A little over half the rate is busy; a little under is idle.
    assert _counter(lambda t: 0.55).idle_spans(0.0, 0.1, rate) == []
    assert _flat(_counter(lambda t: 0.45).idle_spans(0.0, 0.1, rate)) == pytest.approx([0.0, 0.1])


def test_a_step_splits_into_its_phases_with_bytes_and_idle_time():
    rate = RATE * 1000
    counter = _counter(_idle_between((30, 42), (60, 62), (80, 100)))
    marks = [(0.0, "step"), (0.040, "loss"), (0.070, "backward"), (0.090, "optimizer")]
    step = step_activity(counter, marks, 0.100, rate)
    assert [p["phase"] for p in step["phases"]] == ["forward", "backward", "optimizer", "between steps"]
    assert [p["seconds"] for p in step["phases"]] == pytest.approx([0.040, 0.030, 0.020, 0.010])
    assert [p["idle_s"] for p in step["phases"]] == pytest.approx([0.010, 0.004, 0.010, 0.010])
    # Bytes: one milli-byte unit a millisecond while busy.
    assert [p["bytes"] for p in step["phases"]] == pytest.approx([30_000, 26_000, 10_000, 0])
    assert step["step_s"] == pytest.approx(0.100) and step["idle_s"] == pytest.approx(0.034)
    # Spans of 5 ms or more are listed with the phase they start in; the 2 ms one is only counted.
    assert step["spans"] == [dict(start_s=pytest.approx(0.030), seconds=pytest.approx(0.012), phase="forward"),
                             dict(start_s=pytest.approx(0.080), seconds=pytest.approx(0.020), phase="optimizer")]


def test_steps_are_split_at_their_marks_and_the_median_one_summarises():
    rate = RATE * 1000
    counter = _counter(_idle_between((10, 20), (45, 50)), ms=100)
    marks = [(0.000, "step"), (0.010, "loss"), (0.020, "backward"), (0.030, "optimizer"),
             (0.040, "step"), (0.050, "loss"), (0.055, "backward"), (0.058, "optimizer"),
             (0.060, "step"), (0.090, "end")]
    steps = split_steps(marks)
    assert [(m[0][0], end) for m, end in steps] == [(0.0, 0.040), (0.040, 0.060), (0.060, 0.090)]
    result = activity(counter, marks, rate)
    # The last step carries no phase marks (a contender whose step marks none): it is one phase.
    assert [p["phase"] for p in result["steps"][2]["phases"]] == ["step"]
    assert [s["step_s"] for s in result["steps"]] == pytest.approx([0.040, 0.020, 0.030])
    assert result["median_step"]["step_s"] == pytest.approx(0.030)
    assert result["median_idle_s"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="no complete step"):
        activity(counter, [(0.0, "loss")], rate)


def test_marks_cost_nothing_while_off():
    ticks = iter([1.0, 2.0])
    marks = StepMarks(clock=lambda: next(ticks))
    marks.note("step")
    assert marks.marks == []
    marks.on = True
    marks.note("step")
    marks.note("loss")
    assert marks.marks == [(1.0, "step"), (2.0, "loss")]


def test_the_sampler_counts_what_crosses_this_host_s_loopback(tmp_path):
    nbytes = 4 << 20
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received.append(len(chunk))

    reader = threading.Thread(target=drain)
    reader.start()
    sampler = LinkSampler("lo", tmp_path / "samples.txt")
    sampler.start()
    with socket.create_connection(listener.getsockname()) as conn:
        conn.sendall(b"x" * nbytes)
    reader.join(timeout=30)
    counter = sampler.stop()
    listener.close()
    assert sum(received) == nbytes
    assert len(counter.times) >= 2 and list(counter.times) == sorted(counter.times)
    assert counter.sent[-1] - counter.sent[0] >= nbytes  # payload plus headers (and whatever else used lo)


def test_timeline_needs_a_link_and_a_counter(tmp_path):
    with pytest.raises(UsageError, match="--link-timeline needs --link"):
        parse(["--link-timeline"])
    assert parse(["--link", "2gbit", "--link-timeline"])[0].link_timeline
    with pytest.raises(ValueError, match="no transmit counter for interface 'nosuchdev0'"):
        LinkSampler("nosuchdev0", tmp_path / "s.txt")


@pytest.mark.skipif(bool(missing_for_link(os.geteuid())), reason="needs root, ip and tc")
def test_a_run_behind_the_link_accounts_for_the_bytes_its_interface_counted(tmp_path, capsys):
    from flatfsdp.bench.__main__ import main

    summary = main(["--link", "2gbit", "--link-timeline", "--contenders", "flatfsdp", "--repeats", "1",
                    "--warmup", "1", "--steps", "3", "--num-layers", "2", "--hidden-size", "64",
                    "--num-attention-heads", "2", "--vocab-size", "512", "--preset", "small-batch",
                    "--out", str(tmp_path)])
    row = summary["rows"]["flatfsdp"]
    timeline = row["link_timeline"]
    assert len(timeline["steps"]) == 3 and timeline["rate"] == 250e6
    for step in timeline["steps"]:
        assert [p["phase"] for p in step["phases"]] == ["forward", "backward", "optimizer", "between steps"]
        assert sum(p["seconds"] for p in step["phases"]) == pytest.approx(step["step_s"])
        assert sum(p["bytes"] for p in step["phases"]) == pytest.approx(step["bytes"])
        assert 0 <= step["idle_s"] <= step["step_s"]
    # The same counter, read by the bench around the timed steps: the timeline's steps hold its bytes
    # (less the barrier and the gap after the last step).
    counted = row["link"]["iface_tx"][0]  # per step
    timed = sum(s["bytes"] for s in timeline["steps"]) / 3
    assert 0.95 * counted <= timed <= 1.01 * counted
    assert "Link activity" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["summary"]["rows"]["flatfsdp"]["link_timeline"]


def test_the_table_lists_each_contender_s_phases_and_its_longest_idle_spans():
    from flatfsdp.bench.timeline_table import LISTED_SPANS, timeline_table

    spans = [dict(start_s=0.1 * i, seconds=0.005 + 0.001 * i, phase="forward") for i in range(LISTED_SPANS + 2)]
    phases = [dict(phase="forward", seconds=0.5, bytes=100 * 2**20, idle_s=0.05)]
    step = dict(step_s=0.5, bytes=100 * 2**20, idle_s=0.05, phases=phases, spans=spans)
    summary = dict(rows={"flatfsdp": dict(label="flatfsdp", link_timeline=dict(rate=250e6, median_step=step,
                                                                                 median_idle_s=0.05)),
                         "floor": dict(label="floor", link_timeline=None)})
    table = timeline_table(summary)
    assert "| flatfsdp | forward | 0.500 | 100.0 | 0.050 |" in table
    assert "| flatfsdp | **whole step** | 0.500 | 100.0 | 0.050 (median over the run's steps 0.050) |" in table
    assert "floor" not in table  # no timeline, no row
    # The two shortest spans are counted, not listed.
    assert "0.000-0.005 s" not in table and "0.100-0.106 s" not in table and "and 2 shorter, 11 ms in all" in table
    assert "0.900-0.914 s (14 ms, forward)" in table
    assert timeline_table(dict(rows={"floor": dict(label="floor")})) == ""
