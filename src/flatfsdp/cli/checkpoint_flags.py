"""`flatfsdp checkpoint {inspect,export,import,convert}`'s flags: parsed before torch
is imported (flatfsdp.checkpoint.cli runs the tools)."""

from __future__ import annotations

import argparse

from flatfsdp.cli import flags

PROG = "flatfsdp checkpoint"


def build_parser() -> argparse.ArgumentParser:
    parser = flags.CommandParser(prog=PROG, description="Inspect, export and import flatfsdp checkpoints, read "
                                                        "Megatron-LM's, and convert Megatron-Core's torch_dist "
                                                        "format to fsdp_dtensor (no process group needed). See "
                                                        "docs/checkpoints.md.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,export,import,convert}")
    inspect = commands.add_parser("inspect", help="list tensors (global shape, dtype, bytes) and other entries",
                                  description="List a checkpoint's tensors (global shape, dtype, bytes) and other "
                                              "entries: flatfsdp's, or Megatron-LM's fsdp_dtensor or torch_dist "
                                              "(its --save folder or an iter_* folder).")
    inspect.add_argument("directory", help="the checkpoint")
    inspect.add_argument("--json", action="store_true", help="print JSON (default: a table)")
    inspect.add_argument("--verify", action="store_true", help="also check every file's sha256 (reads all data)")
    export = commands.add_parser("export", help="consolidate into one .safetensors (streamed) or .pt file, or a "
                                                "Hugging Face model directory with its tokenizer (--format hf)",
                                 description="Consolidate a checkpoint into one .safetensors (streamed) or .pt "
                                             "file, or a Hugging Face model directory (--format hf): config.json, "
                                             "generation_config.json, safetensors shards and the tokenizer the "
                                             "run trained with.")
    export.add_argument("directory", help="the checkpoint (flatfsdp's, or Megatron-LM's fsdp_dtensor)")
    export.add_argument("output", help="OUT.safetensors or OUT.pt; with --format hf a new directory")
    export.add_argument("--format", choices=["file", "hf"], default="file",
                        help="hf: a folder transformers' from_pretrained loads, model and tokenizer (a Megatron-Core "
                             "GPTModel as GPT-2)")
    export.add_argument("--config", metavar="PATH",
                        help="--format hf: the model's config.json (default: the one the checkpoint holds, saved "
                             "by flatfsdp train --hf-model; for a Megatron-Core GPTModel, GPT-2's, made from the "
                             "run's own arguments)")
    export.add_argument("--max-shard-mib", type=int, default=4096, metavar="MIB",
                        help="--format hf: largest safetensors file before splitting, with an index")
    export.add_argument("--prefix", default=None,
                        help="export keys starting with this, with it removed from the names (default: where the "
                             "checkpoint keeps the model: model., or model.module. in Megatron-LM's fsdp_dtensor)")
    export.add_argument("--all", action="store_true", help="export every entry under its full name")
    export.add_argument("--budget-mib", type=int, default=1024, metavar="MIB", help="memory for tensors in flight")
    imp = commands.add_parser("import", help="turn a .safetensors/.pt state dict into a checkpoint",
                              description="Turn a .safetensors/.pt state dict into a checkpoint.")
    imp.add_argument("file", help="the .safetensors or .pt file")
    imp.add_argument("directory", help="the checkpoint to write")
    imp.add_argument("--prefix", default="model.", help="prepended to every key")
    _add_convert(commands)
    return parser


def _add_convert(commands) -> None:
    convert = commands.add_parser(
        "convert", help="a Megatron-Core torch_dist checkpoint as the fsdp_dtensor one a Megatron-FSDP run resumes",
        description="Write a torch_dist checkpoint of Megatron-LM (a tensor/pipeline/data-parallel run without "
                    "Megatron-FSDP) as the fsdp_dtensor checkpoint Megatron-LM's load_checkpoint resumes under "
                    "--use-megatron-fsdp: weights, optimizer moments and step, optimizer groups, iteration, "
                    "LR scheduler, RNG state and the run's arguments. One process, any machine, Megatron not "
                    "needed; the output appears complete or not at all.")
    convert.add_argument("source", help="the torch_dist checkpoint: Megatron-LM's --save folder or an iter_* folder")
    convert.add_argument("output", help="the folder to write, which must not exist or be empty (then: --load OUTPUT)")
    convert.add_argument("--from", dest="from_format", choices=["torch_dist"], default="torch_dist",
                         help="the source's format (a folder of another format is refused, naming what it is)")
    convert.add_argument("--to", dest="to_format", choices=["fsdp_dtensor"], default="fsdp_dtensor",
                         help="the output's format")
    convert.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                         help="the layer spec of the model that resumes (default: the run's own "
                              "--transformer-impl, saved in the checkpoint); local names the layer norms "
                              "input_layernorm / pre_mlp_layernorm")
    convert.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=None,
                         help="split each fused linear_fc1 into its gate and value halves (default: the run's own "
                              "--swiglu, saved in the checkpoint)")
    convert.add_argument("--model-only", action="store_true",
                         help="the weights without optimizer state (resume with --no-load-optim or --finetune); "
                              "needed for optimizer state saved in the distributed optimizer's flat buckets")


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)
