"""`flatfsdp train`: a sharded training run anyone starts with one command.

Trains the package GPT (or, with --hf-model, a Hugging Face causal LM) on the
text shipped with flatfsdp or the user's own, over local ranks it launches itself or
the ranks torchrun started. Built on flatfsdp's public API only. See docs/train.md.

* ``options``  -- the flags (one frozen dataclass) and their checks; imports no torch,
  so ``flatfsdp train --help`` and a bad flag answer at once
* ``command``  -- parse, check, launch, exit status
* ``loop``     -- what each rank runs: build, shard, resume, train, evaluate, save
* ``step``     -- one optimizer step: accumulation, loss scaling, clipping
* ``data``     -- the corpus as bytes; batches as a function of (seed, step, micro-batch, rank)
* ``own_data`` -- --data and the tokenizer: tokenized once, checked before any rank starts
* ``model``, ``hf`` -- the model and the fully_shard keywords the flags map to
* ``resume``   -- checkpoints {"model", "optim", "train"} and the pre-launch compatibility check
* ``interrupt``-- Ctrl-C as a flag the ranks agree on
* ``progress``, ``memory``, ``report``, ``runlog``, ``plot``, ``png`` -- what a person sees and keeps
"""

from __future__ import annotations

__all__ = ["main"]


def __getattr__(name: str):
    # `main` resolves on first use: importing flatfsdp.train.options (the parser) must not import torch.
    if name == "main":
        from flatfsdp.train.command import main

        return main
    raise AttributeError(f"module 'flatfsdp.train' has no attribute {name!r}")
