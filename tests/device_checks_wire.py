"""Device checks of what travels in a coded or partial form: low-bit weight
gathers and gradient reductions, and the tied token table's row lookups
with its paced whole-table gather (issue 46's unit) -- paths the first lent
GPU did not cover. At one rank every collective still runs (over NCCL on a
GPU), so the codecs' kernels, the side streams and the events the engine
waits on are exercised; sums across ranks are the gloo tests' (the last
column of docs/gpu.md's table).

Each ``check_*(device, workdir)`` asserts, returns its figures, or raises
``Unavailable`` (tests/device_checks.py lists them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import flatfsdp
from device_world import chunk_kept_as_in_a_larger_group, synchronize, world_of_one
from flatfsdp.bench.workload import schedule_embedding_units, unit_classes
from flatfsdp.engine.layout.block_formats import block_format, quantize_dequantize
from flatfsdp.models.gpt import GPT, TransformerBlock, lm_loss
from training import CFG, batches, full_params, make_model, make_optimizer, max_diff, train_quantized_reference

STEPS = 3
BLOCK = 16
WIRES = (("int8", None), ("fp8", None), ("int8", "bf16"), ("int8", "int8"))
"""(param_gather_dtype, grad_reduce_dtype): the formats the bench's low-bit rows use."""


# ---- low-bit gathers and reductions ------------------------------------------------------------

def _lowbit_run(device: torch.device, mesh, kind: str, grads: str | None, data: list) -> dict:
    model = make_model().to(device)
    opt = make_optimizer("adamw", model.named_parameters())
    extra = {} if grads is None else {"grad_reduce_dtype": grads}
    model, opt = flatfsdp.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[TransformerBlock],
                                      zero_dp_strategy="optim_grads_params", param_gather_dtype=kind,
                                      lowbit_block=BLOCK, **extra)
    fmt = block_format(kind, BLOCK)
    losses, distance = [], []
    for x in data:
        flatfsdp.comm_account().reset()
        x = x.to(device)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        account = flatfsdp.comm_account().snapshot()
        # What the module computes with against the quantize-dequantize of the main weights.
        main = {n: p.full_tensor() for n, p in model.named_parameters()}
        gathered = full_params(model)
        distance.append(max((gathered[n] - quantize_dequantize(main[n], fmt).float()).abs().max().item()
                            for n in main))
    synchronize(device)
    return dict(losses=losses, distance=max(distance),
                bytes={k: v["bytes"] for k, v in account.items() if k in ("all_gather", "reduce_scatter")})


def check_lowbit_wire(device: torch.device, workdir: Path) -> dict:
    """int8 and fp8 weight gathers, bf16 and int8 gradient reductions, ZeRO-3
    at one rank on the device: with exact gradients the module computes with
    exactly the quantize-dequantize of its main weights and trains as the
    unsharded model doing the same; coded gradients stay within 2% of it; the
    bytes each collective covers are those of the same run on the CPU (they
    depend on shapes alone)."""
    from torch.distributed.device_mesh import init_device_mesh

    cpu = torch.device("cpu")
    data = batches(STEPS)
    figures = {}
    with world_of_one(device, workdir) as mesh:
        host_mesh = mesh if device.type == "cpu" else init_device_mesh("cpu", (1,))
        references = {kind: train_quantized_reference(block_format(kind, BLOCK), data, device)
                      for kind in ("int8", "fp8")}
        for kind, grads in WIRES:
            here = _lowbit_run(device, mesh, kind, grads, data)
            on_host = _lowbit_run(cpu, host_mesh, kind, grads, data)
            name, ref = f"{kind}+{grads or 'fp32'}", references[kind]
            worst = max(abs(a - b) / abs(b) for a, b in zip(here["losses"], ref))
            figures.update({f"{name}.loss_rel_diff": worst, f"{name}.distance": here["distance"],
                            f"{name}.gather_bytes": here["bytes"].get("all_gather", 0),
                            f"{name}.reduce_bytes": here["bytes"].get("reduce_scatter", 0)})
            assert here["bytes"] == on_host["bytes"], (name, here["bytes"], on_host["bytes"])
            assert here["distance"] <= 1e-6, (name, here["distance"])  # the codes decode as on the CPU
            if grads is None:
                assert abs(here["losses"][0] - ref[0]) <= 1e-6 * abs(ref[0]), (name, here["losses"], ref)
                assert worst < 1e-4, (name, here["losses"], ref)
            else:
                assert worst < 2e-2, (name, here["losses"], ref)
            assert all(map(torch.isfinite, map(torch.tensor, here["losses"]))), (name, here["losses"])
    return figures


# ---- the tied table and head: row lookups, a paced gather ---------------------------------------

def _tied_model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CFG, tie_embeddings=True)).to(device)


def check_tied_rows_unit(device: torch.device, workdir: Path) -> dict:
    """The tied token table and head as one unit with row lookups (the
    lookup fetches its ids' rows, the whole table is gathered paced for the
    head, the head's gradient is reduced first and the lookup's rows last):
    on the device it trains as the unsharded model, and the rows that travel
    are the batch's."""
    data = batches(STEPS)
    reference = _tied_model(device)
    ref_opt = make_optimizer("adamw", reference.named_parameters())
    ref_losses = []
    for x in data:
        x = x.to(device)
        loss = reference(x[:, :-1], x[:, 1:])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    with world_of_one(device, workdir) as mesh:
        model = _tied_model(device)
        opt = make_optimizer("adamw", model.named_parameters())
        # The chunk kept as in a larger group: at one rank holding it whole, a
        # lookup has no rows to fetch (unit_controls.rows_all_local).
        with chunk_kept_as_in_a_larger_group():
            model, opt = flatfsdp.fully_shard(model, opt, device_mesh=mesh,
                                              fsdp_unit_modules=unit_classes(model, True),
                                              zero_dp_strategy="optim_grads_params")
        schedule_embedding_units(model, rows_only=True)
        losses = []
        for x in data:
            flatfsdp.comm_account().reset()
            x = x.to(device)
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        account = flatfsdp.comm_account().snapshot()
        diff = max_diff({n: p.float().cpu() for n, p in full_params(model).items()},
                        {n: p.detach().float().cpu() for n, p in reference.named_parameters()})
        tied = model.lm_head.weight is model.tok_emb.weight
    distinct = data[-1][:, :-1].unique().numel()
    row_bytes = distinct * CFG.d_model * 4
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    figures = {"loss_rel_diff": worst, "param_diff": diff, "lookup_rows": account.get("lookup_rows"),
               "reduce_rows": account.get("reduce_rows"), "row_bytes": row_bytes}
    assert 0 < distinct < CFG.vocab_size, distinct  # rows, not the whole table
    assert worst < 1e-5 and diff < 1e-5, figures
    assert account.get("lookup_rows") == {"count": 1, "bytes": row_bytes}, figures
    assert account.get("reduce_rows") == {"count": 1, "bytes": row_bytes}, figures
    assert tied, "the head and the table are one parameter again between steps"
    return figures
