"""Every subcommand's help speaks with one voice: one form for a switch's default and one for none, no internal
option shown, and a bad value (a choice included) is one line naming the option, exit 2."""

from __future__ import annotations

import argparse
import re

import pytest

from gptop.cli import build_parser, main

PARSER = build_parser()
COMMANDS = sorted(PARSER.commands)


def helps():
    yield "gptop", PARSER.format_help()
    for name, sub in PARSER.commands.items():
        yield f"gptop {name}", sub.format_help()


def test_there_are_subcommands_to_check():
    assert {"train", "tune", "report", "export", "sample"} <= set(COMMANDS)


@pytest.mark.parametrize("name, text", list(helps()), ids=lambda x: x if isinstance(x, str) and x.startswith("gptop") else "")
def test_defaults_are_written_one_way_and_internals_are_hidden(name, text):
    flat = " ".join(text.split())
    assert not re.search(r"\(default: (True|False|None)\b", flat), name
    assert "--channel" not in flat, name


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_choice_is_one_line_naming_the_option(command, capsys):
    sub = PARSER.commands[command]
    choice = next((a for a in sub.actions if a.choices and a.option_strings and not isinstance(a.choices, dict)),
                  None)
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
