"""`--lora-rank`: fine-tune a Hugging Face model through LoRA adapters made by PEFT.

PEFT injects its adapter layers into the transformers model itself (no
PeftModel wrapper), so the model keeps its class, its config and its
parameter names -- each wrapped Linear's weight becomes ``<name>.base_layer.weight``
beside ``<name>.lora_A.default.weight`` and ``<name>.lora_B.default.weight``.
Everything but the adapters is frozen: flatfsdp keeps no gradient buffer for
the frozen weights and the optimizer holds state for the adapters only.

The model is built on the meta device, sharded, and then filled: the adapters
first (A uniform in +-1/sqrt(fan_in) -- PEFT's own init -- drawn whole from a
generator seeded by (--seed, name), so every world size gets the same values;
B zero, so training starts from the pretrained model exactly), then the
pretrained weights by `flatfsdp.load_pretrained`, which reads PEFT's
``base_layer`` names as the checkpoint's plain ones.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
from torch import nn

from flatfsdp.pretrained.regions import local_region, local_tensor
from flatfsdp.train.options import TrainOptions, UsageError

ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def add_adapters(model: nn.Module, o: TrainOptions) -> str:
    """Inject LoRA adapters into ``model`` in place, freeze the rest; returns the
    PEFT adapter config as JSON (saved with checkpoints for the export)."""
    from peft import LoraConfig, inject_adapter_in_model

    wanted = o.lora_targets.strip()
    targets = "all-linear" if wanted == "all-linear" else [t.strip() for t in wanted.split(",") if t.strip()]
    config = LoraConfig(r=o.lora_rank, lora_alpha=o.lora_alpha, target_modules=targets, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UsageError(f"--lora-targets {o.lora_targets}: {' '.join(str(exc).split())[:200]} (linear layers "
                         f"of this model: {', '.join(names)})") from None
    wrapped = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "base_layer")})
    if not wrapped:
        raise UsageError(f"--lora-targets {o.lora_targets} matched no layer of the model")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    described = config.to_dict()
    described.update(target_modules=wrapped, base_model_name_or_path=o.hf_model, inference_mode=True)
    return json.dumps(described, default=str, sort_keys=True)


def _seeded(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"flatfsdp-lora:{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> int:
    """Write the adapters' initial values into each rank's shards; returns how many tensors."""
    count = 0
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        local = local_tensor(param)
        if ".lora_B." in name:
            local.zero_()
        else:
            bound = 1.0 / math.sqrt(param.shape[1])
            full = torch.empty(tuple(param.shape)).uniform_(-bound, bound, generator=_seeded(seed, name))
            local.copy_(full[local_region(param)])
        count += 1
    return count

