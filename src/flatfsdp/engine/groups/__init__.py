"""Param groups: one unit's parameters that share dtype, requires_grad and
placement, their flat buffers, and what is done to them -- unshard, reshard,
reduce gradients.

``slots`` describes each parameter, ``buffers`` allocates and accounts the
flat buffers, ``param_group`` makes parameters view them and keeps the
gathered weights current, ``gradients`` carries autograd's gradients into the
reduced, sharded main grads. ``wire_choice`` (how bytes travel) and
``replicas`` (how replicas across the outer dimension relate) are choices
made once per group; ``group_core``'s ``ParamGroupFace`` and
``group_tensors``' record are all that the layers above read of a group.

May import: ``engine.layout``, ``engine.comm`` and modules of this package.
Knows nothing of hooks, the step's schedule or optimizers beyond the set of
those bound to it.
"""
