"""Opening a checkpoint to read it, whichever program wrote it.

``inspect`` and ``export`` take flatfsdp's own checkpoints (verified against
their manifest, as before) and Megatron-LM's: an fsdp_dtensor folder, whether
stock Megatron-FSDP or flatfsdp was behind Megatron-LM when it was written, a
``--save`` folder whose tracker names one, and (``inspect`` only) a torch_dist
folder. Megatron-LM writes no manifest, so its checkpoints are read unverified
(foreign_read.py: every byte range the metadata names must exist; the metadata
unpickler is the same allowlist). A folder that is neither -- an interrupted
flatfsdp save with a ``.metadata`` but no manifest -- gets flatfsdp's refusal
as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flatfsdp.checkpoint import megatron_layout
from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.foreign_read import ForeignCheckpoint
from flatfsdp.checkpoint.manifest import MANIFEST_NAME
from flatfsdp.checkpoint.safe_read import METADATA_NAME, VerifiedReader
from flatfsdp.checkpoint.save_load import open_checkpoint

MODEL_PREFIX = {"flatfsdp": "model.", "fsdp_dtensor": megatron_layout.FSDP_DTENSOR_MODEL_PREFIX, "torch_dist": ""}
"""Where each format keeps the model's own state dict (what ``export`` writes by default)."""


@dataclass(frozen=True)
class Opened:
    reader: VerifiedReader
    directory: str
    format: str
    """flatfsdp, fsdp_dtensor or torch_dist (megatron_layout.DESCRIPTIONS)."""
    verified: bool
    """Whether a manifest vouches for every byte (flatfsdp's own, and converted checkpoints)."""

    @property
    def model_prefix(self) -> str:
        return MODEL_PREFIX[self.format]


def _megatron(directory: str) -> Opened | None:
    """A Megatron-LM checkpoint without a manifest, opened; None when ``directory`` is not one."""
    names = set(os.listdir(directory))
    if MANIFEST_NAME in names or not names & {METADATA_NAME, megatron_layout.TORCH_DIST_MARKER}:
        return None
    found = megatron_layout.checkpoint_format(directory)
    if found == "torch":
        raise CheckpointError(f"{directory} is {megatron_layout.DESCRIPTIONS['torch']}: not read here (convert it "
                              "to torch_dist with Megatron-LM's --ckpt-convert-format torch_dist first)")
    source = ForeignCheckpoint(directory, check_files=False)
    found = megatron_layout.checkpoint_format(directory, source.entries)
    if found not in ("torch_dist", "fsdp_dtensor"):
        return None  # an interrupted flatfsdp save, say: flatfsdp's own refusal names it
    source.check_files()
    return Opened(source.reader, directory, found, verified=False)


def open_any(path, *, hashes: bool = True) -> Opened:
    """The checkpoint at ``path`` (a folder of files, or a Megatron-LM ``--save`` folder), opened."""
    directory = os.path.abspath(os.fspath(path))
    if os.path.isdir(directory) and not os.path.exists(os.path.join(directory, MANIFEST_NAME)):
        located = megatron_layout.locate(directory)
        opened = _megatron(located.directory)
        if opened is not None:
            return opened
        directory = located.directory
    reader = open_checkpoint(directory, hashes=hashes)
    found = megatron_layout.checkpoint_format(directory, reader.read_metadata().state_dict_metadata)
    return Opened(reader, str(reader.path), "fsdp_dtensor" if found == "fsdp_dtensor" else "flatfsdp", True)


def refuse_torch_dist(opened: Opened, command: str) -> None:
    if opened.format == "torch_dist":
        raise megatron_layout.wrong_format(
            opened.directory, "torch_dist", "fsdp_dtensor",
            f"{command} reads layers one by one; convert it first: flatfsdp checkpoint convert --from torch_dist "
            f"--to fsdp_dtensor {opened.directory} OUT")
