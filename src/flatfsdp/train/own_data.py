"""`--data`: the user's text, tokenized once into the token cache (flatfsdp.data),
and the checks that it suits the model -- all before training starts.

The launcher prepares the cache once per node (under torchrun every process
calls `prepare`, and the cache's file lock lets one tokenize while the others
wait); the ranks then only map the files.
"""

from __future__ import annotations

from flatfsdp.train.data import VOCAB_SIZE, ShippedText, UserData
from flatfsdp.train.options import TrainOptions, UsageError


def tokenizer_for(o: TrainOptions):
    from flatfsdp.data.sources import DataError
    from flatfsdp.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(o.tokenizer, o.hf_model)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def prepare(o: TrainOptions, tokenizer=None, *, show_progress: bool):
    """The token files of ``--data`` (None without it): made now or found in the cache."""
    if not o.data:
        return None
    from flatfsdp.data import token_cache
    from flatfsdp.data.sources import DataError

    tokenizer = tokenizer or tokenizer_for(o)
    try:
        files = token_cache.prepare(list(o.data), o.data_field, tokenizer, o.data_cache, show_progress=show_progress)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    check_windows(o, files)
    return files


def check_windows(o: TrainOptions, files) -> None:
    for split, what in (("train", "training"), ("eval", "held-out")):
        tokens = files.meta[f"{split}_tokens"]
        if tokens < o.seq_length + 2:
            hint = (" (one document in 20 is held out: pass more documents)" if split == "eval"
                    else "")
            raise UsageError(f"--data: the {what} documents hold {tokens} tokens, fewer than one sequence of "
                             f"--seq-length {o.seq_length} + 1{hint}")


def data_vocab(o: TrainOptions, files) -> int:
    """Token ids the data can hold: the model's embedding needs at least this many rows."""
    return files.meta["vocab_size"] if files is not None else VOCAB_SIZE


def open_data(o: TrainOptions, files) -> ShippedText | UserData:
    return UserData(files, o.seed, o.seq_length) if files is not None else ShippedText(o.seed, o.seq_length)
