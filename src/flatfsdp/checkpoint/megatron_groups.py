"""Which optimizer parameter group each parameter of a torch_dist checkpoint was in.

torch_dist keeps the distributed optimizer's param groups (hyper-parameters and
the step) without saying which parameter belongs to which; fsdp_dtensor keeps
them per parameter (``optimizer.param_to_group_meta.<name>.<field>``), and
Megatron-LM's load rebuilds each group from the entries of its members -- so a
parameter given the wrong group's entries changes that group's hyper-parameters
(weight decay on biases) without a word. The membership is therefore
recomputed with the rule Megatron-Core applied when the run built its groups
(``get_standard_config_overrides``): no weight decay (``wd_mult`` 0) for
one-dimensional parameters and biases -- with ``--apply-wd-to-qk-layernorm``,
except the q/k layer norms -- and ``wd_mult`` 1 for the rest. Each parameter
must match exactly one saved group and each saved group at least one parameter;
anything else (decoupled learning rates, MuP, expert groups, a user's own
overrides) is refused by name rather than guessed.
"""

from __future__ import annotations

from flatfsdp.checkpoint.errors import CheckpointError

NOT_PER_PARAMETER = ("params", "step")
"""Group fields an fsdp_dtensor checkpoint does not keep per parameter (the step is a state tensor)."""


def _wd_mult(name: str, ndim: int, qk_layernorm_decays: bool) -> float:
    no_decay = ndim == 1 or name.endswith(".bias")
    if qk_layernorm_decays and ("q_layernorm." in name or "k_layernorm." in name):
        no_decay = False
    return 0.0 if no_decay else 1.0


def refuse_unknown_rules(args: dict, where: str) -> None:
    """The run's options this grouping rule does not cover."""
    if args.get("decoupled_lr") is not None:
        raise CheckpointError(f"{where}: the run used --decoupled-lr (its embedding and output layer form their "
                              "own optimizer groups); converting such a checkpoint is not supported")
    if args.get("use_mup"):
        raise CheckpointError(f"{where}: the run used MuP (per-layer learning rates form their own optimizer "
                              "groups); converting such a checkpoint is not supported")


def assign(params: dict[str, tuple[str, int]], groups: list[dict], args: dict, where: str) -> dict[str, int]:
    """``{name: group index}`` for ``params``: ``{name: (the whole parameter's name as the run's model
    had it, its number of dimensions)}`` (a gated MLP's halves are judged as the weight they split)."""
    refuse_unknown_rules(args, where)
    decays = bool(args.get("apply_wd_to_qk_layernorm", False))
    chosen, used = {}, set()
    for name, (whole, ndim) in params.items():
        wd = _wd_mult(whole, ndim, decays)
        matches = [i for i, g in enumerate(groups) if float(g.get("wd_mult", 1.0)) == wd
                   and not g.get("is_expert_parallel", False) and not g.get("is_decoupled_lr", False)]
        if len(matches) != 1:
            raise CheckpointError(
                f"{where}: parameter {name} (wd_mult {wd} by Megatron-Core's standard rule) matches "
                f"{len(matches)} of the checkpoint's {len(groups)} optimizer groups; the run's groups were not "
                "built by the standard rule, and converting them is not supported")
        chosen[name] = matches[0]
        used.add(matches[0])
    unused = sorted(set(range(len(groups))) - used)
    if unused:
        group = {k: v for k, v in groups[unused[0]].items() if k not in NOT_PER_PARAMETER}
        raise CheckpointError(f"{where}: optimizer group {unused[0]} ({group}) matches none of the checkpoint's "
                              "parameters by Megatron-Core's standard rule; converting its groups is not supported")
    return chosen


def per_parameter(group: dict) -> dict:
    """The group's fields as fsdp_dtensor keeps them for each of its parameters."""
    return {k: v for k, v in group.items() if k not in NOT_PER_PARAMETER}
