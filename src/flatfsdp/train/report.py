"""The end of a run: the summary (returned, logged, printed) and the loss curve."""

from __future__ import annotations

import os

import flatfsdp
from flatfsdp.train.memory import gather_memory_mb
from flatfsdp.train.plot import plot_losses


def _mean_tail(values: list[float], n: int = 10) -> float | None:
    tail = values[-n:]
    return sum(tail) / len(tail) if tail else None


def _optimizer_state_bytes(optimizer) -> int:
    """This rank's optimizer state (its shards): with LoRA, the adapters' alone."""
    from flatfsdp.pretrained.regions import local_tensor

    return sum(local_tensor(v).numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if hasattr(v, "dim") and v.dim() > 0)


def finish_report(trainer, seconds: float, stopped: str | None) -> dict:
    """Collective (gathers memory); rank 0 writes log.json and loss.png and prints.
    ``stopped``: None (ran to --train-iters), "interrupt" (Ctrl-C) or "exit_interval"."""
    t, o = trainer, trainer.o
    memory = gather_memory_mb(t.device)
    losses = [loss for _, loss in t.losses]
    steps = len(losses)
    summary = {
        "rank": t.rank, "world_size": t.world, "strategy": o.data_parallel_sharding_strategy,
        "steps": steps, "first_step": t.first_step + 1 if steps else None,
        "last_step": t.losses[-1][0] if steps else t.first_step, "seconds": round(seconds, 3),
        "losses": losses, "first_loss": losses[0] if losses else None, "last_loss": _mean_tail(losses),
        "eval_losses": [loss for _, loss in t.evals], "eval_loss": t.evals[-1][1] if t.evals else None,
        "tokens_per_s": round(t.tokens_per_step * steps / seconds, 1) if steps else 0.0,
        "peak_rss_mb_per_rank": [row[1] for row in memory], "peak_device_mb_per_rank": [row[3] for row in memory],
        "persistent_bytes_per_rank": flatfsdp.persistent_buffer_bytes(t.model),
        "persistent_bytes_by_role": flatfsdp.persistent_bytes_by_role(t.model),
        "optimizer_state_bytes": _optimizer_state_bytes(t.optimizer),
        "trainable_parameters": t.trainable, "parameters": t.parameters,
        "sharded_units": sum(isinstance(m, flatfsdp.FSDPModule) for m in t.model.modules()),
        "interrupted": stopped == "interrupt", "stopped": stopped, "checkpoint": t.checkpoint, "run_dir": t.run_dir,
    }
    if t.rank == 0:
        t.log.memory(summary["last_step"], memory)
        summary["plot"] = plot_losses(os.path.join(t.run_dir, "loss.png"), t.losses, t.evals,
                                      title=_title(t))
        t.log.finish(summary)
        _print(summary, t)
    return summary


def _title(t) -> str:
    o = t.o
    model = "GPT" if o.hf_model is None else "HF Llama" if o.hf_model == "" else f"HF {o.hf_model}"
    return (f"{model} {t.parameters / 1e6:.2f}M params, {t.world} ranks, {o.data_parallel_sharding_strategy}, "
            f"{'bf16' if o.bf16 else 'fp32'}, global batch {t.data_flags['global_batch_size']} x {o.seq_length}")


def _print(s: dict, t) -> None:
    if not s["steps"]:
        print(f"nothing to train: the run is already at step {s['last_step']} of {t.o.train_iters}", flush=True)
    else:
        verb = "stopped after" if s["stopped"] else "done:"
        evaluation = f", held-out {s['eval_loss']:.3f}" if s["eval_loss"] is not None and not s["stopped"] else ""
        memory = " ".join(f"{m:,.0f}" for m in (s["peak_device_mb_per_rank"] if any(s["peak_device_mb_per_rank"])
                                                  else s["peak_rss_mb_per_rank"]))
        print(f"{verb} {s['steps']} steps in {s['seconds']:.1f} s on {s['world_size']} ranks ({s['strategy']}): "
              f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}{evaluation} | {s['tokens_per_s']:,.0f} tokens/s "
              f"| peak MB per rank {memory}", flush=True)
    if t.trainable != t.parameters:
        roles = ", ".join(f"{role} {n:,}" for role, n in s["persistent_bytes_by_role"].items())
        print(f"trained {t.trainable:,} of {t.parameters:,} parameters (LoRA adapters); bytes per rank: {roles}, "
              f"optimizer state {s['optimizer_state_bytes']:,}", flush=True)
    files = "log.json, loss.png" + (f"; checkpoint {s['checkpoint']}" if s["checkpoint"] else "")
    print(f"run directory {s['run_dir']}: {files}", flush=True)
