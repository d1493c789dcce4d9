"""The one place that knows which device kind this process runs on.

Nothing else in the engine names CUDA: CPU + gloo and accelerators share every
code path, and device specifics stay here.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def default_device_type() -> str:
    """'cpu' under gloo, else the current accelerator's type (cuda, xpu, ...)."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return "cpu"
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


class SideStream:
    """Where one kind of collective runs so it overlaps compute.

    On an accelerator: a dedicated stream. Work launched there first waits for
    everything already queued on the compute stream (the buffers it reads were
    just written, and the memory it writes may have been freed by compute just
    before), and records an event the compute stream waits on before it reads
    the result. No ``record_stream``: every buffer such work touches is kept
    alive by the engine until the compute stream has waited on that event, so
    the allocator, ordered on the compute stream, never hands its memory out
    early. On CPU there is no stream: collectives run asynchronously on the
    backend's own threads and are waited on through their work handles.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.Stream(device) if device.type != "cpu" else None

    def launch(self, issue: Callable[[], T]) -> tuple[T, "torch.Event | None"]:
        """Run ``issue`` (which enqueues work) on this stream; return its result
        and the event marking the work's end (None on CPU)."""
        if self.stream is None:
            return issue(), None
        self.stream.wait_stream(torch.accelerator.current_stream())
        with self.stream:
            result = issue()
        event = torch.Event()
        event.record(self.stream)
        return result, event


    def wait_for(self, event: "torch.Event | None") -> None:
        """Work launched here from now on waits for ``event`` (e.g. the end of
        an optimizer step run on another stream). On CPU work is ordered by the
        host already."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)


def event_done(event: "torch.Event | None") -> bool:
    """Side-stream work marked by ``event`` has finished on the device (no block)."""
    return event is None or event.query()


def wait_event(event: "torch.Event | None") -> None:
    """Make the compute stream wait for side-stream work (no host block)."""
    if event is not None:
        torch.accelerator.current_stream().wait_event(event)


def copy_to_host(tensors: list[torch.Tensor], out: list["torch.Tensor | None"] | None = None) -> list[torch.Tensor]:
    """Contiguous host copies of ``tensors``, returned once every copy has
    landed. ``out[i]``, where given (a host tensor of the same shape and
    dtype), is written instead of a new allocation: reusing host memory saves
    the first-touch page faults, which cost several times the copy itself.
    From an accelerator the copies go into pinned memory without blocking one
    by one, and the host waits once at the end; on CPU nothing is pinned (it
    needs an accelerator and buys nothing there)."""
    copies, sources = [], set()
    for i, tensor in enumerate(tensors):
        tensor = tensor.detach()
        host = out[i] if out is not None else None
        on_device = tensor.device.type != "cpu"
        if host is None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_device)
        host.copy_(tensor, non_blocking=on_device)
        copies.append(host)
        if on_device:
            sources.add(tensor.device)
    for device in sources:
        torch.accelerator.current_stream(device).synchronize()
    return copies
