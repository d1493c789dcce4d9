"""Text shipped with flatfsdp for `flatfsdp train`.

corpus.txt (about 60 KB of plain ASCII English prose: short essays on bees,
bridges, bread, tides, clocks, libraries and other everyday subjects, after a
note on sharded training) is original writing by the flatfsdp authors, made
for this package, and is distributed under the package's own license. It was
not copied or derived from any other text, so the training command needs no
download and carries no third-party terms. The training command reads it as
bytes (a 256-token vocabulary) and holds out its last tenth for evaluation.
"""
