"""Make Megatron-Core, NeMo AutoModel or any megatron_fsdp user run on flatfsdp
without editing their code.

megatron_fsdp is imported under two names: Megatron-Core imports its own
bundled copy, ``megatron.core.distributed.fsdp.src.megatron_fsdp``; NeMo
AutoModel, Megatron-Bridge and plain scripts import the PyPI package,
``megatron_fsdp``. ``install()`` puts a finder first on ``sys.meta_path``
that answers both names and their submodules with this package
(``flatfsdp.megatron_fsdp`` and ``.utils``, ``.fully_shard``, ...): the very
same module objects, so the adapter's ``MegatronFSDP`` *is*
``flatfsdp.megatron_fsdp.MegatronFSDP`` under either name (and ``uneven_dtensor``,
``param_and_grad_buffer``: Megatron-LM's ``fsdp_dtensor`` checkpoints). A submodule this
package does not have is not found (the parent's ``__path__`` is
flatfsdp's), and optional imports of it fall back as without megatron_fsdp.

It must run before anything imports either name. Two ways, both without
editing the caller (docs/megatron.md):

* as the launcher: ``torchrun --nproc_per_node 8 -m flatfsdp.megatron_fsdp.redirect
  pretrain_gpt.py --use-megatron-fsdp ...`` (or ``python -m ...``): installs, then
  runs the script as ``__main__`` with its arguments;
* from a ``sitecustomize.py`` on ``PYTHONPATH``: ``import
  flatfsdp.megatron_fsdp.redirect as r; r.install()``.

The finder is process-wide by nature (an import hook); it is installed only
when asked, never at import of flatfsdp, and ``install()`` twice is once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import runpy
import sys

BUNDLED = "megatron.core.distributed.fsdp.src.megatron_fsdp"
PYPI = "megatron_fsdp"
ANSWERED = (BUNDLED, PYPI)
"""The names megatron_fsdp is imported under: Megatron-Core's bundled copy, the PyPI package."""
PROVIDER = "flatfsdp.megatron_fsdp"


def _answered_root(fullname: str) -> str | None:
    """The answered name ``fullname`` is, or is a submodule of."""
    return next((root for root in ANSWERED if fullname == root or fullname.startswith(root + ".")), None)


class BundledToFlatfsdp(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``megatron_fsdp[.sub]`` under either name with the already-imported ``PROVIDER[.sub]``."""

    def find_spec(self, fullname, path=None, target=None):
        root = _answered_root(fullname)
        if root is None:
            return None
        real = PROVIDER + fullname[len(root):]
        if importlib.util.find_spec(real) is None:
            return None  # not provided here; the parent's __path__ is flatfsdp's, so the import fails cleanly
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == root)

    def create_module(self, spec):
        return importlib.import_module(PROVIDER + spec.name[len(_answered_root(spec.name)):])

    def exec_module(self, module) -> None:
        # The module ran when flatfsdp imported it; keep its own spec (importlib set the alias's).
        real = sys.modules[module.__name__]
        module.__spec__ = real.__spec__


def install() -> None:
    """Answer megatron_fsdp, under both its names, with flatfsdp from now on."""
    if any(isinstance(f, BundledToFlatfsdp) for f in sys.meta_path):
        return
    early = [name for name in ANSWERED if name in sys.modules]
    if early:
        raise RuntimeError(f"{early[0]} was imported before flatfsdp.megatron_fsdp.redirect.install(): call it "
                           "before anything imports megatron_fsdp or megatron.core (first in sitecustomize, or as "
                           "the launcher)")
    sys.meta_path.insert(0, BundledToFlatfsdp())


def main(argv: list[str] | None = None) -> None:
    """``python -m flatfsdp.megatron_fsdp.redirect SCRIPT [ARGS...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m flatfsdp.megatron_fsdp.redirect SCRIPT [ARGS...]  (or torchrun ... -m "
              "flatfsdp.megatron_fsdp.redirect SCRIPT ...): run SCRIPT with megatron_fsdp (the PyPI package "
              "and Megatron-Core's bundled copy) answered by flatfsdp")
        raise SystemExit(0 if argv else 2)
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
