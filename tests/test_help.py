"""Every option of every script has help text, shows its default, and lists its choices."""

from __future__ import annotations

import argparse
import re

import pytest
from conftest import ROOT, refusal, run_script

import loading
import matrix
import plan
import speed
import visualize
from fsdp2bench.cli import OneLineParser
from fsdp2bench.loading.modes import MODES
from fsdp2bench.names import VARIANTS
from fsdp2bench.options import fsdp as options
from fsdp2bench.run import arguments

SCRIPTS = {"main.py": arguments, "loading.py": loading, "speed.py": speed, "visualize.py": visualize,
           "matrix.py": matrix, "plan.py": plan}
# Options whose help must name every value a user can give (a comma-separated list of names).
NAMED_VALUES = {("main.py", "--variants"): VARIANTS, ("loading.py", "--modes"): MODES,
                ("matrix.py", "--option_sets"): list(options.OPTION_SETS), ("plan.py", "--sets"): list(options.OPTION_SETS),
                ("plan.py", "--variants"): VARIANTS}


class Captured(Exception):
    pass


def parser_of(module, monkeypatch) -> argparse.ArgumentParser:
    """The script's own parser, as its parse_args builds it."""
    found = {}

    def grab(self, *args, **kwargs):
        found["parser"] = self
        raise Captured

    monkeypatch.setattr(OneLineParser, "parse_args", grab)
    monkeypatch.setattr(OneLineParser, "parse_known_args", grab)
    with pytest.raises(Captured):
        module.parse_args([])
    return found["parser"]


def options_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_help_that_shows_its_default(script, monkeypatch):
    parser = parser_of(SCRIPTS[script], monkeypatch)
    for action in options_of(parser):
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{script} {name}: no help"
        if action.option_strings:
            assert "(default: " in action.help, f"{script} {name}: no default shown in {action.help!r}"
        shown = parser.format_help()
        for choice in action.choices or []:
            assert str(choice) in shown, f"{script} {name}: choice {choice} not listed"
        for value in NAMED_VALUES.get((script, name), []):
            assert value in action.help, f"{script} {name}: {value} not named"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_metavar_is_named_in_its_help(script, monkeypatch):
    for action in options_of(parser_of(SCRIPTS[script], monkeypatch)):
        if isinstance(action.metavar, str) and not action.metavar.startswith("{"):  # {a,b}: the choices
            for word in re.findall(r"[A-Z][A-Z_]*", action.metavar):
                assert re.search(rf"\b{word}\b", action.help), f"{script} {action.option_strings}: {word} not in its help"


def test_the_scripts_write_to_output_dirs_of_their_own(monkeypatch):
    defaults = {}
    for script, module in SCRIPTS.items():
        for action in options_of(parser_of(module, monkeypatch)):
            if action.dest == "output_dir":
                defaults[script] = action.default
    assert len(set(defaults.values())) == len(defaults), defaults


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_opens_with_how_to_launch_and_names_its_docs(script, monkeypatch):
    shown = parser_of(SCRIPTS[script], monkeypatch).format_help()
    lines = shown.splitlines()
    assert lines[0].startswith("usage: ") and script in lines[0] and "#" in lines[0], lines[0]
    page = re.search(r"Documentation: (docs/[a-z-]+\.md)", shown)
    assert page and (ROOT / page.group(1)).is_file(), shown[:600]
    assert all(len(line) <= 120 for line in lines), [line for line in lines if len(line) > 120]
    for action in options_of(parser_of(SCRIPTS[script], monkeypatch)):
        if isinstance(action, argparse._StoreTrueAction):
            own = shown.split(action.option_strings[0], 1)[1].split("\n  -")[0]
            assert "a switch, no value" in " ".join(own.split()), action


def test_a_true_or_false_flag_names_the_values_it_takes():
    proc = run_script(["main.py", "--device", "cpu", "--reshard_after_forward", "maybe"], nproc=None)
    assert proc.stderr.strip() == "error: argument --reshard_after_forward: expected true or false, got 'maybe' " \
                                  "(see --help)"


def test_matrix_help_says_main_options_pass_through_and_which_the_sets_own():
    """--loop, --loss and --config_file are main.py's: matrix.py's help, which lists its own options, says that
    main.py's go to every launch, and which it refuses (its sets set them)."""
    proc = run_script(["matrix.py", "--help"], nproc=None)
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert "main.py's options pass through" in said and "python3 main.py --help lists them" in said
    for flag in ("--loop", "--loss", "--config_file", "--model", "--batch_size"):
        assert flag in said.split("pass through")[1]
    for name in matrix.OWNED:
        assert f"--{name}" in said.split("refused here:")[1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_refuses_an_empty_value_rather_than_reading_it_as_not_given(script, monkeypatch):
    """``--model ''`` once trained the default model, matrix.py's ``--simulate_world_size ''`` ran no sweep and plan.py's
    ``--levers ''`` blamed float8: every option that takes a value refuses it empty or blank, in one line naming it."""
    takes_a_value = [a for a in options_of(parser_of(SCRIPTS[script], monkeypatch)) if a.option_strings and a.nargs is None]
    monkeypatch.undo()
    assert takes_a_value
    for action in takes_a_value:
        for value in ("", " "):
            line = refusal(SCRIPTS[script].parse_args, [action.option_strings[0], value])
            assert line is not None and action.option_strings[0] in line, (action.option_strings, value, line)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_refuses_an_empty_item_of_a_list(script, monkeypatch):
    """``--lora_targets q_proj,,v_proj`` trained q and v and said nothing of the name between the commas: a value
    with an empty item between, before or after its commas is refused in one line naming the option (a text option
    by the parser's own check, a number by its type)."""
    takes_a_value = [a for a in options_of(parser_of(SCRIPTS[script], monkeypatch))
                     if a.option_strings and a.nargs is None]
    monkeypatch.undo()
    for action in takes_a_value:
        for value in ("a,,b", ",a", "a,", " , "):
            line = refusal(SCRIPTS[script].parse_args, [action.option_strings[0], value])
            assert line is not None and action.option_strings[0] in line, (action.option_strings, value, line)


def test_an_empty_model_is_refused_by_a_launch():
    proc = run_script(["main.py", "--device", "cpu", "--model", ""], nproc=None)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: --model: an empty value (leave the option out for its default) (see --help)", proc.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*.py")))
def test_every_python_file_at_the_top_runs_or_says_it_is_not_a_script(script):
    """``python3 utils.py --help`` (and measure.py) did nothing and exited 0: each file a newcomer sees beside main.py
    either shows its help or says in one line that it is not a script, and what to run."""
    proc = run_script([script, "--help"], nproc=None)
    if script in SCRIPTS:
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-2000:]
    else:
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert proc.stderr.strip() == f"error: {script} {NOT_SCRIPTS[script]}, not a script: run python3 main.py " \
                                      "(--help lists its options)", proc.stderr


NOT_SCRIPTS = {"utils.py": "holds main.py's four variants", "measure.py": "holds the memory tracker of main.py's runs"}


# A default said in words, not as the value argparse holds: (script, option) -> the words.
DEFAULTS_IN_WORDS = {("main.py", "--variants"): "all four", ("loading.py", "--modes"): "all of them"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_default_said_is_the_default_the_parser_holds(script, monkeypatch):
    """The value after '(default: ' is the option's own default (a number compared as a number), so that help and
    parser cannot drift apart; an option without a value of its own (None) says what happens instead."""
    parser = parser_of(SCRIPTS[script], monkeypatch)
    for action in options_of(parser):
        if not action.option_strings or action.default in (None, False) or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        shown = " ".join(parser._get_formatter()._expand_help(action).split())
        said = shown.rsplit("(default: ", 1)[1].rstrip(")")
        if (script, name) in DEFAULTS_IN_WORDS:
            assert said == DEFAULTS_IN_WORDS[script, name], (script, name, said)
        elif isinstance(action.default, (int, float)):
            assert float(re.split(r"[,;:]? ", said)[0]) == action.default, (script, name, said, action.default)
        else:
            assert re.split(r"[,;:]? ", said)[0] == str(action.default), (script, name, said, action.default)


def test_plans_upper_bound_says_its_default_on_a_gpu_and_on_a_cpu(monkeypatch):
    """The searched range's top differs by device: the help says both (a CPU run's is small, to check the search)."""
    from fsdp2bench.plan.checks import CPU_UPPER, DEFAULT_UPPER

    action = next(a for a in options_of(parser_of(plan, monkeypatch)) if a.dest == "upper_bound")
    said = " ".join(action.help.split())
    assert f"(default: {DEFAULT_UPPER['batch_size']} for a batch" in said
    assert f"on a CPU run {CPU_UPPER['batch_size']} and {CPU_UPPER['block_size']}" in said
