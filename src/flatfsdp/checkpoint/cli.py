"""`flatfsdp checkpoint {inspect,export,import}`: checkpoint tools that need no process group.

Problems with the checkpoint (missing, incomplete, corrupted, unreadable) print
one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import export_checkpoint
from flatfsdp.checkpoint.hf_export import export_hf
from flatfsdp.checkpoint.import_ import import_state_dict
from flatfsdp.checkpoint.inspect import format_table, summarize


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flatfsdp checkpoint",
                                     description="Inspect, export and import flatfsdp checkpoints (no process group needed).")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list tensors (global shape, dtype, bytes) and other entries")
    inspect.add_argument("directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument("--verify", action="store_true", help="also check every file's sha256 (reads all data)")
    export = commands.add_parser("export", help="consolidate into one .safetensors (streamed) or .pt file, "
                                                "or a Hugging Face model directory (--format hf)")
    export.add_argument("directory")
    export.add_argument("output", help="OUT.safetensors or OUT.pt; with --format hf a new directory")
    export.add_argument("--format", choices=["file", "hf"], default="file",
                        help="hf: config.json and safetensors shards that transformers' from_pretrained loads")
    export.add_argument("--config", help="--format hf: the model's config.json (default: the one the "
                                         "checkpoint holds, saved by flatfsdp train --hf-model)")
    export.add_argument("--max-shard-mib", type=int, default=4096,
                        help="--format hf: largest safetensors file before splitting, with an index (default 4096)")
    export.add_argument("--prefix", default="model.",
                        help="export keys starting with this, with it removed from the names (default: model.)")
    export.add_argument("--all", action="store_true", help="export every entry under its full name")
    export.add_argument("--budget-mib", type=int, default=1024, help="memory for tensors in flight (default 1024)")
    imp = commands.add_parser("import", help="turn a .safetensors/.pt state dict into a checkpoint")
    imp.add_argument("file")
    imp.add_argument("directory")
    imp.add_argument("--prefix", default="model.", help="prepended to every key (default: model.)")
    return parser


def _inspect(args) -> None:
    summary = summarize(args.directory, verify_data=args.verify)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))


def _export(args) -> None:
    prefix = "" if args.all else args.prefix
    if args.format == "hf":
        counts = export_hf(args.directory, args.output, config=args.config, prefix=prefix,
                           max_shard_bytes=args.max_shard_mib << 20, budget_bytes=args.budget_mib << 20)
        adapters = (f"; LoRA adapters merged into the weights, and also written alone ({counts['adapters']} "
                    f"tensors) as a PEFT folder: {args.output}/adapter" if counts.get("adapters") else "")
        print(f"wrote {counts['tensors']} tensors ({counts['bytes']:,} bytes) in {counts['files']} safetensors "
              f"file(s) and config.json to {args.output}{adapters}")
        return
    counts = export_checkpoint(args.directory, args.output, prefix=prefix, budget_bytes=args.budget_mib << 20)
    objects = f" and {counts['objects']} non-tensor entries" if counts["objects"] else ""
    skipped = (f"; skipped {counts['skipped_objects']} non-tensor entries (safetensors holds tensors only)"
               if counts["skipped_objects"] else "")
    print(f"wrote {counts['tensors']} tensors ({counts['bytes']:,} bytes){objects} to {args.output}{skipped}")


def _import(args) -> None:
    count = import_state_dict(args.file, args.directory, prefix=args.prefix)
    print(f"wrote a checkpoint of {count} tensors (keys prefixed {args.prefix!r}) to {args.directory}")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    handlers = {"inspect": _inspect, "export": _export, "import": _import}
    try:
        handlers[args.command](args)
    except (CheckpointError, OSError) as exc:
        message = " ".join(str(exc).split())  # one line, even for multi-line reports
        print(f"flatfsdp checkpoint {args.command}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
