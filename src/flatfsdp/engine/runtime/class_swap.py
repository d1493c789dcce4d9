"""The one place an instance's class is swapped for a subclass of its own,
as FSDP2 does to a sharded module: a sharded unit's ``FSDP<Class>``
(fsdp_module), the one-call root's Megatron members (front/megatron_model),
a bound optimizer's Megatron ``zero_grad`` (front/megatron_optimizer); and,
exported for flatfsdp.megatron_fsdp, a DTensor that says its uneven part to
torch's checkpoint and a sharded parameter answering Megatron-FSDP's
``megatron_fsdp_slice`` / ``megatron_fsdp_dist_index``.
``isinstance`` checks and the instance's behaviour survive; each
(mixin, class) pair is made once, so instances of one class share one
swapped class."""

from __future__ import annotations

import functools

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule


def swap_class(instance: object, mixin: type, *, prefix: str = "") -> None:
    """Make ``instance``'s class ``mixin`` in front of its own class (nothing
    when it has the mixin already). Named ``prefix + Class``; without a
    prefix it passes for the class itself."""
    if not isinstance(instance, mixin):
        instance.__class__ = _swapped(mixin, type(instance), prefix)


@functools.cache
def _swapped(mixin: type, cls: type, prefix: str) -> type:
    attrs = {"__module__": cls.__module__}
    if not prefix:
        attrs["__qualname__"] = cls.__qualname__
    attrs["_flatfsdp_swapped_from"] = cls
    made = type(prefix + cls.__name__, (mixin, cls), attrs)
    if issubclass(cls, TorchFSDPModule):
        # torch's FSDPModule.__new__ finds the user's class at this index of the MRO.
        made._orig_cls_mro_index = made.__mro__.index(cls.__mro__[cls._orig_cls_mro_index])
    return made


def unswapped_class(cls: type) -> type:
    """The class ``swap_class`` started from (``cls`` itself if it never swapped)."""
    while "_flatfsdp_swapped_from" in vars(cls):
        cls = vars(cls)["_flatfsdp_swapped_from"]
    return cls


def unswap(instance: object) -> type:
    """Give ``instance`` back the class ``swap_class`` started from, for a
    while; returns the class it had, for ``reswap``."""
    had = type(instance)
    instance.__class__ = unswapped_class(had)
    return had


def reswap(instance: object, cls: type) -> None:
    """``instance`` takes ``cls`` again -- if it still has the class ``cls`` was
    swapped from (something else may have given it another since)."""
    if type(instance) is unswapped_class(cls):
        instance.__class__ = cls
