"""Layout: where every tensor of a sharded unit lives, as data.

The pure chunk arithmetic (``arithmetic``: which ``torch.chunk`` rows of each
parameter a rank holds and where they sit in each flat buffer -- numbers
only, no torch), the sharding strategy resolved once into placements, the
data-parallel meshes, views of the numbers over flat tensors, resizable flat
buffers, devices, precision and where main weights live (device or host).

May import: torch and the standard library, and modules of this package.
Nothing here communicates or knows about modules' hooks.
"""
