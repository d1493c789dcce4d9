"""Text to token ids: a Hugging Face tokenizer from a local folder, or byte tokens
(byte_tokenizer.py) -- and which one a run used.

Both encode a batch of documents at once (the Rust `tokenizers` backend spreads
a batch over the cores) and name one end-of-document token that joins
documents in the packed stream. ``fingerprint`` identifies the tokenizer by
what it does (its full serialised form), so the token cache is reused exactly
when the same text would give the same ids; ``files()`` are what it is made of,
which checkpoints keep and exported models carry (`TokenizerIdentity`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field

from flatfsdp.data.byte_tokenizer import ByteTokenizer
from flatfsdp.data.sources import DataError

BYTES = "bytes"
"""``--tokenizer bytes``: `ByteTokenizer`."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A folder holding any of these holds a tokenizer."""
CARRIED_FILES = TOKENIZER_FILES + ("special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.txt",
                                   "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                                   "chat_template.json")
"""What a tokenizer folder may hold that from_pretrained reads: kept with checkpoints, written with exports."""

__all__ = ["BYTES", "ByteTokenizer", "HFTokenizer", "TokenizerIdentity", "has_tokenizer", "load_tokenizer",
           "same_tokenizer"]


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def _read_files(folder: str) -> dict[str, bytes]:
    found = {}
    for name in CARRIED_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[name] = f.read()
    return found


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer a run used: what its checkpoints remember (``record``) and
    carry (``files``), so `--load` can refuse another one and an export can
    write it beside the weights."""

    name: str
    """The folder (absolute), or "bytes"."""
    fingerprint: str
    """What it does (see the module docstring)."""
    sha256: str
    """What it is made of: a hash of its files' names and bytes."""
    vocab_size: int
    eos_id: int
    """The end-of-document id joining documents in training: what generation should stop at."""
    bos_id: int | None
    pad_id: int | None
    files: dict[str, bytes] = field(repr=False, compare=False)

    @classmethod
    def of(cls, tokenizer) -> "TokenizerIdentity":
        files = tokenizer.files()
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(f"{name}\0{len(files[name])}\0".encode())
            digest.update(files[name])
        return cls(tokenizer.name, tokenizer.fingerprint, digest.hexdigest(), tokenizer.vocab_size, tokenizer.eos_id,
                   tokenizer.bos_id, tokenizer.pad_id, files)

    def record(self) -> dict:
        """Everything but the files: small, for a checkpoint entry and log.json."""
        return {k: v for k, v in asdict(self).items() if k != "files"}


def same_tokenizer(saved: dict, now: TokenizerIdentity) -> bool:
    """The same files, or files that give the same ids (re-saved, or written by another version)."""
    return saved.get("sha256") == now.sha256 or saved.get("fingerprint") == now.fingerprint


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
        self.name = os.path.abspath(folder)
        self._files = _read_files(folder)  # now: the files this run tokenizes with, whatever happens to the folder
        self.vocab_size = len(self._tokenizer)
        """Ids run below this (added tokens included)."""
        self.eos_id = self._tokenizer.eos_token_id
        if self.eos_id is None:
            raise DataError(f"the tokenizer in {folder} has no end-of-sequence token to join documents with "
                            "(set eos_token in its tokenizer_config.json)")
        self.bos_id, self.pad_id = self._tokenizer.bos_token_id, self._tokenizer.pad_token_id
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

    def files(self) -> dict[str, bytes]:
        return self._files


def load_tokenizer(tokenizer: str | None, hf_model: str | None):
    """``--tokenizer DIR`` or ``bytes``, else the tokenizer inside ``--hf-model DIR``,
    else byte tokens. A model folder without a tokenizer is refused: training
    it on byte values as ids, unasked, would teach it another language."""
    if tokenizer == BYTES:
        return ByteTokenizer()
    if tokenizer:
        if not os.path.isdir(tokenizer) or not has_tokenizer(tokenizer):
            raise DataError(f"--tokenizer {tokenizer}: no tokenizer files there ({', '.join(TOKENIZER_FILES)}); "
                            f"pass a tokenizer folder, or {BYTES} for byte tokens")
        return HFTokenizer(tokenizer)
    if hf_model:
        if not has_tokenizer(hf_model):
            raise DataError(f"--hf-model {hf_model} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): pass "
                            f"--tokenizer DIR (the one the model was trained with), or --tokenizer {BYTES} to feed "
                            "it byte values as token ids")
        return HFTokenizer(hf_model)
    return ByteTokenizer()
