"""The text a run trains on and the tokenizer that turns it into ids, tokenized
once into the token cache (flatfsdp.data), and the checks that they suit the
model -- all before training starts.

The tokenizer: ``--tokenizer DIR|bytes``, else the one in the ``--hf-model DIR``
folder (a folder without one is refused), else byte tokens. The text:
``--data``, else the shipped text -- as raw bytes for byte tokens (the
original, window-anywhere sampler of train/data.py), through the token cache
like any --data for a real tokenizer (a model fine-tuned on it must see the ids
its tokenizer gives, never byte values).

The launcher prepares the cache once per node (under torchrun every process
calls `prepare`, and the cache's file lock lets one tokenize while the others
wait); the ranks then only map the files.
"""

from __future__ import annotations

import os

from flatfsdp.train.data import VOCAB_SIZE, ShippedText, UserData, corpus_path
from flatfsdp.train.options import TrainOptions, UsageError


def tokenizer_for(o: TrainOptions):
    from flatfsdp.data.sources import DataError
    from flatfsdp.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(o.tokenizer, o.hf_model)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def data_paths(o: TrainOptions, tokenizer) -> list[str] | None:
    """What goes through the token cache: --data, or the shipped text for a real
    tokenizer; None: the shipped text as bytes."""
    from flatfsdp.data.tokenizer import ByteTokenizer

    if o.data:
        return list(o.data)
    return None if isinstance(tokenizer, ByteTokenizer) else [corpus_path()]


def prepare(o: TrainOptions, tokenizer, *, show_progress: bool, report: bool = True):
    """The token files of the run's text (None for the shipped text as bytes): made now or found in the cache.
    ``report``: say which in one line (False: the other processes of a node)."""
    paths = data_paths(o, tokenizer)
    if paths is None:
        return None
    from flatfsdp.data import token_cache
    from flatfsdp.data.sources import DataError

    try:
        files = token_cache.prepare(paths, o.data_field, tokenizer, o.data_cache, show_progress=show_progress,
                                    report=report)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    check_windows(o, files)
    return files


def reports_on_this_node() -> bool:
    """One process per node says what it tokenized or found: the launcher, or torchrun's local rank 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def check_windows(o: TrainOptions, files) -> None:
    what_text = "--data" if o.data else "the shipped text"
    for split, what in (("train", "training"), ("eval", "held-out")):
        tokens = files.meta[f"{split}_tokens"]
        if tokens < o.seq_length + 2:
            hint = (" (one document in 20 is held out: pass more documents)" if split == "eval"
                    else "")
            raise UsageError(f"{what_text}: the {what} documents hold {tokens} tokens, fewer than one sequence of "
                             f"--seq-length {o.seq_length} + 1{hint}")


def data_vocab(o: TrainOptions, files) -> int:
    """Token ids the data can hold: the model's embedding needs at least this many rows."""
    return files.meta["vocab_size"] if files is not None else VOCAB_SIZE


def open_data(o: TrainOptions, files) -> ShippedText | UserData:
    return UserData(files, o.seed, o.seq_length) if files is not None else ShippedText(o.seed, o.seq_length)
