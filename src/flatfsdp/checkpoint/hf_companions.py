"""What a Hugging Face model folder holds beside the weights and config.json:
the tokenizer the run trained with, and generation_config.json.

`flatfsdp train` saves, with every checkpoint, which tokenizer it used (the
``tokenizer`` entry: its name, content hash and special ids) and the
tokenizer's files themselves (``tokenizer_files``) -- a copy, so the export
does not depend on a folder that may have moved or changed since -- and the
``--hf-model`` folder's generation_config.json when it had one. An export
writes them out (the generation settings with the tokenizer's special ids), so ``from_pretrained`` loads the model *and* its tokenizer,
``generate`` stops at the end-of-document token training used, and the folder
fine-tunes again with no file copied by hand.
"""

from __future__ import annotations

import base64
import json
import os

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.export import _load_batch
from flatfsdp.checkpoint.save_load import open_checkpoint

TOKENIZER_ENTRY = "tokenizer"
"""Checkpoint entry: which tokenizer the run used, as JSON (name, fingerprint, sha256, vocab_size, eos_id, ...)."""
TOKENIZER_FILES_ENTRY = "tokenizer_files"
"""Checkpoint entry: the tokenizer's files, as JSON {file name: base64 of its bytes}."""
GENERATION_CONFIG_ENTRY = "hf_generation_config"
"""Checkpoint entry: the --hf-model folder's generation_config.json, as it was."""


def companion_entries(tokenizer: dict, files: dict[str, bytes], generation_config: str | None = None) -> dict:
    """The entries a training run saves with its checkpoints (JSON strings):
    ``tokenizer`` a record of the tokenizer, ``files`` its files' bytes."""
    entries = {TOKENIZER_ENTRY: json.dumps(tokenizer, sort_keys=True),
               TOKENIZER_FILES_ENTRY: json.dumps({name: base64.b64encode(data).decode("ascii")
                                                  for name, data in sorted(files.items())})}
    if generation_config is not None:
        entries[GENERATION_CONFIG_ENTRY] = generation_config
    return entries


def _read_json_entries(reader, metadata, names: list[str]) -> dict:
    present = [name for name in names if name in metadata.state_dict_metadata]
    loaded = _load_batch(reader, [(name, name, None) for name in present]) if present else {}
    values = {}
    for name, text in loaded.items():
        try:
            values[name] = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{reader.path}: entry {name!r} is not JSON ({exc})") from None
    return values


def read_tokenizer_record(directory) -> dict | None:
    """Which tokenizer the checkpoint's run used (None: it does not say -- an
    older checkpoint, or one not written by flatfsdp train)."""
    reader = open_checkpoint(directory)
    return _read_json_entries(reader, reader.read_metadata(), [TOKENIZER_ENTRY]).get(TOKENIZER_ENTRY)


def _generation_config(record: dict | None, hf_config: dict, source: dict | None) -> dict:
    """The --hf-model folder's generation settings (``source``, if it had
    them), with the special ids of the tokenizer training used: generation must
    stop at the end-of-document id documents were joined with, whatever the
    model's config says (a LlamaConfig's defaults say 1 and 2, which mean
    nothing to a tokenizer of its own). A chat model's list of stop ids is
    kept when it holds that id."""
    values = {k: v for k, v in (source or {}).items() if k != "_from_model_config"}  # not derived any more
    record = record or {}
    for ours, theirs in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"), ("pad_id", "pad_token_id")):
        if record.get(ours) is not None:
            if not (theirs == "eos_token_id" and isinstance(values.get(theirs), list)
                    and record[ours] in values[theirs]):
                values[theirs] = record[ours]
        elif theirs not in values and hf_config.get(theirs) is not None:
            values[theirs] = hf_config[theirs]
    if values.get("pad_token_id") is None and values.get("eos_token_id") is not None:
        # A pad id keeps generate() from guessing one (and saying so) for a tokenizer without one.
        eos = values["eos_token_id"]
        values["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return values


def write_companions(reader, metadata, folder: str, hf_config: dict) -> dict:
    """Write the tokenizer's files and generation_config.json into ``folder``
    (the export's folder before it is published). Returns {"tokenizer": the
    record or None, "tokenizer_files": the tokenizer files written}."""
    entries = _read_json_entries(reader, metadata, [TOKENIZER_ENTRY, TOKENIZER_FILES_ENTRY, GENERATION_CONFIG_ENTRY])
    record, files = entries.get(TOKENIZER_ENTRY), entries.get(TOKENIZER_FILES_ENTRY) or {}
    for name, encoded in sorted(files.items()):
        if os.path.basename(name) != name or name.startswith("."):  # a file name, never a path out of the folder
            raise CheckpointError(f"{reader.path}: entry {TOKENIZER_FILES_ENTRY!r} names a file {name!r}")
        with open(os.path.join(folder, name), "wb") as f:
            f.write(base64.b64decode(encoded))
            f.flush()
            os.fsync(f.fileno())
    generation = _generation_config(record, hf_config, entries.get(GENERATION_CONFIG_ENTRY))
    write_json(os.path.join(folder, "generation_config.json"), generation)
    return {"tokenizer": record, "tokenizer_files": sorted(files)}


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
