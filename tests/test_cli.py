"""The `flatfsdp` command line: one vocabulary of flags across train, estimate
and bench (walked here, parser by parser), help and errors that answer
before torch is imported, and the top-level help that lists the commands.

Each rule is a function over a dict of parsers, so a test can also plant a
violation and see it caught (as test_architecture does for imports).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from flatfsdp.cli import COMMANDS, parse
from flatfsdp.cli.flags import SHARED, STRATEGIES, CommandParser, DefaultsFormatter


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from flatfsdp.bench.options import build_parser as bench
    from flatfsdp.cli.estimate_flags import build_parser as estimate
    from flatfsdp.train.options import build_parser as train

    return {"train": train(), "estimate": estimate(), "bench": bench()}


def _visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions if action.help != argparse.SUPPRESS
            for name in action.option_strings if name not in ("-h", "--help")}


def _hidden(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions if action.help == argparse.SUPPRESS
            for name in action.option_strings}


def undocumented(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Flags without help text, and flags taking a value whose help does not say its default."""
    found = []
    for command, parser in parsers.items():
        formatter = DefaultsFormatter(parser.prog)
        for name, action in _visible(parser).items():
            text = formatter._get_help_string(action)
            if not (action.help or "").strip():
                found.append(f"{command} {name}: no help text")
            elif action.nargs != 0 and "default" not in text:
                found.append(f"{command} {name}: its help does not say its default")
    return sorted(set(found))


def names_used_two_ways(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """A flag in several commands that is not the one shared definition, a
    shared flag whose help is not the shared meaning, and an old spelling shown
    as a flag of its own (the same thing under two names)."""
    found, commands_of = [], {}
    old = {spelling: name for name, flag in SHARED.items() for spelling in flag.old}
    for command, parser in parsers.items():
        for name, action in _visible(parser).items():
            commands_of.setdefault(name, []).append(command)
            if name in old:
                found.append(f"{command} shows {name}, an old spelling of {old[name]}")
            if name in SHARED and not action.help.startswith(SHARED[name].help):
                found.append(f"{command} {name}: not the shared meaning ({SHARED[name].help!r})")
        for name, action in _hidden(parser).items():
            replacement = getattr(action, "replacement", None)
            if replacement is None or old.get(name) not in replacement.option_strings:
                found.append(f"{command} hides {name}, which is no old spelling of the flag it sets")
    found += [f"{name} is in {' and '.join(commands)} but not defined once in flatfsdp.cli.flags.SHARED"
              for name, commands in commands_of.items() if len(commands) > 1 and name not in SHARED]
    return sorted(found)


def _checkpoint_tools() -> dict[str, argparse.ArgumentParser]:
    from flatfsdp.cli.checkpoint_flags import build_parser

    tools = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {f"checkpoint {name}": parser for name, parser in tools.choices.items()}


def test_every_flag_of_every_command_is_documented_with_its_default():
    assert undocumented({**_parsers(), **_checkpoint_tools()}) == []


def test_no_flag_name_is_used_two_ways():
    assert names_used_two_ways(_parsers()) == []


def test_the_walk_catches_what_it_is_for():
    planted = CommandParser(prog="planted")
    planted.add_argument("--quiet-flag", type=int)  # no help
    planted.add_argument("--steps", type=int, default=None, help="how many")  # None, not explained
    planted.add_argument("--seq-len", type=int, default=4, help="tokens per sequence")  # old spelling, shown
    planted.add_argument("--seq-length", type=int, default=4, help="something else")  # not the shared meaning
    planted.add_argument("--hidden", help=argparse.SUPPRESS)  # hidden, and no old spelling
    parsers = {**_parsers(), "planted": planted}
    assert undocumented(parsers) == ["planted --quiet-flag: no help text",
                                     "planted --steps: its help does not say its default"]
    found = names_used_two_ways(parsers)
    assert "planted shows --seq-len, an old spelling of --seq-length" in found
    assert any(f.startswith("planted --seq-length: not the shared meaning") for f in found)
    assert "planted hides --hidden, which is no old spelling of the flag it sets" in found
    assert "--steps is in bench and planted but not defined once in flatfsdp.cli.flags.SHARED" in found


@pytest.mark.parametrize("command, old, new, value", [
    ("train", "--nproc", "nproc_per_node", "3"), ("train", "--seq-len", "seq_length", "64"),
    ("estimate", "--micro-batch", "micro_batch_size", "4"), ("estimate", "--tp", "tensor_model_parallel_size", "2"),
    ("bench", "--batch", "batch", "4"), ("bench", "--nprocs", "nprocs", "3"), ("bench", "--layers", "layers", "3"),
])
def test_old_spellings_work_for_one_release_and_say_so(capsys, command, old, new, value):
    args = _parsers()[command].parse_args([old, value])
    assert getattr(args, new) == int(value)
    err = capsys.readouterr().err
    assert f"{old} is deprecated, use --" in err and "next release" in err


def test_old_strategy_spelling_and_numbers_mean_the_same_in_every_command(capsys):
    assert _parsers()["bench"].parse_args(["--strategy", "1"]).strategy == "optim"
    assert _parsers()["estimate"].parse_args(["--strategy", "0,optim_grads"]).data_parallel_sharding_strategy == \
        ["no_shard", "optim_grads"]


def test_data_path_is_megatrons_name_for_data():
    from flatfsdp.train.options import parse_options

    assert parse_options(["--data-path", "a.jsonl", "b.txt"]).data == ("a.jsonl", "b.txt")


def test_names_kept_without_torch_agree_with_the_code_that_uses_them():
    import flatfsdp
    from flatfsdp.cli.estimate_flags import BUILT_IN_MODELS
    from flatfsdp.estimator.models import BUILT_IN

    assert STRATEGIES == tuple(m.name.lower() for m in flatfsdp.ShardingStrategy)
    assert sorted(BUILT_IN_MODELS) == sorted(BUILT_IN)


# ---- the top level ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_top_level_help_lists_every_command_and_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert all(COMMANDS[name].summary in out for name in COMMANDS)


def test_every_command_names_a_parser_and_a_runner_that_exist():
    for command in COMMANDS.values():
        with pytest.raises(SystemExit) as done:
            command.parse(["--help"])
        assert done.value.code == 0
        assert callable(command.load())


@pytest.mark.parametrize("argv, expected", [
    (["trian"], "flatfsdp: error: unknown command 'trian': did you mean train?"),
    (["train", "--seq-lenght", "4"], "flatfsdp train: error: unrecognized arguments: --seq-lenght 4; did you mean "
                                     "--seq-length?"),
    (["estimate", "--hfsdp"], "flatfsdp estimate: error: --hfsdp needs --hsdp-shard"),
    (["bench", "--contenders", "fsdp3"], "flatfsdp bench: error: unknown contender(s) ['fsdp3']"),
    (["checkpoint", "export", "ckpt"], "flatfsdp checkpoint export: error: the following arguments are required: "
                                       "output"),
])
def test_argument_errors_are_one_line_and_status_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.strip().splitlines()) == 1, err


def test_help_and_argument_errors_never_import_torch():
    """What `flatfsdp [SUB] --help` and a bad flag run, in a fresh interpreter: torch stays unimported."""
    script = textwrap.dedent("""
        import contextlib, io, sys
        from flatfsdp.cli import COMMANDS, parse
        answers = [[], ["--help"], ["--version"], ["trian"], ["checkpoint", "export", "--help"]]
        answers += [[name, "--help"] for name in COMMANDS] + [[name, "--no-such-flag"] for name in COMMANDS]
        answers += [["train", "--micro-batch-size", "0"], ["train", "--seq-len", "x"]]
        for argv in answers:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    parse(argv)
                except SystemExit as done:
                    assert done.code == (0 if not argv or "--help" in argv or "--version" in argv else 2), argv
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
