"""Checkpoint files: atomic, verified DCP checkpoints and tools to inspect,
export and import them. See docs/checkpoints.md.

`save`/`load` work with or without an initialised process group; `save(...,
async_save=True)` writes in the background (Note [async saves]); the tools
(`summarize`, `export_checkpoint`, `export_hf`, `import_state_dict`,
`convert_torch_dist_to_fsdp_dtensor`, the `flatfsdp checkpoint` command) run in
a single process; `summarize` and the exports also read Megatron-LM's fsdp_dtensor
checkpoints.
"""

from flatfsdp.checkpoint.async_save import AsyncSave, wait_for_saves_in_flight
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import export_checkpoint
from flatfsdp.checkpoint.hf_export import CONFIG_ENTRY as HF_CONFIG_ENTRY
from flatfsdp.checkpoint.hf_export import export_hf
from flatfsdp.checkpoint.hf_companions import companion_entries, read_tokenizer_record
from flatfsdp.checkpoint.import_ import import_state_dict
from flatfsdp.checkpoint.inspect import summarize
from flatfsdp.checkpoint.manifest import MANIFEST_NAME
from flatfsdp.checkpoint.save_load import check_save_target, load, save
from flatfsdp.checkpoint.staging import StagingBuffers
from flatfsdp.checkpoint.torch_dist_convert import convert_torch_dist_to_fsdp_dtensor

__all__ = ["AsyncSave", "CheckpointError", "HF_CONFIG_ENTRY", "MANIFEST_NAME", "check_save_target",
           "export_checkpoint", "export_hf", "import_state_dict", "load", "save", "StagingBuffers", "summarize",
           "wait_for_saves_in_flight", "companion_entries", "read_tokenizer_record",
           "convert_torch_dist_to_fsdp_dtensor"]
