"""`--data` in one process: every accepted kind of input, the token cache (made
once, keyed by content), the held-out split by documents, the sampler as a
pure function of (seed, step), and bad input refused with one line and exit
status 2 before any rank starts."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from flatfsdp.data import token_cache
from flatfsdp.data.packed import PackedWindows
from flatfsdp.data.sources import DataError, documents, find_sources
from flatfsdp.data.tokenizer import ByteTokenizer
from flatfsdp.train import main

from own_data_fixtures import documents as made_up, save_llama, save_tokenizer, write_jsonl

DOCS = made_up(41, seed=5)


def _texts(paths, field="text") -> list[str]:
    return [text for source in find_sources([str(p) for p in paths]) for text, _ in documents(source, field)]


def test_every_kind_of_input_reads_the_same_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    datasets = pytest.importorskip("datasets")

    write_jsonl(tmp_path / "a.jsonl", DOCS, field="body")
    (tmp_path / "b.txt").write_text("\n\n".join(DOCS) + "\n")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert _texts([tmp_path / "a.jsonl"], "body") == DOCS
    assert _texts([tmp_path / "b.txt"]) == DOCS  # paragraphs
    assert _texts([tmp_path / "c.parquet"]) == DOCS
    assert _texts([tmp_path / "saved"]) == DOCS
    folder = tmp_path / "folder"
    os.makedirs(folder / "inner")
    shutil.copy(tmp_path / "b.txt", folder / "inner" / "z.txt")
    shutil.copy(tmp_path / "c.parquet", folder / "y.parquet")
    assert _texts([folder]) == DOCS + DOCS  # recursive, in name order


def test_tokenized_once_keyed_by_content_split_by_documents(tmp_path, capsys):
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cache = str(tmp_path / "cache")
    files = token_cache.prepare([str(tmp_path / "docs.jsonl")], "text", ByteTokenizer(), cache, show_progress=False)
    assert "tokenized" in capsys.readouterr().err
    # Held out: documents 1, 21, 41 whole, each followed by the end-of-document id.
    held = [DOCS[i] for i in range(len(DOCS)) if i % 20 == 1]
    expected = [t for doc in held for t in [*doc.encode(), 256]]
    assert files.open("eval").long().tolist() == expected
    assert files.meta["train_tokens"] == sum(len(d.encode()) + 1 for d in DOCS) - len(expected)
    assert files.meta["dtype"] == "uint16"
    stamp = os.stat(os.path.join(files.directory, "train.bin")).st_mtime_ns
    # Same content under another name: the same entry, not tokenized again.
    shutil.copy(tmp_path / "docs.jsonl", tmp_path / "renamed.jsonl")
    again = token_cache.prepare([str(tmp_path / "renamed.jsonl")], "text", ByteTokenizer(), cache, show_progress=False)
    said = capsys.readouterr().err
    assert again.directory == files.directory and not said.startswith("tokenized")
    tokens = files.meta["train_tokens"] + files.meta["eval_tokens"]  # a hit says what it used, as a miss does
    assert said == (f"using the cached tokens of {tmp_path / 'renamed.jsonl'} with tokenizer bytes: {tokens:,} tokens "
                    f"({len(expected):,} held out) in {files.directory}\n")
    assert os.stat(os.path.join(again.directory, "train.bin")).st_mtime_ns == stamp
    # Changed content: a new entry.
    write_jsonl(tmp_path / "renamed.jsonl", DOCS[:-1])
    changed = token_cache.prepare([str(tmp_path / "renamed.jsonl")], "text", ByteTokenizer(), cache, show_progress=False)
    assert changed.directory != files.directory


def test_batches_are_a_pure_function_of_seed_and_step_whatever_the_ranks():
    tokens = torch.arange(1000, dtype=torch.int32).to(torch.uint16)
    windows = PackedWindows(tokens, seq_length=9, seed=7)  # 111 windows
    one = [windows.micro_batch(step=s, micro=m, rank=0, world=1, micro_batch_size=12, accumulation=2)
           for s in (1, 2) for m in range(2)]
    fresh = PackedWindows(tokens, seq_length=9, seed=7)
    four = [fresh.micro_batch(step=s, micro=m, rank=r, world=4, micro_batch_size=6, accumulation=1)
            for s in (1, 2) for m in range(1) for r in range(4)]
    assert torch.equal(torch.cat(one), torch.cat(four))
    # One epoch visits every window once; windows are packed (start at multiples of 9, 10 tokens long).
    epoch = torch.cat([windows.micro_batch(step=s, micro=0, rank=0, world=1, micro_batch_size=37, accumulation=1)
                       for s in (1, 2, 3)])
    assert sorted((epoch[:, 0] // 9).tolist()) == list(range(111))
    assert torch.equal(epoch[:, 1:] - epoch[:, :-1], torch.ones(111, 9, dtype=torch.long))
    assert not torch.equal(one[0], PackedWindows(tokens, 9, seed=8).micro_batch(
        step=1, micro=0, rank=0, world=1, micro_batch_size=12, accumulation=2))


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bad_input")
    vocab = save_tokenizer(root / "llama", DOCS)
    save_llama(root / "llama", vocab_size=vocab + 8, positions=64)
    save_llama(root / "small", vocab_size=vocab - 50)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "llama" / name, root / "small" / name)
    write_jsonl(root / "docs.jsonl", DOCS)
    write_jsonl(root / "other.jsonl", DOCS, field="body")
    (root / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b",, "id": 2}\n')
    save_llama(root / "bare", vocab_size=300)  # weights without a tokenizer
    (root / "empty.jsonl").write_text("")
    (root / "blob.txt").write_bytes(bytes(range(256)) * 4)
    return root


def _fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--no-progress"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case, expected", [
    (["--data", "{root}/nowhere.jsonl"], "nowhere.jsonl: no such file"),
    (["--data", "{root}/empty.jsonl"], "empty.jsonl: the file is empty"),
    (["--data", "{root}/blob.txt"], "blob.txt: a binary file"),
    (["--data", "{root}/other.jsonl"], "other.jsonl line 1: no field 'text' (it has: id, body)"),
    (["--data", "{root}/broken.jsonl"], "broken.jsonl line 2 column 14: not JSON (Expecting property name"),
    (["--data", "{root}/docs.jsonl", "--hf-model", "{root}/bare"], "--hf-model {root}/bare holds no tokenizer"),
    (["--hf-model", "{root}/bare"], "--hf-model {root}/bare holds no tokenizer (tokenizer.json, "),
    (["--data", "{root}/docs.jsonl", "--hf-model", "{root}/small"], "embedding has"),
    (["--data", "{root}/docs.jsonl", "--hf-model", "{root}/llama", "--seq-length", "65"], "past --hf-model"),
    (["--data-par", "3"], "unrecognized arguments: --data-par"),
    (["--data", "{root}/docs.jsonl", "--lora-rank", "4"], "--lora-rank fine-tunes a pretrained model"),
])
def test_bad_input_is_one_line_and_exit_2_before_training(user, capsys, case, expected):
    argv = [a.format(root=user) for a in case] + ["--data-cache", str(user / "cache"), "--run-dir", str(user / "r")]
    assert expected.format(root=user) in _fails(capsys, argv)


def test_a_field_the_first_line_has_but_a_later_one_lacks_names_the_line(user, capsys):
    path = user / "mixed.jsonl"
    write_jsonl(path, DOCS[:3])
    with open(path, "a") as f:
        f.write(json.dumps({"title": "no text here"}) + "\n")
    err = _fails(capsys, ["--data", str(path), "--data-cache", str(user / "cache"), "--run-dir", str(user / "r")])
    assert "mixed.jsonl line 4: no field 'text'" in err
    assert not [n for n in os.listdir(user / "cache") if ".partial" in n]  # nothing half-written left


def test_missing_folder_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="holds no"):
        find_sources([str(tmp_path)])


def test_the_tokenizing_bar_draws_only_on_a_terminal(monkeypatch):
    """In a pipe or a log file, plain lines: a bar's carriage-return frames would fill the log."""
    pytest.importorskip("tqdm")
    from flatfsdp.data import progress

    assert type(progress.progress_bar(100, "tokenizing", True)).__name__ == "_Plain"  # pytest's stderr: no terminal
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    bar = progress.progress_bar(100, "tokenizing", True)
    assert type(bar).__name__ == "tqdm"
    bar.close()
