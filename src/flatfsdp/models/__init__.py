"""Models that ship with flatfsdp for the training command, tests and benchmarks.

They know nothing about parallelism: sharding is applied from outside.
"""

from flatfsdp.models.gpt import GPT, GPTConfig, TransformerBlock
from flatfsdp.models.llama import Llama, LlamaBlock, LlamaConfig

__all__ = ["GPT", "GPTConfig", "TransformerBlock", "Llama", "LlamaBlock", "LlamaConfig"]
