"""`flatfsdp train --hf-model DIR --data FILE` as a user runs it: their Llama
and its BPE tokenizer (trained here with `tokenizers`), their jsonl of made-up
documents, 2 real ranks. The loss falls, a resumed run continues bit for bit,
LoRA trains the adapters alone and exports a model from_pretrained loads, and
the tokenizer travels: train -> export -> from_pretrained (model and
tokenizer) -> generate -> fine-tune the export, with no file copied by hand."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from flatfsdp.launch import launch  # noqa: E402
from flatfsdp.train.loop import run  # noqa: E402
from flatfsdp.train.options import parse_options  # noqa: E402

from own_data_fixtures import make_user_setup  # noqa: E402

COMMON = ["--seq-length", "32", "--micro-batch-size", "4", "--eval-iters", "2", "--log-interval", "4",
          "--no-progress", "--eval-interval", "0", "--lr", "3e-3"]


def _runs(jobs: dict[str, list[str]]) -> dict[str, dict]:
    return {name: run(parse_options(argv)) for name, argv in jobs.items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_data")
    user = make_user_setup(root)
    base = COMMON + ["--hf-model", user["model"], "--data", user["data"], "--data-cache", str(root / "cache")]
    ckpt, lora_ckpt = str(root / "ckpt"), str(root / "lora_ckpt")
    lora = base + ["--train-iters", "8", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets",
                   "q_proj,v_proj,down_proj", "--lr", "2e-2"]
    results = launch(_runs, 2, {
        "straight": base + ["--train-iters", "12", "--run-dir", str(root / "a"), "--save", str(root / "full_ckpt")],
        "first": base + ["--train-iters", "12", "--run-dir", str(root / "b"), "--exit-interval", "6",
                         "--save", ckpt],
        "second": base + ["--train-iters", "12", "--run-dir", str(root / "c"), "--load", ckpt],
        "lora": lora + ["--run-dir", str(root / "d")],
        "lora_first": lora + ["--run-dir", str(root / "e"), "--exit-interval", "4", "--save", lora_ckpt],
        "lora_second": lora + ["--run-dir", str(root / "f"), "--load", lora_ckpt, "--save", lora_ckpt],
    }, timeout_s=400)
    return results, user, root


def _config(run_dir) -> dict:
    with open(os.path.join(run_dir, "log.json")) as f:
        return json.load(f)["config"]


def test_fine_tuning_on_my_jsonl_with_my_tokenizer_lowers_the_loss(trained):
    results, user, root = trained
    straight = results["straight"]
    assert straight["losses"][-1] < straight["losses"][0] - 1.0
    assert straight["eval_loss"] < straight["losses"][0] - 1.0
    config = _config(root / "a")
    # One document in 20 held out, whole; ids in uint16 (the vocabulary fits).
    assert (config["train_documents"], config["eval_documents"]) == (380, 20)
    with open(os.path.join(config["token_cache"], "meta.json")) as f:
        meta = json.load(f)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == user["vocab"]
    assert os.path.getsize(os.path.join(config["token_cache"], "train.bin")) == 2 * config["train_tokens"]
    # Every run of the module used the one cache entry: tokenized once.
    assert len([n for n in os.listdir(root / "cache") if not n.endswith(".lock")]) == 1
    assert _config(root / "c")["token_cache"] == config["token_cache"]


def test_resumed_run_continues_bit_for_bit(trained):
    results, _, _ = trained
    assert results["first"]["losses"] + results["second"]["losses"] == results["straight"]["losses"]


def test_lora_trains_only_the_adapters(trained):
    results, user, root = trained
    lora = results["lora"]
    assert lora["losses"][-1] < lora["losses"][0] - 0.1
    # q_proj, v_proj, down_proj of 2 layers: A is [4, in], B is [out, 4].
    hidden, inter, kv = 48, 96, 2 * 12
    adapters = 2 * (4 * (hidden + hidden) + 4 * (hidden + kv) + 4 * (inter + hidden))
    assert lora["trainable_parameters"] == adapters
    # Gradients and optimizer state (exp_avg, exp_avg_sq in fp32) exist for the adapters alone:
    # rank 0 holds at most its half of them, padding aside.
    assert 0 < lora["persistent_bytes_by_role"]["gradients"] <= 4 * adapters
    assert 0 < lora["optimizer_state_bytes"] <= 2 * 4 * adapters
    assert lora["persistent_bytes_by_role"]["main weights"] > 20 * lora["persistent_bytes_by_role"]["gradients"]


def test_lora_run_resumes_bit_for_bit(trained):
    results, _, _ = trained
    assert results["lora_second"]["first_step"] == 5
    assert results["lora_first"]["losses"] + results["lora_second"]["losses"] == results["lora"]["losses"]


def _eval_loss(model, batches) -> float:
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(model(input_ids=b[:, :-1]).logits.flatten(0, 1),
                                                      b[:, 1:].flatten(), reduction="sum").item() for b in batches)
    return total / sum(b[:, 1:].numel() for b in batches)


def test_lora_checkpoint_exports_a_merged_model_and_a_peft_adapter(trained):
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    from flatfsdp.checkpoint.cli import main as checkpoint_main
    from flatfsdp.data.packed import PackedWindows
    from flatfsdp.data.token_cache import TokenFiles

    results, user, root = trained
    out = root / "exported"
    checkpoint_main(["export", "--format", "hf", str(root / "lora_ckpt"), str(out)])
    config = _config(root / "f")
    with open(os.path.join(config["token_cache"], "meta.json")) as f:
        files = TokenFiles(config["token_cache"], json.load(f))
    held_out = PackedWindows(files.open("eval"), 32, seed=1234)
    batches = [b for r in range(2) for b in held_out.eval_batches(count=2, rank=r, world=2, micro_batch_size=4)]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert abs(_eval_loss(merged, batches) - results["lora_second"]["eval_loss"]) < 1e-4
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(user["model"])
    with_adapter = PeftModel.from_pretrained(pretrained, out / "adapter").eval()
    assert abs(_eval_loss(with_adapter, batches) - results["lora_second"]["eval_loss"]) < 1e-4
    # The frozen weights left training untouched: unwrapped layers are the pretrained ones bit for bit.
    before, after = load_file(os.path.join(user["model"], "model.safetensors")), load_file(out / "model.safetensors")
    assert torch.equal(before["model.layers.0.self_attn.k_proj.weight"], after["model.layers.0.self_attn.k_proj.weight"])
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])


def _held_out_batches(files, world: int = 2, count: int = 2):
    from flatfsdp.data.packed import PackedWindows

    held_out = PackedWindows(files.open("eval"), 32, seed=1234)
    return [b for r in range(world) for b in held_out.eval_batches(count=count, rank=r, world=world, micro_batch_size=4)]


def _token_files(run_dir):
    from flatfsdp.data.token_cache import TokenFiles

    config = _config(run_dir)
    with open(os.path.join(config["token_cache"], "meta.json")) as f:
        return TokenFiles(config["token_cache"], json.load(f))


def test_the_tokenizer_travels_from_training_through_export_to_a_fine_tune_of_the_export(trained, tmp_path, capsys):
    import transformers

    from flatfsdp.checkpoint.cli import main as checkpoint_main
    from flatfsdp.data.packed import PackedWindows
    from flatfsdp.train.command import main as train_main

    results, user, root = trained
    out = root / "export"
    checkpoint_main(["export", "--format", "hf", str(root / "full_ckpt"), str(out)])
    assert "and the tokenizer the run trained with" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    # The export's tokenizer is the one training used: its ids are the token cache's, documents joined by its EOS.
    files = _token_files(root / "a")
    held = [doc for i, doc in enumerate(user["docs"]) if i % 20 == 1]
    assert files.open("eval").long().tolist() == [
        t for doc in held for t in [*tokenizer(doc, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]]
    held_out_loss = _eval_loss(model, _held_out_batches(files))
    assert abs(held_out_loss - results["straight"]["eval_loss"]) < 1e-4
    # generate() stops where training ended documents, and decodes to text.
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer("The baker opens", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(generated[0], skip_special_tokens=True).startswith("The baker opens")
    # The export fine-tunes as it is: its own tokenizer, the same ids (the same cache entry, said in one line).
    tune = train_main(COMMON + ["--hf-model", str(out), "--data", user["data"], "--data-cache", str(root / "cache"),
                                "--nproc-per-node", "1", "--train-iters", "1", "--run-dir", str(tmp_path / "tune")])
    said = capsys.readouterr().err
    assert f"using the cached tokens of {user['data']} with tokenizer {out}: " in said
    assert f"in {files.directory}" in said
    first = PackedWindows(files.open("train"), 32, seed=1234).micro_batch(step=1, micro=0, rank=0, world=1,
                                                                          micro_batch_size=4, accumulation=1)
    assert tune["losses"][0] == pytest.approx(_eval_loss(model, [first]), abs=1e-5)
    # ... so its first loss is the export's held-out loss (byte ids fed to this model would give about 12).
    assert tune["losses"][0] == pytest.approx(held_out_loss, abs=0.15)


def test_a_checkpoint_refuses_another_tokenizer(trained, capsys):
    from flatfsdp.train.command import main as train_main

    _, user, root = trained
    with pytest.raises(SystemExit) as done:
        train_main(COMMON + ["--hf-model", user["model"], "--tokenizer", "bytes", "--data", user["data"],
                             "--data-cache", str(root / "cache"), "--load", str(root / "full_ckpt")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"--load {root / 'full_ckpt'} was trained with the tokenizer {os.path.abspath(user['model'])} (sha256 "
            in err and "this run would use bytes" in err and f"pass --tokenizer {os.path.abspath(user['model'])}" in err)
