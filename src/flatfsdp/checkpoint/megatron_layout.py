"""Where a Megatron-LM checkpoint is, and which format it is in.

Megatron-LM's ``--save DIR`` holds ``latest_checkpointed_iteration.txt`` (the
iteration, or ``release``) and one folder per save, ``iter_0000002``. The
folder's format decides who can read it:

* ``torch_dist`` -- Megatron-Core's dist_checkpointing (what a tensor/pipeline/
  data-parallel run without Megatron-FSDP writes): ``metadata.json`` naming the
  ``torch_dist`` backend, beside a DCP ``.metadata``; layers stacked into one
  tensor per name, optimizer state under ``optimizer.state.<state>.<name>``.
* ``fsdp_dtensor`` -- what Megatron-FSDP runs write (``--ckpt-format fsdp_dtensor``):
  a plain DCP folder with ``args``, ``iteration`` and ``model.module.<name>``
  per layer.
* ``flatfsdp`` -- ``flatfsdp.checkpoint.save``'s DCP folder with its manifest.
* ``torch`` -- Megatron-LM's legacy per-rank ``mp_rank_*`` files.

Any path a user may hand over is accepted: the ``--save`` folder, an
``iter_*`` folder, or a checkpoint folder of another layout.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.manifest import MANIFEST_NAME
from flatfsdp.checkpoint.safe_read import METADATA_NAME

TRACKER_NAME = "latest_checkpointed_iteration.txt"
TORCH_DIST_MARKER = "metadata.json"
FSDP_DTENSOR_MODEL_PREFIX = "model.module."
_ITER_DIR = re.compile(r"iter_(\d+)")

DESCRIPTIONS = {
    "torch_dist": "a torch_dist checkpoint (Megatron-Core's dist_checkpointing format: metadata.json names the "
                  "torch_dist backend; what runs without Megatron-FSDP write)",
    "fsdp_dtensor": "an fsdp_dtensor checkpoint (Megatron-LM's DCP format of Megatron-FSDP runs: entries args, "
                    "iteration and model.module.*)",
    "flatfsdp": f"a flatfsdp checkpoint (flatfsdp.checkpoint.save's DCP folder with {MANIFEST_NAME})",
    "torch": "a legacy Megatron-LM torch checkpoint (mp_rank_* files)",
    "dcp": "a DCP checkpoint that is neither Megatron-LM's fsdp_dtensor nor flatfsdp's",
}


@dataclass(frozen=True)
class CheckpointPath:
    directory: str
    """The folder holding the checkpoint's files (an ``iter_*`` folder for Megatron-LM)."""
    root: str | None
    """The ``--save`` folder with the tracker file, when the user gave that."""
    iteration: int | str | None
    """The iteration the tracker or the folder name says (``"release"``), if any."""


def locate(path) -> CheckpointPath:
    """The checkpoint folder ``path`` designates: itself, or the iteration its tracker file names."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: it is a file, not a directory")
    tracker = os.path.join(path, TRACKER_NAME)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if text == "release":
            name, iteration = "release", "release"
        elif text.isdigit():
            name, iteration = f"iter_{int(text):07d}", int(text)
        else:
            raise CheckpointError(f"{tracker}: not an iteration number ({text[:40]!r})")
        directory = os.path.join(path, name)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{tracker} names iteration {text}, but {directory} does not exist")
        return CheckpointPath(directory, path, iteration)
    match = _ITER_DIR.fullmatch(os.path.basename(path))
    return CheckpointPath(path, None, int(match.group(1)) if match else None)


def _torch_dist_backend(directory: str) -> str | None:
    path = os.path.join(directory, TORCH_DIST_MARKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            backend = json.load(f)["sharded_backend"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not Megatron-Core's checkpoint marker ({exc})") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded backend {backend!r}; only torch_dist checkpoints are read")
    return backend


def checkpoint_format(directory: str, entry_names=None) -> str:
    """One of DESCRIPTIONS' keys. ``entry_names``: the DCP metadata's entries, when read already
    (needed to tell fsdp_dtensor from other DCP folders)."""
    if _torch_dist_backend(directory):
        return "torch_dist"
    names = os.listdir(directory)
    if any(n.startswith("mp_rank_") for n in names):
        return "torch"
    if METADATA_NAME not in names:
        raise CheckpointError(f"{directory} is not a checkpoint: it holds neither {TORCH_DIST_MARKER} "
                              f"(torch_dist) nor {METADATA_NAME} (DCP)")
    if entry_names is not None and {"args", "iteration"} <= set(entry_names) and any(
            n.startswith(FSDP_DTENSOR_MODEL_PREFIX) for n in entry_names):
        return "fsdp_dtensor"
    return "flatfsdp" if MANIFEST_NAME in names else "dcp"


def wrong_format(directory: str, found: str, expected: str, hint: str = "") -> CheckpointError:
    """The one error for a checkpoint of another format than the command reads."""
    wanted = DESCRIPTIONS[expected].split(" (")[0]
    return CheckpointError(f"{directory} is {DESCRIPTIONS[found]}, not {wanted}{': ' + hint if hint else ''}")
