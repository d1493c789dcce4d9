"""Starting the gathers of several units at once: small groups of different
units share collectives (coalesce), and each unit is told which gathers bring
its weights (``UnitState.await_gathers``)."""

from __future__ import annotations

from torch.autograd.profiler import record_function

from flatfsdp.engine.comm import coalesce


def gather_units(states: list, async_op: bool) -> None:
    """Start gathering the groups of every unit not yet gathered, small ones
    coalesced into shared collectives, and swap the gathered views in."""
    todo = [s for s in states if not s.is_gathered]
    if not todo:
        return
    requests, owners = [], []
    with record_function(f"flatfsdp::unshard ({', '.join(s.path or '<root>' for s in todo)})"):
        for state in todo:
            state.ensure_initialized()
            for group in state.groups:
                request = group.gather_request()
                if request is not None:
                    requests.append(request)
                    owners.append(state)
        context = todo[0].context
        for state in todo:
            event, state.controls.post_optim_event = state.controls.post_optim_event, None
            if context is not None:
                context.gather_stream.wait_for(event)
        pendings = coalesce.gather(requests, async_op=async_op, bucket_bytes=todo[0].options.bucket_bytes,
                                   stream=context.gather_stream if context is not None else None)
        phase = "backward gather" if context is not None and context.in_backward else "forward gather"
        if phase == "backward gather" and context.schedule.enabled:  # forward gathers: record_forward
            for state in todo:
                context.schedule.record(f"the backward gather of unit '{state.path or '<root>'}'")
        for pending, owner in zip(pendings, owners):
            if not pending.label.startswith("unit"):  # bucket members share one Pending: name the first
                pending.label = f"unit '{owner.path or '<root>'}': {phase} {pending.label}"
        for state in todo:
            state.await_gathers([p for p, owner in zip(pendings, owners) if owner is state])
