"""Checkpoints of a training run: ``{"model", "optim", "train"}`` through
flatfsdp.checkpoint (atomic, verified, pickle-free).

``train`` holds tensors only: the step (which, with the seed, fixes the data
position -- batches are a function of the step, see data.py), the flags that
decide which batches a step sees, and every rank's RNG states as rows of one
``[world, n]`` byte tensor, so a resume on the same number of ranks continues
each rank's random stream exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatfsdp import checkpoint
from flatfsdp.data.tokenizer import TokenizerIdentity, same_tokenizer
from flatfsdp.train.options import TrainOptions, UsageError

_DATA_FLAGS = ("seed", "global_batch_size", "seq_length")
"""Flags that decide the batches: changed on resume, the data order changes too."""


def _gather_rows(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    mine = local.to(device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows).cpu()


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"rng_cpu": torch.get_rng_state()}
    if device.type != "cpu":
        states["rng_device"] = torch.get_device_module(device.type).get_rng_state(device.index)
    return states


def train_state(step: int, values: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    state = {"step": torch.tensor(step, dtype=torch.int64)}
    state.update({k: torch.tensor(v, dtype=torch.int64) for k, v in values.items()})
    state.update({k: _gather_rows(v, device) for k, v in _rng_states(device).items()})
    return state


def save(directory: str, model, optimizer, step: int, values: dict[str, int], device: torch.device,
         entries: dict[str, str] | None = None, *, async_save: bool = False,
         staging: checkpoint.StagingBuffers | None = None) -> checkpoint.AsyncSave | None:
    """``entries``: JSON strings saved beside the tensors -- the transformers
    config (``hf_config``, which `flatfsdp checkpoint export --format hf` writes
    out as config.json) and the LoRA settings (``lora_config``). ``async_save``:
    and ``staging``: see `flatfsdp.checkpoint.save`."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(),
             "train": train_state(step, values, device)}
    state.update(entries or {})
    return checkpoint.save(state, directory, async_save=async_save, staging=staging)


def load(directory: str, model, optimizer, values: dict[str, int], device: torch.device) -> dict:
    """Restore in place; returns {"step", "changed": {flag: (saved, now)}, "rng_restored"}.
    A checkpoint of model weights alone (e.g. from `flatfsdp checkpoint import`)
    starts at step 0 with a fresh optimizer."""
    saved = {t["name"]: t["shape"] for t in checkpoint.summarize(directory)["tensors"]}
    if "train.step" not in saved:
        state = {"model": model.state_dict()}
        checkpoint.load(state, directory)
        model.load_state_dict(state["model"])
        return {"step": 0, "changed": {}, "rng_restored": False}
    template = train_state(0, {k: 0 for k in values}, device)
    same_world = saved.get("train.rng_cpu", [None])[0] == dist.get_world_size()
    if not same_world:  # another world size: every rank's own stream cannot be continued
        template = {k: v for k, v in template.items() if not k.startswith("rng_")}
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "train": template}
    checkpoint.load(state, directory, strict=False)  # strict=False: older runs may lack a data flag
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    train = state["train"]
    if same_world:
        # clone(): torch.set_rng_state of a row view with a storage offset
        # crashes the process (torch 2.13, CPU generator); a fresh tensor is safe.
        rank = dist.get_rank()
        torch.set_rng_state(train["rng_cpu"][rank].clone())
        if "rng_device" in train:
            torch.get_device_module(device.type).set_rng_state(train["rng_device"][rank].clone(), device.index)
    changed = {k: (int(train[k]), v) for k, v in values.items() if f"train.{k}" in saved and int(train[k]) != v}
    return {"step": int(train["step"]), "changed": changed, "rng_restored": same_world}


def check_same_tokenizer(directory: str, tokenizer: TokenizerIdentity) -> None:
    """Before any rank starts (and before any tokenizing): the checkpoint's run
    used this tokenizer, when it says which (older checkpoints and imported
    weights do not)."""
    try:
        saved = checkpoint.read_tokenizer_record(directory)
    except checkpoint.CheckpointError as exc:
        raise UsageError(f"--load {directory}: {exc}") from None
    if saved is not None and not same_tokenizer(saved, tokenizer):
        raise UsageError(f"--load {directory} was trained with the tokenizer {saved['name']} (sha256 "
                         f"{saved['sha256'][:12]}), this run would use {tokenizer.name} (sha256 "
                         f"{tokenizer.sha256[:12]}), whose ids mean other text: pass --tokenizer {saved['name']}")


def check_loadable(directory: str, expected: dict[str, tuple]) -> None:
    """Before any rank starts: the directory is a complete checkpoint whose model
    entries have exactly the names and shapes of the model these flags build."""
    try:
        summary = checkpoint.summarize(directory)
    except checkpoint.CheckpointError as exc:
        raise UsageError(f"--load {directory}: {exc}") from None
    saved = {t["name"].removeprefix("model."): tuple(t["shape"]) for t in summary["tensors"]
             if t["name"].startswith("model.")}
    problems = [f"{k} is {saved[k]} there, {expected[k]} here" for k in expected
                if k in saved and saved[k] != tuple(expected[k])]
    problems += [f"{k} is missing there" for k in expected if k not in saved]
    problems += [f"it has {k}, this model does not" for k in saved if k not in expected]
    if problems:
        raise UsageError(f"--load {directory} holds a different model ({len(problems)} differences; first: "
                         f"{problems[0]}): use the model flags it was saved with")
