"""The folder an HF export writes: built beside its destination under a name
of its own, renamed into place only when every file in it is written, so an
interrupted export leaves nothing a loader could take for a model (and no
half-filled destination); and the config.json a user hands an export."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from typing import Iterator

from flatfsdp.checkpoint.errors import CheckpointError


@contextlib.contextmanager
def building(out_dir: str) -> Iterator[str]:
    """Yields the folder to write into; on a clean exit it becomes ``out_dir``
    (absent, or empty as the caller checked), otherwise it is removed."""
    partial = f"{out_dir}.partial-{uuid.uuid4().hex[:8]}"
    os.makedirs(partial)
    try:
        yield partial
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty: rmdir refuses anything else
        os.rename(partial, out_dir)
    finally:
        if os.path.exists(partial):
            shutil.rmtree(partial)


def read_config_json(config: str) -> dict:
    """``config``: a config.json, or a folder holding one."""
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable config.json ({exc})") from None
