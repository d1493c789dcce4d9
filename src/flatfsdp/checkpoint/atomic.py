"""Putting a finished checkpoint directory in place so that readers only ever see
a complete one.

Note [atomic checkpoint directories]
All ranks write into a sibling ``DIR.tmp-<token>``; once every rank is done and
the manifest is written (last, fsynced), the coordinator publishes it:

* ``DIR`` absent: one ``rename(tmp, DIR)``.
* ``DIR`` present (the previous checkpoint): on Linux ``renameat2`` with
  ``RENAME_EXCHANGE`` swaps the two directories in one atomic step, then the
  old one (now under the tmp name) is deleted. Where that call is missing
  (other kernels, some network filesystems) we fall back to two renames --
  ``DIR -> DIR.old-<token>``, ``tmp -> DIR`` -- which leave a short window with
  no ``DIR``; `recover` closes it on the next save or load by renaming the
  complete sibling (new one preferred, else the old one) back to ``DIR``.

A crash before the swap leaves ``DIR`` untouched and a tmp directory without a
manifest, which no reader accepts; the next save removes such leftovers.

Note [only our own files]
Publishing replaces ``DIR`` and deletes what was there, so `check_replaceable`
first makes sure that is a checkpoint (it has our manifest) or an empty
directory: a user's folder (``--save .``) or file is refused, never renamed or
emptied. Leftovers are deleted only when their names carry our token
(``DIR.tmp-<12 hex>``, ``DIR.old-<12 hex>``) and they are directories.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import secrets
import shutil

from flatfsdp.checkpoint.errors import CheckpointError
from flatfsdp.checkpoint.manifest import MANIFEST_NAME

_TMP, _OLD = ".tmp-", ".old-"
_TOKEN = re.compile(r"[0-9a-f]{12}")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def normalize(directory) -> str:
    return os.path.abspath(os.fspath(directory)).rstrip(os.sep) or os.sep


def new_token() -> str:
    return secrets.token_hex(6)


def temp_path(directory: str, token: str) -> str:
    return f"{directory}{_TMP}{token}"


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries (a rename is durable only once its folder is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False where the platform cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def _swap_in(tmp: str, directory: str, token: str) -> str:
    """Move ``tmp`` onto an existing ``directory``; returns where the old one went."""
    if _exchange(tmp, directory):
        return tmp
    aside = f"{directory}{_OLD}{token}"
    os.rename(directory, aside)
    os.rename(tmp, directory)  # a crash before this line is repaired by `recover`
    return aside


def publish(tmp: str, directory: str, token: str, *, remove_old: bool = True) -> str | None:
    """Make the finished ``tmp`` (manifest included) the checkpoint at ``directory``.
    The checkpoint it replaces is deleted, or with ``remove_old=False`` left
    under a leftover name (``DIR.tmp-``/``DIR.old-<token>``), returned, for the
    caller to delete: a crash before that leaves debris the next save removes."""
    fsync_path(tmp)
    parent = os.path.dirname(directory)
    if os.path.exists(directory):
        old = _swap_in(tmp, directory, token)
        fsync_path(parent)
        if not remove_old:
            return old
        shutil.rmtree(old)
    else:
        os.rename(tmp, directory)
        fsync_path(parent)
    return None


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def recover(directory: str) -> str | None:
    """If a fallback swap was interrupted (no ``directory``), rename the complete sibling
    back. Returns the path recovered from, or None when there was nothing to do."""
    if os.path.exists(directory):
        return None
    for pattern in (_TMP, _OLD):  # the new checkpoint first, else the previous one
        candidates = [p for p in _ours(directory, pattern) if _complete(p)]
        if candidates:
            newest = max(candidates, key=lambda p: os.path.getmtime(os.path.join(p, MANIFEST_NAME)))
            os.rename(newest, directory)
            fsync_path(os.path.dirname(directory))
            return newest
    return None


def _ours(directory: str, pattern: str) -> list[str]:
    """Siblings ``DIR<pattern><token>`` that are directories with our token's shape."""
    found = glob.glob(glob.escape(directory) + pattern + "*")
    return [p for p in found if _TOKEN.fullmatch(p[len(directory) + len(pattern):])
            and os.path.isdir(p) and not os.path.islink(p)]


def remove_leftovers(directory: str) -> list[str]:
    """Delete tmp/aside siblings of earlier interrupted saves (call after `recover`)."""
    removed = []
    for pattern in (_TMP, _OLD):
        for path in _ours(directory, pattern):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def probe_writable(directory: str) -> None:
    """Create and remove, next to ``directory``, the kind of sibling a save
    writes (``DIR.tmp-<token>`` holding a file): permission bits and
    ``os.access`` say yes for root on a read-only mount or under /proc, where
    only trying tells. Raises CheckpointError naming what failed."""
    probe = temp_path(directory, new_token())
    try:
        os.mkdir(probe)
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(b"flatfsdp")
    except OSError as exc:
        raise CheckpointError(f"cannot save a checkpoint to {directory}: writing a test directory next to it "
                              f"failed ({exc.strerror or exc}: {exc.filename or probe})") from None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def check_replaceable(directory: str) -> None:
    """Raise unless saving to ``directory`` would replace nothing but a checkpoint
    (or an empty directory) and its parent takes a test write: see Note [only
    our own files]."""
    _check_replaceable(directory)
    probe_writable(directory)


def _check_replaceable(directory: str) -> None:
    if not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if not os.path.isdir(parent):
            raise CheckpointError(f"cannot save a checkpoint to {directory}: its parent directory {parent} "
                                  "does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot save a checkpoint to {directory}: {parent} is not writable")
        return
    if os.path.islink(directory) or not os.path.isdir(directory):
        raise CheckpointError(f"refusing to save a checkpoint to {directory}: it is a file, not a checkpoint "
                              "directory (it was left untouched); choose a new or empty directory")
    if not _complete(directory) and os.listdir(directory):
        raise CheckpointError(f"refusing to save a checkpoint to {directory}: it is a directory that is not a "
                              f"flatfsdp checkpoint (no {MANIFEST_NAME}), and saving would replace its contents "
                              "(left untouched); choose a new or empty directory")
    parent = os.path.dirname(directory)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot save a checkpoint to {directory}: {parent} is not writable "
                              "(a save writes a sibling directory and swaps it in)")
