"""Text to token ids: a Hugging Face tokenizer from a local folder, or byte tokens.

Both encode a batch of documents at once (the Rust `tokenizers` backend spreads
a batch over the cores) and name one end-of-document token that joins
documents in the packed stream. ``fingerprint`` identifies the tokenizer by
what it does (its full serialised form), so the token cache is reused exactly
when the same text would give the same ids.
"""

from __future__ import annotations

import hashlib
import os

from flatfsdp.data.sources import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


class ByteTokenizer:
    """Every UTF-8 byte is a token (ids 0-255); 256 ends a document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256
    fingerprint = "bytes-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class HFTokenizer:
    """The tokenizer saved in a Hugging Face folder (AutoTokenizer, local files only)."""

    def __init__(self, folder: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"the tokenizer in {folder} needs transformers: pip install 'flatfsdp[data]'") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise DataError(f"--tokenizer {folder}: not a loadable tokenizer ({' '.join(str(exc).split())})") from None
        self.name = folder
        self.vocab_size = len(self._tokenizer)
        """Ids run below this (added tokens included)."""
        self.eos_id = self._tokenizer.eos_token_id
        if self.eos_id is None:
            raise DataError(f"the tokenizer in {folder} has no end-of-sequence token to join documents with "
                            "(set eos_token in its tokenizer_config.json)")
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        self._backend = backend
        described = backend.to_str() if backend is not None else repr(sorted(self._tokenizer.get_vocab().items()))
        self.fingerprint = hashlib.sha256(
            f"{type(self._tokenizer).__name__}|{self.eos_id}|{self.vocab_size}|{described}".encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:  # the Rust batch encoder, parallel over the batch; no offsets wanted
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]


def load_tokenizer(tokenizer_dir: str | None, hf_model: str | None):
    """``--tokenizer DIR``, else the tokenizer inside ``--hf-model DIR``, else byte tokens."""
    if tokenizer_dir:
        if not os.path.isdir(tokenizer_dir) or not has_tokenizer(tokenizer_dir):
            raise DataError(f"--tokenizer {tokenizer_dir}: no tokenizer files there ({', '.join(TOKENIZER_FILES)})")
        return HFTokenizer(tokenizer_dir)
    if hf_model and has_tokenizer(hf_model):
        return HFTokenizer(hf_model)
    return ByteTokenizer()
