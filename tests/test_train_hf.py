"""`flatfsdp train --hf-model`: a tiny Hugging Face Llama, built from a config
(nothing downloaded), sharded by the import path of its decoder-layer class, on
2 real ranks. Resume is bitwise here too."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from flatfsdp.launch import launch  # noqa: E402
from flatfsdp.train.loop import run  # noqa: E402
from flatfsdp.train.options import parse_options  # noqa: E402

HF = ["--hf-model", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
      "--micro-batch-size", "4", "--eval-iters", "1", "--log-interval", "4", "--no-progress", "--train-iters", "12"]


def _runs(jobs: dict[str, list[str]]) -> dict[str, dict]:
    return {name: run(parse_options(argv)) for name, argv in jobs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    ckpt = str(root / "ckpt")
    return launch(_runs, 2, {
        "straight": HF + ["--run-dir", str(root / "a")],
        "first": HF + ["--run-dir", str(root / "b"), "--exit-interval", "6", "--save", ckpt],
        "second": HF + ["--run-dir", str(root / "c"), "--load", ckpt, "--recompute"],
    }, timeout_s=300)


def test_llama_trains_with_its_decoder_layers_sharded(results):
    straight = results["straight"]
    assert straight["sharded_units"] == 3  # LlamaDecoderLayer x 2 and the root
    assert straight["losses"][-1] < straight["losses"][0] - 0.5
    assert straight["eval_loss"] < straight["losses"][0] - 0.5


def test_llama_resume_is_bitwise_even_with_recompute_switched_on(results):
    # Recompute reruns the same forward: it must not change a single bit.
    assert results["first"]["losses"] + results["second"]["losses"] == results["straight"]["losses"]
