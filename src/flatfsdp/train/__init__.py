"""`flatfsdp train`: a sharded training run anyone starts with one command.

Trains the package GPT (or, with --hf-model, a tiny Hugging Face Llama) on the
text shipped with flatfsdp, byte-level, over local ranks it launches itself or
the ranks torchrun started. Built on flatfsdp's public API only. See docs/train.md.

* ``options``  -- the flags (one frozen dataclass) and their checks
* ``command``  -- parse, check, launch, exit status
* ``loop``     -- what each rank runs: build, shard, resume, train, evaluate, save
* ``step``     -- one optimizer step: accumulation, loss scaling, clipping
* ``data``     -- the corpus as bytes; batches as a function of (seed, step, micro-batch, rank)
* ``model``, ``hf`` -- the model and the fully_shard keywords the flags map to
* ``resume``   -- checkpoints {"model", "optim", "train"} and the pre-launch compatibility check
* ``interrupt``-- Ctrl-C as a flag the ranks agree on
* ``progress``, ``memory``, ``report``, ``runlog``, ``plot``, ``png`` -- what a person sees and keeps
"""

from flatfsdp.train.command import main

__all__ = ["main"]
