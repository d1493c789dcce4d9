"""The training text as byte tokens, and batches that are a pure function of
(seed, step, micro-batch, rank).

Nothing about the data lives in a loader's state: the global batch of a step is
drawn from a generator seeded by (seed, step), and each rank takes its rows of
it. A resumed run therefore needs only the step number to see exactly the
batches an uninterrupted run would have seen -- and the global batch of a step
is the same whatever the number of ranks or the micro-batch split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

import torch

VOCAB_SIZE = 256
"""Byte-level tokens: every byte value is a token; nothing to download or train."""

EVAL_FRACTION = 0.1
"""Share of the text (its end) held out for evaluation."""


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    """Byte tokens (int64) the training batches are drawn from."""
    eval: torch.Tensor
    """Held-out byte tokens, never trained on."""


def corpus_path() -> str:
    """The shipped text's file (for a tokenizer, which reads it as --data)."""
    return str(resources.files("flatfsdp.data").joinpath("corpus.txt"))


def load_corpus(eval_fraction: float = EVAL_FRACTION) -> Corpus:
    """The shipped text, split at the paragraph break nearest the held-out share."""
    text = resources.files("flatfsdp.data").joinpath("corpus.txt").read_bytes()
    cut = len(text) - int(len(text) * eval_fraction)
    paragraph = text.rfind(b"\n\n", 0, cut)
    if paragraph > len(text) // 2:
        cut = paragraph + 2
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return Corpus(train=tokens[:cut], eval=tokens[cut:])


def _seed_for(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"flatfsdp-train-data:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def micro_batch(tokens: torch.Tensor, *, seed: int, step: int, micro: int, rank: int, world: int,
                micro_batch_size: int, accumulation: int, seq_length: int) -> torch.Tensor:
    """Rows ``[micro_batch_size, seq_length + 1]`` (inputs and shifted targets)
    of step ``step``'s global batch that belong to (``micro``, ``rank``).

    Row order in the global batch is micro-major, so the rows one micro-batch
    pass consumes across ranks are contiguous.
    """
    if tokens.numel() <= seq_length + 1:
        raise ValueError(f"the text ({tokens.numel()} bytes) is shorter than one sequence ({seq_length + 1})")
    global_batch = micro_batch_size * world * accumulation
    generator = torch.Generator().manual_seed(_seed_for(seed, step))
    starts = torch.randint(0, tokens.numel() - seq_length, (global_batch,), generator=generator)
    first = (micro * world + rank) * micro_batch_size
    mine = starts[first:first + micro_batch_size]
    offsets = torch.arange(seq_length + 1)
    return tokens[mine[:, None] + offsets[None, :]]


def eval_batches(tokens: torch.Tensor, *, count: int, rank: int, world: int, micro_batch_size: int,
                 seq_length: int) -> list[torch.Tensor]:
    """This rank's ``count`` evaluation micro-batches: fixed windows spread evenly
    over the held-out text, the same at every evaluation and in every run."""
    windows = count * world * micro_batch_size
    span = tokens.numel() - seq_length - 1
    if span < 0:
        raise ValueError(f"the held-out text ({tokens.numel()} bytes) is shorter than one sequence "
                         f"({seq_length + 1}): use a smaller --seq-length")
    starts = torch.linspace(0, span, windows).round().long()
    offsets = torch.arange(seq_length + 1)
    rows = tokens[starts[:, None] + offsets[None, :]]
    mine = rows.view(count, world, micro_batch_size, seq_length + 1)[:, rank]
    return list(mine.unbind(0))


class ShippedText:
    """The default data: the shipped text as byte tokens, windows at random offsets."""

    def __init__(self, seed: int, seq_length: int):
        self.corpus, self.seed, self.seq_length = load_corpus(), seed, seq_length
        self.vocab_size = VOCAB_SIZE

    def micro_batch(self, *, step: int, micro: int, rank: int, world: int, micro_batch_size: int,
                    accumulation: int) -> torch.Tensor:
        return micro_batch(self.corpus.train, seed=self.seed, step=step, micro=micro, rank=rank, world=world,
                           micro_batch_size=micro_batch_size, accumulation=accumulation, seq_length=self.seq_length)

    def eval_batches(self, *, count: int, rank: int, world: int, micro_batch_size: int) -> list[torch.Tensor]:
        return eval_batches(self.corpus.eval, count=count, rank=rank, world=world, micro_batch_size=micro_batch_size,
                            seq_length=self.seq_length)

    def describe(self) -> dict:
        return {"data": "shipped text (bytes)", "train_tokens": self.corpus.train.numel(),
                "eval_tokens": self.corpus.eval.numel()}


class UserData:
    """``--data``: the token cache's memory-mapped files cut into packed windows
    (flatfsdp.data.packed); the held-out windows come from held-out documents."""

    def __init__(self, files, seed: int, seq_length: int):
        from flatfsdp.data.packed import PackedWindows

        self.files = files
        self.vocab_size = files.meta["vocab_size"]
        self.train = PackedWindows(files.open("train"), seq_length, seed)
        self.eval = PackedWindows(files.open("eval"), seq_length, seed)
        self.micro_batch = self.train.micro_batch

    def eval_batches(self, *, count: int, rank: int, world: int, micro_batch_size: int) -> list[torch.Tensor]:
        return self.eval.eval_batches(count=count, rank=rank, world=world, micro_batch_size=micro_batch_size)

    def describe(self) -> dict:
        meta = self.files.meta
        return {"data": meta["sources"], "token_cache": self.files.directory,
                "train_tokens": meta["train_tokens"], "eval_tokens": meta["eval_tokens"],
                "train_documents": meta["train_documents"], "eval_documents": meta["eval_documents"]}
