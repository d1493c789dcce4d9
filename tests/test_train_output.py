"""What `flatfsdp train` shows and keeps: the progress display (every backend,
and the live bar in a real terminal), the loss-curve PNG (our own encoder
without matplotlib), the atomic JSON log, and the data's determinism."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import zlib

import pytest
import torch

from flatfsdp.train import data, progress
from flatfsdp.train.plot import EVAL_COLOR, TRAIN_COLOR, plot_losses
from flatfsdp.train.runlog import RunLog

MEMORY = [[301.0, 310.0, 0.0, 0.0], [305.0, 312.0, 0.0, 0.0]]


def _decode_png(blob: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB PNG written without filters."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos:pos + 4])
        kind, payload = blob[pos + 4:pos + 8], blob[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", blob[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + payload)
        chunks[kind] = chunks.get(kind, b"") + payload
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    return width, height, [raw[y * stride + 1:(y + 1) * stride] for y in range(height)]


def test_builtin_png_draws_the_curves_without_matplotlib(tmp_path):
    path = tmp_path / "loss.png"
    train = [(s, 5.5 - 0.3 * s) for s in range(1, 11)]
    assert plot_losses(str(path), train, [(5, 4.2), (10, 2.6)], use_matplotlib=False) == "builtin"
    width, height, rows = _decode_png(path.read_bytes())
    assert (width, height) == (640, 360)
    pixels = {bytes(row[i:i + 3]) for row in rows for i in range(0, len(row), 3)}
    assert bytes(TRAIN_COLOR) in pixels and bytes(EVAL_COLOR) in pixels
    # The curve falls: its leftmost pixel sits higher (smaller y) than its rightmost.
    ys = {x: y for y, row in enumerate(rows) for x in range(width) if bytes(row[3 * x:3 * x + 3]) == bytes(TRAIN_COLOR)
          and x > 60}
    assert min(ys.items())[1] < max(ys.items())[1]


def test_matplotlib_is_used_when_installed(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    assert plot_losses(str(path), [(1, 5.0), (2, 4.0)], [(2, 4.5)]) == "matplotlib"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_log_is_rewritten_atomically(tmp_path):
    log = RunLog(str(tmp_path / "log.json"), {"seed": 1})
    log.step(step=1, loss=5.0)
    log.memory(1, MEMORY)
    log.write()
    log.step(step=2, loss=4.0)
    log.finish({"last_loss": 4.0})
    record = json.loads((tmp_path / "log.json").read_text())
    assert [s["loss"] for s in record["steps"]] == [5.0, 4.0] and record["summary"] == {"last_loss": 4.0}
    assert record["memory"][0]["ranks"][1]["peak_rss_mb"] == 312.0
    assert os.listdir(tmp_path) == ["log.json"]  # no temporary file left behind


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _shown(monkeypatch, bar_kind: str | None, block: tuple[str, ...] = ()) -> tuple[str, str]:
    for name in block:
        monkeypatch.setitem(sys.modules, name, None)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    shown = progress.make_progress(20, 0, live=True, backend=bar_kind)
    for step in range(1, 21):
        shown.step(step, 5.0 - step / 10, 1e-3, 12345.0, step % 10 == 0, MEMORY if step == 10 else None)
    shown.note("eval at step 20: held-out loss 3.0000")
    shown.close()
    return type(shown).__name__, terminal.getvalue()


def test_own_bar_is_the_fallback_without_rich_or_tqdm(monkeypatch):
    kind, text = _shown(monkeypatch, None, block=("rich", "rich.console", "rich.progress", "tqdm"))
    assert kind == "LineBar"
    assert "\rstep 20/20 [####################] loss 3.0000 | lr 1.0e-03 | 12,345 tok/s | rss MB/rank 301 305" in text
    assert "eval at step 20" in text


@pytest.mark.parametrize("backend, module", [("rich", "rich"), ("tqdm", "tqdm")])
def test_rich_and_tqdm_bars_show_the_same_fields(monkeypatch, backend, module):
    pytest.importorskip(module)
    kind, text = _shown(monkeypatch, backend)
    assert kind.lower().startswith(backend)
    assert "loss 3.0000" in text and "12,345 tok/s" in text and "rss MB/rank 301 305" in text
    assert "eval at step 20" in text


def test_plain_lines_when_not_a_terminal(monkeypatch, capsys):
    shown = progress.make_progress(20, 0, live=True)
    assert type(shown).__name__ == "PlainLines"  # pytest's captured stdout is no terminal
    shown.step(10, 4.0, 1e-3, 999.0, True, MEMORY)
    shown.step(11, 3.9, 1e-3, 999.0, False)
    assert capsys.readouterr().out == "step 10/20 | loss 4.0000 | lr 1.0e-03 | 999 tok/s | rss MB/rank 301 305\n"


def test_a_real_terminal_gets_a_live_bar_from_rank_0(tmp_path):
    """The command under a pseudo-terminal: rank 0 (a spawned process) must see
    the terminal and redraw a bar in place rather than print log lines."""
    main_fd, child_fd = pty.openpty()
    argv = [sys.executable, "-m", "flatfsdp.train", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
            "2", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "6", "--eval-iters", "1",
            "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, stdin=child_fd, stdout=child_fd, stderr=child_fd, close_fds=True)
    os.close(child_fd)
    out = b""
    while True:
        ready, _, _ = select.select([main_fd], [], [], 120)
        assert ready, out.decode(errors="replace")
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(main_fd)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "\r" in text.replace("\r\n", "\n") or "\x1b[" in text  # redrawn in place
    assert "step 1/6 |" not in text  # not the plain log lines of a pipe
    assert "done: 6 steps" in text


def test_batches_depend_only_on_seed_and_step_not_on_the_split():
    tokens = data.load_corpus().train
    common = dict(seed=7, step=3, seq_length=16)
    two_ranks = [data.micro_batch(tokens, micro=0, rank=r, world=2, micro_batch_size=4, accumulation=1, **common)
                 for r in range(2)]
    accumulated = [data.micro_batch(tokens, micro=m, rank=0, world=1, micro_batch_size=4, accumulation=2, **common)
                   for m in range(2)]
    assert torch.equal(torch.cat(two_ranks), torch.cat(accumulated))
    again = data.micro_batch(tokens, micro=0, rank=1, world=2, micro_batch_size=4, accumulation=1, **common)
    assert torch.equal(again, two_ranks[1])
    other_step = data.micro_batch(tokens, micro=0, rank=1, world=2, micro_batch_size=4, accumulation=1,
                                  **{**common, "step": 4})
    assert not torch.equal(other_step, two_ranks[1])


def test_the_corpus_is_large_and_its_held_out_part_is_not_trained_on():
    corpus = data.load_corpus()
    total = corpus.train.numel() + corpus.eval.numel()
    assert 40_000 <= total <= 100_000
    assert 0.08 * total < corpus.eval.numel() < 0.12 * total
    assert int(corpus.train.max()) < 128  # plain ASCII
    first = data.eval_batches(corpus.eval, count=2, rank=0, world=2, micro_batch_size=3, seq_length=16)
    assert len(first) == 2 and first[0].shape == (3, 17)
    assert all(torch.equal(a, b) for a, b in zip(first, data.eval_batches(
        corpus.eval, count=2, rank=0, world=2, micro_batch_size=3, seq_length=16)))
