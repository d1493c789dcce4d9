"""One NeMo AutoModel run on CPU/gloo, as its user writes it, with
``megatron_fsdp`` answered by stock megatron-fsdp or by flatfsdp.

NeMo AutoModel (``nemo-automodel`` 0.7.0) unchanged: ``create_distributed_setup_from_config``,
``NeMoAutoModelForCausalLM.from_config`` (which shards through ``megatron_fsdp.fully_shard_model``),
``shard_optimizers_for_megatron_fsdp``, a plain forward/backward/step/zero_grad loop, and its
``Checkpointer`` (DCP through ``get/set_model_state_dict`` and ``get/set_optimizer_state_dict``).
The only change, for every provider alike: NeMo's and stock's CUDA calls answer on the CPU.

Environment: STRATEGY=megatron_fsdp|ddp (NeMo's own DDP is the reference), PROVIDER=stock|flatfsdp,
OPT=adamw|sgd, GROUPS=1|2 (2: norms in a group of their own, first -- not the model's order, as
NeMo's param_group_overrides build), MODE=full|save|load, STEPS (4), SAVE_AT (2), CKPT, OUT_JSON.
Launch under torchrun with 2 ranks (tools/nemo_automodel/matrix.py runs every case).
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

PROVIDER = os.environ.get("PROVIDER", "stock")
STRATEGY = os.environ.get("STRATEGY", "megatron_fsdp")
if PROVIDER == "flatfsdp" and STRATEGY == "megatron_fsdp":
    import flatfsdp.megatron_fsdp.redirect as redirect  # the supported switch: `import megatron_fsdp` is flatfsdp's

    redirect.install()


class _NoStream:
    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return self

    def synchronize(self, *args, **kwargs):
        pass

    wait = query = record = synchronize


def cuda_calls_on_cpu() -> None:
    """NeMo and stock megatron_fsdp ask CUDA for a device, streams and syncs;
    on CPU none of them has work to do. Stock also reduces with NCCL's
    PREMUL_SUM, which gloo lacks (scale, then sum: the same average)."""
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    if PROVIDER == "stock" and STRATEGY == "megatron_fsdp":
        import megatron_fsdp.param_and_grad_buffer as pgb

        def scale_then_sum(grad_data, scaling_factor, ddp_config):
            if scaling_factor is not None and scaling_factor != 1.0:
                grad_data.mul_(scaling_factor)
            return dist.ReduceOp.SUM

        pgb.gradient_reduce_preprocessing = scale_then_sum
        pgb.validate_uneven_dtensor = lambda dtensor: None  # a check that copies to CUDA


def _cpu(device):
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class CudaToCpu(TorchFunctionMode):
    """``device="cuda"``, ``.cuda()`` and NeMo's ``model.to(<device index>)`` go to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: (_cpu(v) if k == "device" else v) for k, v in (kwargs or {}).items()}
        args = tuple(_cpu(a) for a in args)
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "_parse_to" and args and type(args[0]) is int:  # Module.to(<CUDA device index>)
            args = ("cpu",) + args[1:]
        return func(*args, **kwargs)


def tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)


def batches(rank: int, steps: int) -> list:
    gen = torch.Generator().manual_seed(1234 + rank)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(steps)]


def build_optimizer(model) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    if os.environ.get("GROUPS", "1") == "2":
        norms = [p for n, p in named if "norm" in n]
        groups = [{"params": norms, "weight_decay": 0.0, "lr": 2e-3}, {"params": [p for n, p in named if "norm" not in n]}]
    else:
        groups = [p for _, p in named]
    if os.environ.get("OPT", "adamw") == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda_calls_on_cpu()
    from nemo_automodel import NeMoAutoModelForCausalLM
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config, shard_optimizers_for_megatron_fsdp

    mode, steps, save_at = os.environ.get("MODE", "full"), int(os.environ.get("STEPS", "4")), int(os.environ.get("SAVE_AT", "2"))
    with CudaToCpu():
        setup = create_distributed_setup_from_config(strategy=STRATEGY, dp_size=world, tp_size=1)
        torch.manual_seed(0)
        model = NeMoAutoModelForCausalLM.from_config(tiny_llama(), distributed_setup=setup, dtype=torch.float32,
                                                     use_liger_kernel=False, use_sdpa_patching=False,
                                                     attn_implementation="eager")
        optimizer = shard_optimizers_for_megatron_fsdp(model, [build_optimizer(model)], setup.strategy_config)[0]
        checkpointer = Checkpointer(CheckpointingConfig(checkpoint_dir=os.environ.get("CKPT", "ckpt"),
                                                        model_save_format="torch_save", save_consolidated=False),
                                    dp_rank=rank, tp_rank=0, pp_rank=0)
        data = batches(rank, steps)
        first, last = (save_at, steps) if mode == "load" else (0, save_at if mode == "save" else steps)
        if mode == "load":
            checkpointer.load_model(model, os.path.join(os.environ["CKPT"], "model"))
            checkpointer.load_optimizer(optimizer, model, os.environ["CKPT"])
        losses = []
        for step in range(first, last):
            loss = model(input_ids=data[step], labels=data[step]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if mode == "save":
            checkpointer.save_model(model, os.environ["CKPT"])
            checkpointer.save_optimizer(optimizer, model, os.environ["CKPT"])
    every = [None] * world
    dist.all_gather_object(every, losses)
    if rank == 0:
        result = {"provider": PROVIDER, "strategy": STRATEGY, "losses": every}
        print("RESULT", json.dumps(result), flush=True)
        if os.environ.get("OUT_JSON"):
            with open(os.environ["OUT_JSON"], "w") as f:
                json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    # Leave without tearing down: now and then a C++ thread of the stack aborts the interpreter's
    # exit ("terminate called without an active exception"), with stock and flatfsdp alike.
    os._exit(0)


if __name__ == "__main__":
    main()
