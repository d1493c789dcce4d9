"""`flatfsdp checkpoint {inspect,export,import}`'s flags: parsed before torch
is imported (flatfsdp.checkpoint.cli runs the tools)."""

from __future__ import annotations

import argparse

from flatfsdp.cli import flags

PROG = "flatfsdp checkpoint"


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(prog=PROG, description="Inspect, export and import flatfsdp checkpoints (no "
                                                        "process group needed). See docs/checkpoints.md.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,export,import}")
    inspect = commands.add_parser("inspect", help="list tensors (global shape, dtype, bytes) and other entries",
                                  description="List a checkpoint's tensors (global shape, dtype, bytes) and other "
                                              "entries.")
    inspect.add_argument("directory", help="the checkpoint")
    inspect.add_argument("--json", action="store_true", help="print JSON (default: a table)")
    inspect.add_argument("--verify", action="store_true", help="also check every file's sha256 (reads all data)")
    export = commands.add_parser("export", help="consolidate into one .safetensors (streamed) or .pt file, or a "
                                                "Hugging Face model directory with its tokenizer (--format hf)",
                                 description="Consolidate a checkpoint into one .safetensors (streamed) or .pt "
                                             "file, or a Hugging Face model directory (--format hf): config.json, "
                                             "generation_config.json, safetensors shards and the tokenizer the "
                                             "run trained with.")
    export.add_argument("directory", help="the checkpoint")
    export.add_argument("output", help="OUT.safetensors or OUT.pt; with --format hf a new directory")
    export.add_argument("--format", choices=["file", "hf"], default="file",
                        help="hf: a folder transformers' from_pretrained loads, model and tokenizer")
    export.add_argument("--config", metavar="PATH",
                        help="--format hf: the model's config.json (default: the one the checkpoint holds, saved "
                             "by flatfsdp train --hf-model)")
    export.add_argument("--max-shard-mib", type=int, default=4096, metavar="MIB",
                        help="--format hf: largest safetensors file before splitting, with an index")
    export.add_argument("--prefix", default="model.",
                        help="export keys starting with this, with it removed from the names")
    export.add_argument("--all", action="store_true", help="export every entry under its full name")
    export.add_argument("--budget-mib", type=int, default=1024, metavar="MIB", help="memory for tensors in flight")
    imp = commands.add_parser("import", help="turn a .safetensors/.pt state dict into a checkpoint",
                              description="Turn a .safetensors/.pt state dict into a checkpoint.")
    imp.add_argument("file", help="the .safetensors or .pt file")
    imp.add_argument("directory", help="the checkpoint to write")
    imp.add_argument("--prefix", default="model.", help="prepended to every key")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)
