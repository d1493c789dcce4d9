"""`flatfsdp checkpoint {inspect,export,import,convert}`: checkpoint tools that need no process group
(their flags: flatfsdp.cli.checkpoint_flags).

Problems with the checkpoint (missing, incomplete, corrupted, unreadable) print
one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import json

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import export_checkpoint
from flatfsdp.checkpoint.hf_export import export_hf
from flatfsdp.checkpoint.import_ import import_state_dict
from flatfsdp.checkpoint.inspect import format_table, summarize
from flatfsdp.checkpoint.torch_dist_convert import convert_torch_dist_to_fsdp_dtensor
from flatfsdp.cli.checkpoint_flags import PROG, parse
from flatfsdp.cli.flags import fail, parse_or_exit


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
              f"file(s), config.json, generation_config.json and {_tokenizer_written(counts)} to "
              f"{args.output}{adapters}")
        return
    counts = export_checkpoint(args.directory, args.output, prefix=prefix, budget_bytes=args.budget_mib << 20)
    objects = f" and {counts['objects']} non-tensor entries" if counts["objects"] else ""
    skipped = (f"; skipped {counts['skipped_objects']} non-tensor entries (safetensors holds tensors only)"
               if counts["skipped_objects"] else "")
    print(f"wrote {counts['tensors']} tensors ({counts['bytes']:,} bytes){objects} to {args.output}{skipped}")


def _tokenizer_written(counts: dict) -> str:
    record = counts["tokenizer"]
    if record is None:
        return ("no tokenizer: the checkpoint does not say which one its run used (saved by an older flatfsdp, or "
                "not by flatfsdp train); copy the model's tokenizer files into the folder yourself")
    return f"the tokenizer the run trained with ({record['name']}: {', '.join(counts['tokenizer_files'])})"


def _import(args) -> None:
    count = import_state_dict(args.file, args.directory, prefix=args.prefix)
    print(f"wrote a checkpoint of {count} tensors (keys prefixed {args.prefix!r}) to {args.directory}")


def _convert(args) -> None:
    report = convert_torch_dist_to_fsdp_dtensor(args.source, args.output, transformer_impl=args.transformer_impl,
                                                swiglu=args.swiglu, model_only=args.model_only)
    optimizer = (f"optimizer state ({', '.join(report['optimizer_states'])}, step, groups)"
                 if report["optimizer_states"] else "no optimizer state (resume with --no-load-optim)")
    print(f"wrote iteration {report['iteration']} as fsdp_dtensor: {report['parameters']} parameters, {optimizer}, "
          f"{len(report['skipped'])} entries left out; layer norms named for --transformer-impl "
          f"{report['layer_norm_names']}, gated MLP {'split' if report['gated'] else 'not split'}, optimizer names "
          f"{'with' if report['float16_module'] else 'without'} Float16Module -> {report['output']} "
          f"(Megatron-LM: --load {args.output} --ckpt-format fsdp_dtensor --use-megatron-fsdp)")


def main(argv: list[str] | None = None) -> None:
    run_args(parse_or_exit(parse, argv, PROG))


def run_args(args) -> None:
    """The tool on a parsed command line (flatfsdp.cli.checkpoint_flags)."""
    handlers = {"inspect": _inspect, "export": _export, "import": _import, "convert": _convert}
    try:
        handlers[args.command](args)
    except (CheckpointError, OSError) as exc:
        fail(f"{PROG} {args.command}", " ".join(str(exc).split()))  # one line, even for multi-line reports


if __name__ == "__main__":
    main()
