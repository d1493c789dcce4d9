"""`flatfsdp train`: a short sharded training run of the package's GPT on the
shipped text corpus (byte-level tokens, nothing downloaded).

Uses the public API only; the same script would run on any number of ranks
under torchrun, or launches its own local ranks.
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import torch
import torch.distributed as dist

import flatfsdp
from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock, lm_loss


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="flatfsdp train", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    parser.add_argument("--data-parallel-sharding-strategy", dest="strategy", default="optim_grads_params",
                        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    parser.add_argument("--train-iters", type=int, default=150)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 with fp32 main weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-interval", type=int, default=25)
    return parser


def load_corpus() -> torch.Tensor:
    text = resources.files("flatfsdp.data").joinpath("corpus.txt").read_bytes()
    return torch.tensor(list(text), dtype=torch.long)


def sample_batch(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def run(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # every rank builds the same model
    config = GPTConfig(vocab_size=256, seq_len=args.seq_length, n_layer=args.num_layers,
                       n_head=args.num_attention_heads, d_model=args.hidden_size)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    policy = flatfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else None
    model, optimizer = flatfsdp.fully_shard(model, optimizer, fsdp_unit_modules=[TransformerBlock],
                                            zero_dp_strategy=args.strategy, mixed_precision_policy=policy)
    tokens = load_corpus()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    losses, start = [], time.perf_counter()
    for step in range(1, args.train_iters + 1):
        x = sample_batch(tokens, args.micro_batch_size, args.seq_length, gen)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        if rank == 0 and (step % args.log_interval == 0 or step == 1):
            rate = step * args.micro_batch_size * args.seq_length * world / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s", flush=True)
    summary = {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
               "seconds": time.perf_counter() - start, "world_size": world, "strategy": args.strategy,
               "persistent_bytes_per_rank": flatfsdp.persistent_buffer_bytes(model)}
    if rank == 0:
        print(f"done: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} in "
              f"{summary['seconds']:.1f}s on {world} ranks ({args.strategy}); engine buffers "
              f"{summary['persistent_bytes_per_rank'] / 2**20:.2f} MiB per rank", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from flatfsdp.launch import launch
    return launch(run, args.nproc, args)


if __name__ == "__main__":
    main()
