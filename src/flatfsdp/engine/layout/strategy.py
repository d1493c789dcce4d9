"""The sharding strategy, decided once at construction.

Everything else asks the enum which buffers are sharded; nothing compares
strategy strings.
"""

from __future__ import annotations

import enum


class ShardingStrategy(enum.IntEnum):
    NO_SHARD = 0
    """DDP: everything replicated, gradients all-reduced."""
    OPTIM = 1
    """ZeRO-1: optimizer state and fp32 main weights sharded."""
    OPTIM_GRADS = 2
    """ZeRO-2: ... and reduced gradients sharded."""
    OPTIM_GRADS_PARAMS = 3
    """ZeRO-3: ... and model weights sharded, gathered around each use."""

    @property
    def shards_main_weights(self) -> bool:
        return self >= ShardingStrategy.OPTIM

    @property
    def shards_grads(self) -> bool:
        return self >= ShardingStrategy.OPTIM_GRADS

    @property
    def shards_model_weights(self) -> bool:
        return self >= ShardingStrategy.OPTIM_GRADS_PARAMS

    @classmethod
    def parse(cls, value: "ShardingStrategy | int | str") -> "ShardingStrategy":
        if isinstance(value, ShardingStrategy):
            return value
        if isinstance(value, bool):
            raise TypeError(f"zero_dp_strategy must be 0-3 or a name, got {value!r}")
        if isinstance(value, int):
            if value in cls._value2member_map_:
                return cls(value)
        elif isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
            if key.isdigit() and int(key) in cls._value2member_map_:
                return cls(int(key))
        names = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"unknown zero_dp_strategy {value!r}: use 0-3 or one of {names}")
