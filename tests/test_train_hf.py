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


# ---- --hf-model DIR: fine-tune a pretrained checkpoint, export it back ----------------------

PRETRAINED = ["--seq-length", "32", "--micro-batch-size", "4", "--eval-iters", "2", "--log-interval", "2",
              "--no-progress", "--train-iters", "4", "--eval-interval", "0"]


def _global_loss(model, batches) -> float:
    import torch

    from flatfsdp.models.gpt import lm_loss
    with torch.no_grad():
        total = sum(lm_loss(model(input_ids=b[:, :-1]).logits, b[:, 1:], reduction="sum").item() for b in batches)
    return total / sum(b[:, 1:].numel() for b in batches)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    import torch
    import transformers

    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama", max_shard_size="50KB")
    # A folder of weights without a tokenizer: byte values as ids only because this run asks for them.
    result = launch(_runs, 2, {"tune": PRETRAINED + ["--hf-model", str(root / "llama"), "--tokenizer", "bytes",
                                                     "--run-dir", str(root / "run"), "--save", str(root / "ckpt")]},
                    timeout_s=300)
    return result["tune"], root


def test_fine_tuning_starts_from_the_pretrained_weights(fine_tuned):
    from flatfsdp.train import data
    import transformers

    summary, root = fine_tuned
    reference = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    corpus = data.load_corpus()
    first = [data.micro_batch(corpus.train, seed=1234, step=1, micro=0, rank=r, world=2, micro_batch_size=4,
                              accumulation=1, seq_length=32) for r in range(2)]
    assert summary["losses"][0] == pytest.approx(_global_loss(reference, first), abs=1e-5)
    assert summary["sharded_units"] == 3
    assert summary["losses"][-1] < summary["losses"][0]


def test_the_fine_tuned_checkpoint_exports_to_hugging_face_format(fine_tuned):
    from flatfsdp.checkpoint.cli import main as checkpoint_main
    from flatfsdp.train import data
    import transformers

    summary, root = fine_tuned
    checkpoint_main(["export", "--format", "hf", str(root / "ckpt"), str(root / "export")])
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "export")
    corpus = data.load_corpus()
    held_out = [b for r in range(2) for b in data.eval_batches(corpus.eval, count=2, rank=r, world=2,
                                                               micro_batch_size=4, seq_length=32)]
    # The run evaluated its final (sharded) weights on these very batches.
    assert _global_loss(exported, held_out) == pytest.approx(summary["eval_loss"], abs=1e-5)
    # Trained on byte tokens, it exports with them as a Hugging Face tokenizer: the same ids, 256 ending a text.
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "export")
    text = "Tides turn; bread rises. Ça va?"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert tokenizer.eos_token_id == exported.generation_config.eos_token_id == 256


def test_a_vocabulary_too_small_for_byte_tokens_is_refused(tmp_path, capsys):
    import transformers

    from flatfsdp.train.command import main
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main(["--hf-model", str(tmp_path)])
    assert f"--hf-model {tmp_path} holds no tokenizer" in capsys.readouterr().err  # not silently bytes
    with pytest.raises(SystemExit):
        main(["--hf-model", str(tmp_path), "--tokenizer", "bytes"])
    assert "its embedding has 100 rows, fewer than the 256 token ids" in capsys.readouterr().err


def test_a_directory_without_a_model_is_refused(tmp_path, capsys):
    from flatfsdp.train.command import main
    with pytest.raises(SystemExit):
        main(["--hf-model", str(tmp_path / "nowhere")])
    assert "no config.json there (a local Hugging Face model directory" in capsys.readouterr().err
