"""Every subcommand's help speaks with one voice: one form for a switch's default and one for none, no internal
option shown, and a bad value (a choice included) is one line naming the option, exit 2."""

from __future__ import annotations

import argparse
import re
import sys

import pytest

from fixtures.terminal import TextStream
from gptop.cli import build_parser, main

PARSER = build_parser()
COMMANDS = sorted(PARSER.commands)


def helps():
    yield "gptop", PARSER.format_help()
    for name, sub in PARSER.commands.items():
        yield f"gptop {name}", sub.format_help()


def test_there_are_subcommands_to_check():
    assert {"train", "tune", "report", "export", "sample"} <= set(COMMANDS)


@pytest.mark.parametrize(
    "name, text", list(helps()), ids=lambda x: x if isinstance(x, str) and x.startswith("gptop") else ""
)
def test_defaults_are_written_one_way_and_internals_are_hidden(name, text):
    flat = " ".join(text.split())
    assert not re.search(r"\(default: (True|False|None)\b", flat), name
    assert "--channel" not in flat, name


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_choice_is_one_line_naming_the_option(command, capsys):
    sub = PARSER.commands[command]
    choice = next((a for a in sub.actions if a.choices and a.option_strings and not isinstance(a.choices, dict)), None)
    if choice is None:
        pytest.skip(f"gptop {command} has no option with choices")
    flag = choice.option_strings[-1]
    args = [command, flag, "no-such-value"]
    if command in ("report", "export", "sample"):
        args.insert(1, "somewhere")
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert flag in err and "no-such-value" in err and "--help" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("gptop ")


def test_a_switch_default_reads_on_or_off():
    text = " ".join(PARSER.commands["train"].format_help().split())
    assert "(default: on)" in text and "(default: off)" in text
    assert isinstance(PARSER.commands["train"], argparse.ArgumentParser)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_a_description_and_its_positionals_have_help(command):
    sub = PARSER.commands[command]
    assert sub.description and len(sub.description) > 20, command
    for a in sub.actions:
        if not a.option_strings and a.dest != "help":
            assert a.help and a.help is not argparse.SUPPRESS, f"gptop {command} {a.metavar or a.dest}"


SAMPLING = {"train", "tune", "run"}


@pytest.mark.parametrize("command", COMMANDS + [None])
def test_json_means_json_lines_everywhere_and_sampling_flags_only_where_they_act(
    command, capsys, tmp_path, monkeypatch
):
    """--json: the command's output as JSON lines on stdout (and no dashboard); --interval and the metrics
    flags act where gptop samples a run, and are refused elsewhere: one line naming the flag, exit 2."""
    from gptop.cli import _check_global_flags

    sub = PARSER if command is None else PARSER.commands[command]
    flags = {s: a for a in sub.actions for s in a.option_strings}
    assert "--json" in flags and "JSON line" in " ".join(flags["--json"].help.split()), command
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    for a in sub.actions:  # what a positional must be is tested elsewhere; the flags are tested here
        if not a.option_strings and a.type is not None:
            monkeypatch.setattr(a, "type", str)
    extra = {"report": ["run"], "export": ["run", "out"], "sample": ["run"], "run": ["--", "true"]}.get(command, [])
    ns = PARSER.parse_args(["--json"] + ([command] if command else []) + extra)
    _check_global_flags(PARSER, ns)
    assert ns.json and ns.no_ui  # one meaning: JSON lines, no dashboard
    if command in SAMPLING or command is None:
        assert "--interval" in flags
        return
    assert "--interval" not in flags and "--metrics-port" not in flags
    for flag, value in (("--interval", "2"), ("--metrics-port", "9100")):
        ns = PARSER.parse_args([flag, value, command] + extra)
        with pytest.raises(SystemExit) as e:
            _check_global_flags(PARSER, ns)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err and "does nothing" in err


@pytest.mark.parametrize("command", COMMANDS + [None])
@pytest.mark.parametrize("stdin_tty,stdout_tty", [(True, True), (False, True), (True, False), (False, False)])
def test_without_a_terminal_a_dashboard_command_prints_lines_and_says_so(
    command, stdin_tty, stdout_tty, monkeypatch, capsys, tmp_path
):
    """The dashboard needs stdin (keys) and stdout (drawing) to be a terminal; without either, the commands
    that have a dashboard (train, tune, run, the monitor) print lines as with --no-ui, saying so in one line
    on stderr; other commands, --no-ui and --json say nothing."""
    from gptop import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    sub = PARSER if command is None else PARSER.commands[command]
    for a in sub.actions:
        if not a.option_strings and a.type is not None:
            monkeypatch.setattr(a, "type", str)
    extra = {"report": ["run"], "export": ["run", "out"], "sample": ["run"], "run": ["--", "true"]}.get(command, [])
    terminal = stdin_tty and stdout_tty
    for given in ([], ["--no-ui"], ["--json"]):
        ns = PARSER.parse_args(given + ([command] if command else []) + extra)
        with pytest.MonkeyPatch.context() as streams:
            streams.setattr(sys, "stdin", TextStream(stdin_tty))
            streams.setattr(sys, "stdout", TextStream(stdout_tty))
            cli._check_global_flags(PARSER, ns)
        err = capsys.readouterr().err
        dashboard = command in cli.SAMPLING and not given
        if dashboard and not terminal:
            assert ns.no_ui and err.count("\n") == 1 and "not a tty" in err and "--no-ui" in err, (command, err)
        else:
            assert err == "", (command, given, err)
            assert ns.no_ui == bool(given) or (not dashboard and not given and not ns.no_ui)
    monkeypatch.setattr(sys, "stdin", None)  # closed by whoever started gptop
    assert not cli.has_terminal()


def test_python_m_trainer_errors_in_one_line(capsys):
    from trainer.worker_cli import build_parser as trainer_parser

    with pytest.raises(SystemExit) as e:
        trainer_parser().parse_args(["--size", "huge"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--size" in err and "huge" in err


def test_a_busy_run_directory_names_the_option_the_user_typed(tmp_path):
    from trainer.contract.config import ConfigError
    from trainer.contract.runlock import RunLock, lock_option

    run = tmp_path / "run"
    held = RunLock.acquire(run, command="test")
    try:
        for resume, option in ((str(run), "--resume"), (None, "--run-dir")):
            assert lock_option(resume, run) == option
            with pytest.raises(ConfigError) as e:
                RunLock.acquire(run, command="gptop train", option=lock_option(resume, run))
            assert e.value.option == option and str(e.value).startswith(option + ":")
    finally:
        held.release()
