"""``--preset gpu``: what one lent GPU measures first (docs/gpu.md).

A Llama-3.2-1B-shaped model (16 blocks, width 2048, 32 query / 8 key-value
heads, SwiGLU 8192, vocabulary 128,256 tied to the output: 1,235,814,400
parameters), four sequences of 4,096 tokens, bf16 compute with fp32 main
weights and AdamW state, one rank: flatfsdp, FSDP2 and the unsharded floor.

Why it fits an 80 GB H100 (``docs/gpu.md`` has the arithmetic):

* state, 18 bytes a parameter at one rank (fp32 main 4, bf16 copy 2, fp32
  gradients 4, AdamW 8): 22.2 GB (FSDP2 keeps no bf16 copy: 19.8 GB; the
  floor holds bf16 gradients too: up to 24.7 GB);
* activations, at most 127 KB per token per block (measured on CPU, where
  RMSNorm keeps fp32 copies; fused kernels keep less): 8.3 GB a sequence,
  33 GB for four, plus 1.6 GB of the chunked loss;
* so a peak near 58 GB, with 20 GB to spare for the allocator's slack.

Why it runs in minutes: 9.03 GFLOP a token (``flops.py``), 1.48e14 FLOP a
step, 0.3-0.5 s at 300-450 TFLOP/s; ten steps a run, six runs (three
contenders, two alternating rounds), each a fresh process that builds the
model on the GPU: under 30 s a run, about 3 minutes in all.
"""

from __future__ import annotations

SHAPE = dict(batch=4, seq_len=4096)
"""Micro batch x tokens (BenchConfig.batch, BenchConfig.seq_len), as the other presets give them."""

MODEL = "llama"
"""BenchConfig.model: the preset is what chooses the Llama (no flag does)."""

DEFAULTS = dict(layers=16, d_model=2048, heads=32, vocab=128256, bf16=True, nprocs=1, threads_per_rank=8,
                steps=8, warmup=2, repeats=2, contenders="floor,fsdp2,flatfsdp", lr=1e-4)
"""Everything else the preset chooses, as the command line's defaults (keyed by
the parser's destinations): a flag given explicitly still wins, which is how
tools/gpu_check.sh scales the same preset down to a CPU.

The learning rate: at the bench's usual 1e-3 this model's loss rises over the
first steps (measured on an H200) and bf16 rounding then parts the
contenders -- last losses after 7 steps 12.192 floor, 12.298 FSDP2, 12.194
flatfsdp; at 1e-4 it falls and all three agree within 0.0005, so the loss
check compares the engines rather than an unstable run."""
