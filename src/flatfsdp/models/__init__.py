"""Models that ship with flatfsdp for the training command, tests and benchmarks.

They know nothing about parallelism: sharding is applied from outside.
"""

from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock

__all__ = ["GPT", "GPTConfig", "TransformerBlock"]
