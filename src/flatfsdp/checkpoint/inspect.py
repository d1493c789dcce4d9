"""What a checkpoint holds, from its DCP metadata alone (no tensor data is read): flatfsdp's
own, and Megatron-LM's fsdp_dtensor and torch_dist folders (open_any.py)."""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flatfsdp.checkpoint.open_any import open_any


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored_bytes(metadata: Metadata) -> dict[str, int]:
    """Bytes each entry occupies on disk (used for non-tensor values, which are pickles)."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        sizes[index.fqn] = sizes.get(index.fqn, 0) + info.length
    return sizes


def summarize(directory, *, verify_data: bool = False) -> dict:
    """Tensors (global shape, dtype, bytes) and non-tensor entries of the checkpoint at ``directory``.

    Sizes and the metadata hash are always checked; ``verify_data`` also hashes every data file.
    A checkpoint without a manifest (Megatron-LM's) has no hashes: ``verified`` says which it was.
    """
    opened = open_any(directory, hashes=verify_data)
    reader = opened.reader
    metadata = reader.read_metadata()
    stored = _stored_bytes(metadata)
    tensors, objects = [], []
    for name in sorted(metadata.state_dict_metadata):
        entry = metadata.state_dict_metadata[name]
        if isinstance(entry, TensorStorageMetadata):
            numel = 1
            for d in entry.size:
                numel *= d
            tensors.append({"name": name, "shape": list(entry.size), "dtype": _dtype_name(entry.properties.dtype),
                            "bytes": numel * entry.properties.dtype.itemsize})
        else:
            objects.append({"name": name, "stored_bytes": stored.get(name, 0)})
    return {"directory": opened.directory, "format": opened.format, "verified": opened.verified,
            "tensors": tensors, "objects": objects, "total_tensor_bytes": sum(t["bytes"] for t in tensors)}


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(summary: dict) -> str:
    rows = [(t["name"], str(tuple(t["shape"])), t["dtype"], f"{t['bytes']:,}")
            for t in summary["tensors"]]
    rows += [(o["name"], "-", "object", f"{o['stored_bytes']:,} (pickled)") for o in summary["objects"]]
    header = ("name", "shape", "dtype", "bytes")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>}" for r in [header, *rows]]
    total = summary["total_tensor_bytes"]
    if summary.get("format", "flatfsdp") != "flatfsdp" or not summary.get("verified", True):
        vouched = "verified by its manifest" if summary.get("verified") else "no manifest: sizes checked, not hashes"
        lines.insert(0, f"{summary['directory']}: {summary['format']} ({vouched})")
    lines.append(f"total: {len(summary['tensors'])} tensors, {total:,} bytes ({_human(total)}); "
                 f"{len(summary['objects'])} non-tensor entries")
    return "\n".join(lines)
