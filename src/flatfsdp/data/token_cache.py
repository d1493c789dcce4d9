"""Tokenize once: the user's documents become two flat token files (training
and held-out), memory-mapped by every rank, in a cache keyed by the data's
content and the tokenizer.

Streaming: documents are read one at a time, encoded a batch at a time and
appended to the files, so memory stays bounded by one batch whatever the
corpus size. Documents are joined by the tokenizer's end-of-document id.
Ids are stored as uint16 when the vocabulary fits, else uint32.

The held-out split is by whole documents: document ``i`` (counted over all
sources in order) is held out when ``i % HOLD_OUT_EVERY == 1``, so any corpus of
two or more documents has one, and none is split between the two.

One process per cache folder tokenizes: the others block on a file lock and
then find the finished entry (the OS drops the lock if its holder dies, so
nobody waits on a crashed peer). An entry appears by one rename: complete or
not at all.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch

from flatfsdp.data.progress import progress_bar
from flatfsdp.data.sources import DataError, Source, check_source, documents, find_sources

FORMAT = "flatfsdp-tokens-v1"
HOLD_OUT_EVERY = 20
_BATCH_CHARS = 1 << 20
_BATCH_DOCS = 512
_FLUSH_TOKENS = 1 << 20
_HASH_CHUNK = 1 << 22


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flatfsdp", "tokens")


def _hash_file(digest, path: str) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)


def cache_key(sources: list[Source], field: str, tokenizer) -> str:
    """sha256 of the data's bytes (not its names or dates), the field and the tokenizer."""
    digest = hashlib.sha256(f"{FORMAT}|{field}|{tokenizer.fingerprint}".encode())
    for source in sources:
        files = [source.path] if source.kind != "datasets" else sorted(
            os.path.join(d, f) for d, _, names in os.walk(source.path) for f in names)
        for path in files:
            digest.update(f"|{source.kind}|{os.path.relpath(path, source.path)}|".encode())
            _hash_file(digest, path)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenFiles:
    directory: str
    meta: dict
    """What meta.json says: counts, dtype, vocabulary, end-of-document id, throughput."""

    def open(self, split: str) -> torch.Tensor:
        """The split's ids ("train" or "eval") as a 1-D memory-mapped tensor (uint16 or uint32)."""
        count = self.meta[f"{split}_tokens"]
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[self.meta["dtype"]]
        return torch.from_file(os.path.join(self.directory, f"{split}.bin"), shared=False, size=count, dtype=dtype)


class _Stream:
    """Append-only token file with a bounded in-memory tail."""

    def __init__(self, path: str, typecode: str):
        self.file = open(path, "wb")
        self.typecode = typecode
        self.buffer = array.array(typecode)
        self.tokens = self.documents = 0

    def append(self, ids: list[int], eos: int) -> None:
        self.buffer.extend(ids)
        self.buffer.append(eos)
        self.tokens += len(ids) + 1
        self.documents += 1
        if len(self.buffer) >= _FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        self.buffer.tofile(self.file)
        self.buffer = array.array(self.typecode)

    def close(self) -> None:
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _tokenize(sources, field, tokenizer, out_dir: str, show: bool) -> dict:
    wide = tokenizer.vocab_size > 1 << 16
    typecode = "I" if wide else "H"
    if array.array(typecode).itemsize != (4 if wide else 2):
        raise RuntimeError(f"array typecode {typecode!r} is not {4 if wide else 2} bytes on this platform")
    streams = {split: _Stream(os.path.join(out_dir, f"{split}.bin"), typecode) for split in ("train", "eval")}
    total = sum(s.size for s in sources)
    bar = progress_bar(total, "tokenizing", show)
    started, index = time.perf_counter(), 0
    texts, chars, consumed = [], 0, 0

    def encode() -> None:
        nonlocal index
        for ids in tokenizer.encode_batch(texts):
            split = "eval" if index % HOLD_OUT_EVERY == 1 else "train"
            streams[split].append(ids, tokenizer.eos_id)
            index += 1
        bar.update(consumed)
        texts.clear()

    try:
        for source in sources:
            for text, used in documents(source, field):
                texts.append(text)
                chars, consumed = chars + len(text), consumed + used
                if chars >= _BATCH_CHARS or len(texts) >= _BATCH_DOCS:
                    encode()
                    chars = consumed = 0
        if texts:
            encode()
    finally:
        bar.close()
        for stream in streams.values():
            stream.close()
    seconds = time.perf_counter() - started
    return {"format": FORMAT, "dtype": "uint32" if wide else "uint16", "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.name, "field": field,
            "sources": [s.path for s in sources], "bytes": total, "seconds": round(seconds, 3),
            "mb_per_s": round(total / max(seconds, 1e-9) / 1e6, 2),
            **{f"{split}_tokens": s.tokens for split, s in streams.items()},
            **{f"{split}_documents": s.documents for split, s in streams.items()}}


def _finished(directory: str) -> TokenFiles | None:
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return TokenFiles(directory, meta) if meta.get("format") == FORMAT else None


def prepare(paths: list[str], field: str, tokenizer, cache_dir: str | None = None, *,
            show_progress: bool = True, report: bool = True) -> TokenFiles:
    """The token files for ``paths``: found in the cache, else made now (by
    this process, or by another one holding the lock, whom this one waits for).
    ``report``: print one line saying which (False: the other processes of a node)."""
    sources = find_sources(paths)
    for source in sources:
        check_source(source, field)
    cache_dir = cache_dir or default_cache_dir()
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--data-cache {cache_dir} cannot be created ({exc.strerror or exc})") from None
    key = cache_key(sources, field, tokenizer)
    final = os.path.join(cache_dir, key[:40])
    if (found := _finished(final)) is not None:
        return _reused(found, paths, tokenizer, report)
    with open(os.path.join(cache_dir, f"{key[:40]}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by close (or by the OS if this process dies)
        if (found := _finished(final)) is not None:  # another process tokenized while this one waited
            return _reused(found, paths, tokenizer, report)
        partial = f"{final}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            meta = _tokenize(sources, field, tokenizer, partial, show_progress)
            if meta["train_documents"] + meta["eval_documents"] == 0:
                raise DataError(f"--data {' '.join(paths)}: holds no documents (every one is empty)")
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
            shutil.rmtree(final, ignore_errors=True)  # an unfinished entry left by a crash
            os.rename(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    if report:
        print(f"tokenized {meta['bytes'] / 1e6:.1f} MB of {' '.join(paths)} with tokenizer {tokenizer.name} into "
              f"{meta['train_tokens'] + meta['eval_tokens']:,} tokens ({meta['eval_documents']} of "
              f"{meta['train_documents'] + meta['eval_documents']} documents held out) in {meta['seconds']:.1f} s "
              f"({meta['mb_per_s']} MB/s); cached in {final}", file=sys.stderr, flush=True)
    return TokenFiles(final, meta)


def _reused(found: TokenFiles, paths: list[str], tokenizer, report: bool) -> TokenFiles:
    """A cache hit says what it used, as a miss does: silence would leave a
    user guessing which text and which tokenizer the run trained on."""
    meta = found.meta
    if report:
        print(f"using the cached tokens of {' '.join(paths)} with tokenizer {tokenizer.name}: "
              f"{meta['train_tokens'] + meta['eval_tokens']:,} tokens ({meta['eval_tokens']:,} held out) in "
              f"{found.directory}", file=sys.stderr, flush=True)
    return found
