"""The manifest that marks a checkpoint directory complete and pins its bytes.

`flatfsdp-manifest.json` lists every other file in the directory with its size
and sha256. It is written last, after all ranks finished writing, so a
directory without it is an interrupted save (see `atomic.py`). Readers check
sizes (cheap) and hashes (a full read) before handing files to DCP.
"""

from __future__ import annotations

import hashlib
import json
import os

from flatfsdp.checkpoint.errors import CheckpointError

MANIFEST_NAME = "flatfsdp-manifest.json"
FORMAT_NAME = "flatfsdp-dcp-checkpoint"
FORMAT_VERSION = 1
_CHUNK = 8 << 20


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _data_files(directory: str) -> list[str]:
    """Relative paths of every file under ``directory`` except the manifest."""
    found = []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != MANIFEST_NAME:
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def describe_files(directory: str, names) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of files under ``directory``, read back from disk."""
    out = {}
    for rel in sorted(names):
        path = os.path.join(directory, rel)
        out[rel] = {"size": os.path.getsize(path), "sha256": sha256_of(path)}
    return out


def write_manifest(directory: str, described: dict[str, dict] | None = None) -> dict:
    """Write the manifest of every file in ``directory`` durably (fsync).

    ``described``: entries already hashed by the ranks that wrote those files
    (each rank reads its own files back after fsync, so the hashing is spread
    over the ranks); every other file is hashed here. A described file that is
    missing or whose size differs on disk is an error: the manifest never
    vouches for bytes nobody read."""
    described = described or {}
    present = _data_files(directory)
    absent = sorted(set(described) - set(present))
    if absent:
        raise CheckpointError(f"{os.path.join(directory, absent[0])}: written by a rank but missing at commit")
    files = describe_files(directory, [rel for rel in present if rel not in described])
    for rel, entry in described.items():
        size = os.path.getsize(os.path.join(directory, rel))
        if size != entry["size"]:
            raise CheckpointError(f"{os.path.join(directory, rel)}: {size} bytes at commit, but {entry['size']} "
                                  "when the rank that wrote it hashed it")
        files[rel] = dict(entry)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "files": files}
    with open(os.path.join(directory, MANIFEST_NAME), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(directory: str) -> dict[str, dict]:
    """The manifest's ``{relative path: {"size", "sha256"}}``; raises if not a complete checkpoint."""
    if not os.path.exists(directory):
        raise CheckpointError(f"no checkpoint at {directory}: the directory does not exist")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a checkpoint: it is a file, not a directory")
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{directory} is not a complete flatfsdp checkpoint: {MANIFEST_NAME} is missing "
            "(an interrupted save, or a directory not written by flatfsdp.checkpoint.save)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files, version = manifest["files"], manifest["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupted manifest ({exc})") from None
    if manifest.get("format") != FORMAT_NAME or not isinstance(version, int):
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} manifest")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this flatfsdp "
                              f"understands ({FORMAT_VERSION}); upgrade flatfsdp")
    return files


def verify_files(directory: str, files: dict[str, dict], names=None, *, hashes: bool = True) -> None:
    """Check that ``names`` (default: all) have the manifest's size and, if ``hashes``, sha256."""
    for rel in sorted(files if names is None else names):
        path = os.path.join(directory, rel)
        expected = files[rel]
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing, but listed in the checkpoint manifest")
        size = os.path.getsize(path)
        if size != expected["size"]:
            raise CheckpointError(f"{path}: truncated or corrupted ({size} bytes, "
                                  f"the manifest says {expected['size']})")
        if hashes and sha256_of(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: truncated or corrupted (sha256 differs from the manifest)")
