"""The user's text for `flatfsdp train --data`: which files, and their documents
one at a time (streamed: a file is never read whole into memory).

Accepted: ``.txt`` (documents are paragraphs, separated by blank lines),
``.jsonl`` (one JSON object per line, the document in a string field),
``.parquet`` (a string column), folders of those (searched recursively, in
name order), and a folder written by ``datasets``' ``save_to_disk``. Every
problem a user can fix -- a missing or empty file, a binary file, a missing
field -- raises `DataError` naming the file (and line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
PARAGRAPH_LIMIT = 1 << 20
"""A .txt paragraph longer than this (bytes) is cut at a line boundary, so memory stays bounded."""
_SNIFF = 1 << 16


class DataError(ValueError):
    """A problem with the user's data, for the command to print as one line."""


@dataclass(frozen=True)
class Source:
    path: str
    kind: str
    """"txt", "jsonl", "parquet" or "datasets" (a save_to_disk folder)."""
    size: int
    """Bytes on disk (for a datasets folder: its .arrow files), the unit of progress."""


def is_datasets_folder(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name))
                                       for name in ("dataset_dict.json", "state.json"))


def find_sources(paths: list[str]) -> list[Source]:
    """Every data file the paths name, in a fixed order; raises DataError for
    a missing path, an unknown kind, an empty file or a folder with nothing usable."""
    found: list[Source] = []
    for path in paths:
        if not os.path.exists(path):
            raise DataError(f"--data {path}: no such file or directory")
        if is_datasets_folder(path):
            arrow = [os.path.join(d, f) for d, _, files in os.walk(path) for f in files if f.endswith(".arrow")]
            found.append(Source(path, "datasets", sum(os.path.getsize(f) for f in arrow)))
        elif os.path.isdir(path):
            inside = [_file_source(os.path.join(d, f)) for d, dirs, files in sorted(os.walk(path))
                      for f in sorted(files) if os.path.splitext(f)[1] in SUFFIXES and not f.startswith(".")]
            if not inside:
                raise DataError(f"--data {path}: the folder holds no {', '.join(SUFFIXES)} files "
                                "(nor is it a datasets save_to_disk folder)")
            found.extend(inside)
        else:
            suffix = os.path.splitext(path)[1]
            if suffix not in SUFFIXES:
                raise DataError(f"--data {path}: unknown kind of file {suffix or '(no suffix)'!r}: "
                                f"use {', '.join(SUFFIXES)}, a folder of them or a datasets save_to_disk folder")
            found.append(_file_source(path))
    return found


def _file_source(path: str) -> Source:
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"--data {path}: the file is empty")
    return Source(path, SUFFIXES[os.path.splitext(path)[1]], size)


def check_source(source: Source, field: str) -> None:
    """The cheap checks, before any tokenizing: text files are UTF-8 text (not
    binary), a jsonl's first record has the field, a table has the column."""
    if source.kind in ("txt", "jsonl"):
        with open(source.path, "rb") as f:
            head = f.read(_SNIFF)
        if b"\0" in head or not _decodes(head):
            raise DataError(f"--data {source.path}: a binary file, not UTF-8 text")
        if source.kind == "jsonl":
            with open(source.path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        _jsonl_text(line, field, source.path, number)
                        return
            raise DataError(f"--data {source.path}: holds no JSON lines")
    elif source.kind == "parquet":
        _columns_hold(_parquet(source.path).schema_arrow.names, field, source.path)
    else:
        _columns_hold(_datasets(source.path).column_names, field, source.path)


def _decodes(head: bytes) -> bool:
    for cut in range(4):  # the sniffed block may end inside a multi-byte character
        try:
            head[:len(head) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def _columns_hold(columns: list[str], field: str, path: str) -> None:
    if field not in columns:
        raise DataError(f"--data {path}: no column {field!r} (columns: {', '.join(columns)}); "
                        "choose one with --data-field NAME")


def documents(source: Source, field: str) -> Iterator[tuple[str, int]]:
    """(document text, bytes of the source consumed since the last document):
    the second figure drives the progress bar. Empty documents are skipped."""
    reader = {"txt": _txt, "jsonl": _jsonl, "parquet": _parquet_docs, "datasets": _datasets_docs}[source.kind]
    yield from reader(source, field)


def _decode_line(raw: bytes, path: str, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"--data {path} line {number}: not UTF-8 text (a binary file?)") from None


def _txt(source: Source, field: str) -> Iterator[tuple[str, int]]:
    lines: list[str] = []
    held = consumed = 0
    with open(source.path, "rb") as f:
        for number, raw in enumerate(f, 1):
            consumed += len(raw)
            if b"\0" in raw:
                raise DataError(f"--data {source.path} line {number}: a NUL byte (a binary file?)")
            blank = not raw.strip()
            if not blank:
                lines.append(_decode_line(raw, source.path, number))
                held += len(raw)
            if lines and (blank or held >= PARAGRAPH_LIMIT):
                yield "".join(lines).strip("\n"), consumed
                lines, held, consumed = [], 0, 0
    if lines:
        yield "".join(lines).strip("\n"), consumed


def _jsonl_text(raw: bytes, field: str, path: str, number: int) -> str:
    try:
        record = json.loads(_decode_line(raw, path, number))
    except json.JSONDecodeError as exc:
        raise DataError(f"--data {path} line {number} column {exc.colno}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"--data {path} line {number}: no field {field!r} (it has: {fields}); "
                        "choose one with --data-field NAME")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"--data {path} line {number}: field {field!r} is {type(text).__name__}, not text")
    return text


def _jsonl(source: Source, field: str) -> Iterator[tuple[str, int]]:
    consumed = 0
    with open(source.path, "rb") as f:
        for number, raw in enumerate(f, 1):
            consumed += len(raw)
            if raw.strip():
                text = _jsonl_text(raw, field, source.path, number)
                if text:
                    yield text, consumed
                    consumed = 0


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--data {path}: reading parquet needs pyarrow: pip install 'flatfsdp[data]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors share no useful base class
        raise DataError(f"--data {path}: not a readable parquet file ({exc})") from None


def _table_docs(batches, rows: int, size: int, field: str) -> Iterator[tuple[str, int]]:
    """Documents of record batches holding ``rows`` rows in all; progress is
    the source's size shared out over its rows."""
    done = reported = 0
    for batch in batches:
        for text in batch.column(field).to_pylist() if hasattr(batch, "column") else batch[field]:
            done += 1
            if isinstance(text, str) and text:
                share = size * done // max(rows, 1)
                yield text, share - reported
                reported = share


def _parquet_docs(source: Source, field: str) -> Iterator[tuple[str, int]]:
    table = _parquet(source.path)
    _columns_hold(table.schema_arrow.names, field, source.path)
    yield from _table_docs(table.iter_batches(batch_size=1024, columns=[field]), table.metadata.num_rows,
                           source.size, field)


def _datasets(path: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {path}: a datasets folder needs the datasets package: "
                        "pip install 'flatfsdp[data]'") from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise DataError(f"--data {path}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); "
                        "pass the split's own folder")
    return loaded


def _datasets_docs(source: Source, field: str) -> Iterator[tuple[str, int]]:
    dataset = _datasets(source.path)
    _columns_hold(dataset.column_names, field, source.path)
    yield from _table_docs(dataset.select_columns([field]).iter(batch_size=1024), len(dataset), source.size, field)
