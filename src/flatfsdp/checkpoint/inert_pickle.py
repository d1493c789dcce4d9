"""Carrying pickled values from one checkpoint format to another without running them.

Note [inert unpickling]
Megatron-LM's checkpoints keep non-tensor values as pickles (``torch.save``):
its argument namespace (with Megatron-Core's enums and a ``signal.Signals``),
numpy's random state, the LR scheduler's fields. A converter must read some of
them (the iteration, which options the run used, the optimizer's step) and
write all of them again in the other format's places -- but it must not run
what a checkpoint names: an unpickler that imports and calls whatever a pickle
asks for executes code from the file.

Here a pickle is read by an unpickler that resolves only an allowlist of
harmless globals (tensor rebuilding, dtypes, ``torch.Size``, ``OrderedDict``,
``_codecs.encode`` for protocol-2 bytes). Every other global becomes an
`Opaque` record: the (module, name) it named, the arguments it would have been
called or constructed with, and the state it would have been given -- nothing
is imported, nothing is called. Records nest (a namespace holding an enum holds
a record holding a record), and `dumps` writes them back as the same globals,
arguments and state, so the program that owns those classes (Megatron-LM,
loading the converted checkpoint) rebuilds exactly the objects the source held.
`fields` reads a record's instance state (argparse's Namespace keeps its
options there), which is how the converter learns what the run was.
"""

from __future__ import annotations

import _codecs
import collections
import copyreg
import io
import pickle

import torch

from flatfsdp.checkpoint.errors import CheckpointError

_REAL = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _codecs.encode,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
}
"""Globals that are resolved for real: they build data and run nothing else."""


class Opaque:
    """A value of a class this process never imported: what the pickle said to build."""

    _inert_global: tuple[str, str] = ("", "")

    def __new__(cls, *args, **kwargs):
        record = object.__new__(cls)
        record.__dict__.update(_args=args, _kwargs=kwargs, _called=False, _state=None, _items=[], _entries=[])
        return record

    def __init__(self, *args, **kwargs):
        # Only a REDUCE (``callable(*args)``) reaches here; NEWOBJ calls ``__new__`` alone.
        self.__dict__["_called"] = True

    def __setstate__(self, state):
        self.__dict__["_state"] = state

    def append(self, item):
        self._items.append(item)

    def extend(self, items):
        self._items.extend(items)

    def __setitem__(self, key, value):
        self._entries.append((key, value))

    @property
    def global_name(self) -> str:
        module, name = self._inert_global
        return f"{module}.{name}"

    def __reduce_ex__(self, protocol):
        cls = type(self)
        if self._called:
            head = (cls, self._args)
        elif self._kwargs:
            head = (copyreg.__newobj_ex__, (cls, self._args, self._kwargs))
        else:
            head = (copyreg.__newobj__, (cls, *self._args))
        return (*head, self._state, iter(self._items) if self._items else None,
                iter(self._entries) if self._entries else None)

    def __repr__(self):
        return f"<{self.global_name} (not imported)>"


def _opaque_class(module: str, name: str) -> type:
    return type(name, (Opaque,), {"_inert_global": (module, name), "__module__": __name__})


def fields(value) -> dict:
    """The instance attributes a record was given (argparse.Namespace: its options); {} otherwise."""
    state = value._state if isinstance(value, Opaque) else None
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
        state = state[0]  # (dict state, slot state)
    return dict(state) if isinstance(state, dict) else {}


class Unpickler(pickle.Unpickler):
    """Resolves the allowlist and turns every other global into an `Opaque` class of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module, name):
        if (module, name) in _REAL:
            return _REAL[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in self._classes:
            self._classes[(module, name)] = _opaque_class(module, name)
        return self._classes[(module, name)]


class Pickler(pickle._Pickler):
    """The pure-Python pickler, writing each `Opaque` class back as the global it stood for."""

    def save_global(self, obj, name=None):
        ref = getattr(obj, "_inert_global", None)
        if isinstance(obj, type) and issubclass(obj, Opaque) and ref:
            module, qualname = ref
            self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def loads(raw: bytes, where: str):
    """The value ``torch.save`` wrote into ``raw``, foreign globals kept as records (never run)."""
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False, pickle_module=_Module)
    except Exception as exc:  # any failure to parse means a bad entry
        raise CheckpointError(f"{where}: not a readable pickled value ({type(exc).__name__}: {exc})") from None


def dumps(value) -> bytes:
    """``torch.save`` bytes of ``value``, records written back as the globals they came from."""
    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_module=_Module, pickle_protocol=2)
    return buffer.getvalue()


class _Module:
    """What torch.load / torch.save take as ``pickle_module``."""

    Unpickler = Unpickler
    Pickler = Pickler
    load = pickle.load
    dump = pickle.dump
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
