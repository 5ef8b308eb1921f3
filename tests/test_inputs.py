"""Every input is checked where it enters (issue 10 §2): exit 2 naming the option, the value and what is accepted,
before a trainer process is started or a directory created.

Table-driven over the classes, not the examples: every numeric field of the config (iterated from the dataclasses)
with NaN, infinities, out-of-range and huge values, as a flag and as a TOML key; every numeric flag of gptop's own
(iterated from its parser); every path option (the config's, found by their metadata, and gptop's own) with each
way a path can be wrong; for both `gptop train` and `python -m trainer`. Most cases parse in this process (fast);
a few real subprocesses prove the exit code, that nothing is created and that no traceback is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import gptop_env
from trainer.contract import inputs
from trainer.contract.config import (
    AUTO,
    ConfigError,
    Range,
    Toggles,
    TrainConfig,
    add_arguments,
    config_from_args,
    config_from_toml,
    flag_of,
    kind_of,
    opt,
    range_of,
)

NUMERIC = [(s, f) for s, f, _ in TrainConfig().items() if kind_of(f) in (int, float)]
PATH_FIELDS = {f.metadata["path"]: flag_of(f) for _, f, _ in TrainConfig().items() if f.metadata.get("path")}


# --- numbers ------------------------------------------------------------------------------------------------------


def test_every_numeric_option_declares_a_range():
    assert len(NUMERIC) >= 15
    for _, f in NUMERIC:
        assert isinstance(range_of(f), Range), f"{f.name} has no range"
    with pytest.raises(TypeError, match="without a range"):
        opt(3, "a new numeric option")
    with pytest.raises(TypeError, match="without a range"):
        opt(0.5, "a new numeric option")


def bad_values(f) -> list[float | int | str]:
    """NaN, infinities, a huge number, and the first values outside the range on each side."""
    rng, out = range_of(f), [float("nan"), float("inf"), float("-inf"), 10**30, "9" * 40]
    if rng.low is not None:
        out.append(rng.low if rng.low_open else rng.low - 1)
    if rng.high is not None:
        out.append(rng.high if rng.high_open else rng.high + 1)
    return out


def parse(argv, base=None):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv), base)


def _text(v) -> str:
    return v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)


def _toml(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return _text(v)


@pytest.mark.parametrize("section,f", NUMERIC, ids=[f.name for _, f in NUMERIC])
def test_numeric_flag_refuses_nan_inf_out_of_range_and_huge(section, f):
    flag = flag_of(f)
    for value in bad_values(f):
        with pytest.raises(ConfigError) as e:
            parse([f"{flag}={_text(value)}"])
        msg = str(e.value)
        assert e.value.option == flag, msg
        assert f"accepted: {range_of(f)}" in msg, msg
        shown = _text(value)
        assert shown[:20] in msg or repr(float(shown)) in msg, msg  # the value, as given or as read


@pytest.mark.parametrize("section,f", NUMERIC, ids=[f.name for _, f in NUMERIC])
def test_numeric_toml_key_refuses_the_same_naming_the_file_and_key(section, f, tmp_path):
    toml = tmp_path / "c.toml"
    for value in bad_values(f):
        literal = _toml(value) if not isinstance(value, str) else value  # "9"*40: a TOML integer
        toml.write_text(f"[{section}]\n{f.name} = {literal}\n")
        with pytest.raises(ConfigError) as e:
            parse(["--config", str(toml)])
        msg = str(e.value)
        assert str(toml) in msg and f"{section}.{f.name}" in msg and "accepted: " in msg, msg


@pytest.mark.parametrize("section,f", NUMERIC, ids=[f.name for _, f in NUMERIC])
def test_numeric_range_ends_are_accepted(section, f):
    rng = range_of(f)
    for end, is_open in ((rng.low, rng.low_open), (rng.high, rng.high_open)):
        if end is None or is_open:
            continue
        value = int(end) if kind_of(f) is int else float(end)
        cfg = TrainConfig.from_dict({section: {f.name: str(value)}}, text=True)
        assert getattr(getattr(cfg, section), f.name) == value


def test_the_examples_of_the_issue():
    for flag, value in (
        ("--min-lr-ratio", "nan"),
        ("--weight-decay", "-1"),
        ("--lr", "inf"),
        ("--grad-clip", "-1"),
        ("--nan-lr-factor", "0"),
        ("--val-fraction", "nan"),
        ("--seed", str(2**64)),
        ("--max-steps", str(10**8)),
        ("--seq-len", str(1 << 21)),
    ):
        with pytest.raises(ConfigError) as e:
            parse([flag, value])
        assert e.value.option == flag


def test_validate_checks_every_field_of_a_config_built_in_code():
    for section, f in NUMERIC:
        cfg = TrainConfig()
        setattr(getattr(cfg, section), f.name, float("nan"))
        with pytest.raises(ConfigError) as e:
            cfg.validate()
        assert e.value.option == flag_of(f)
    cfg = TrainConfig()
    cfg.toggles.precision = "fp64"
    with pytest.raises(ConfigError, match="--precision"):
        cfg.validate()
    cfg = TrainConfig()
    cfg.toggles.micro_batch = "8"  # the old string form, set in code: one type now
    with pytest.raises(ConfigError, match="--micro-batch"):
        cfg.validate()


def test_formats_and_world_split():
    for argv, flag in (
        (["--device", "gpu"], "--device"),
        (["--device", "cuda:x"], "--device"),
        (["--profile-steps", "3-1"], "--profile-steps"),
        (["--micro-batch", "3"], "--micro-batch"),
        (["--size", "huge"], "--size"),
    ):
        with pytest.raises((ConfigError, SystemExit)) as e:
            parse(argv)
        if isinstance(e.value, ConfigError):
            assert e.value.option == flag
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ConfigError, match="--global-batch"):
        config_from_args(p.parse_args(["--global-batch", "16"]), world_size=3)
    with pytest.raises(ConfigError, match="--micro-batch: 8 does not divide the per-rank batch 4"):
        config_from_args(p.parse_args(["--global-batch", "16", "--micro-batch", "8"]), world_size=4)


def test_wrongly_typed_toml_names_the_file_and_key(tmp_path):
    toml = tmp_path / "c.toml"
    for body, key in (
        ('[optim]\nlr = "fast"\n', "optim.lr"),
        ("[model]\nmodel = 5\n", "model.model"),
        ('[toggles]\nfused_adamw = "yes"\n', "toggles.fused_adamw"),
        ('[toggles]\nprecision = "fp64"\n', "toggles.precision"),
        ("[log]\nprofile_steps = [1, 2]\n", "log.profile_steps"),
        ("optim = 3\n", "[optim]"),
        ("lr = 0.1\n", "[lr]"),
        ("[optim]\nseed = true\n", "optim.seed"),
    ):
        toml.write_text(body)
        with pytest.raises(ConfigError) as e:
            parse(["--config", str(toml)])
        assert str(toml) in str(e.value) and key in str(e.value), str(e.value)


# --- micro_batch: one type --------------------------------------------------------------------------------------


def test_micro_batch_is_an_int_or_auto_everywhere(tmp_path):
    assert parse(["--micro-batch", "8"]).toggles.micro_batch == 8
    assert parse(["--micro-batch", "auto"]).toggles.micro_batch == AUTO
    assert parse([]).toggles.micro_batch_int() is None
    old = tmp_path / "old.toml"  # config.toml / best.toml written before it was a number
    old.write_text('[toggles]\nmicro_batch = "8"\n')
    assert config_from_toml(old).toggles.micro_batch == 8
    from tuner.tuning_report import best_toml, check_best_toml

    for mb in (8, AUTO):
        text = best_toml(Toggles(micro_batch=mb))
        check_best_toml(text, Toggles(micro_batch=mb))
        (tmp_path / "best.toml").write_text(text)
        assert config_from_toml(tmp_path / "best.toml").toggles.micro_batch == mb
    check_best_toml(best_toml({**Toggles().__dict__, "micro_batch": "16"}), {**Toggles().__dict__, "micro_batch": 16})


# --- gptop's own numeric flags ----------------------------------------------------------------------------------


def _gptop_number_actions():
    from gptop.cli import build_parser

    parser = build_parser()
    out = []
    for name, p in [("", parser), *parser.commands.items()]:
        for a in p.actions:
            assert a.type not in (int, float), f"{name} {a.option_strings}: use number_arg, not a bare {a.type}"
            if getattr(a.type, "range", None) is not None:
                out.append((name, a.option_strings[0], a.type))
    return out


GPTOP_NUMBERS = _gptop_number_actions()


def test_gptop_numeric_flags_are_found():
    flags = {flag for _, flag, _ in GPTOP_NUMBERS}
    assert {"--interval", "--nproc", "--restart-on-failure", "--node-rank", "--max-trials"} <= flags


@pytest.mark.parametrize(
    "command,flag,convert", GPTOP_NUMBERS, ids=[f"{c or 'monitor'}{f}" for c, f, _ in GPTOP_NUMBERS]
)
def test_gptop_numeric_flag_refusals(command, flag, convert, capsys, monkeypatch):
    from gptop import cli

    monkeypatch.setattr(cli, "Session", _never)
    rng: Range = convert.range
    values = ["nan", "inf", "-inf", "9" * 40, "abc"]
    if rng.low is not None:
        values.append(str(rng.low if rng.low_open else rng.low - 1))
    if rng.high is not None:
        values.append(str(rng.high if rng.high_open else rng.high + 1))
    for value in values:
        with pytest.raises(SystemExit) as e:
            cli.main([*([command] if command else []), f"{flag}={value}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err and "accepted: " in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["tune", "--budget", "nan"], "--budget"),
        (["tune", "--budget", "400d"], "--budget"),
        (["train", "--tune=-5m"], "--tune"),
        (["tune", "--budget", "0.5s"], "--budget"),
        (["train", "--profile-steps", "2000-2001", "--max-steps", "100"], "--profile-steps"),
        (["train", "--nnodes", "0"], "--nnodes"),
        (["train", "--nnodes", "4:2"], "--nnodes"),
        (["train", "--rdzv-endpoint", "host:99999"], "--rdzv-endpoint"),
        (["train", "--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["train", "--tune-space", "micro_batch=0"], "--tune-space"),
        (["train", "--tune-space", "workers=nan"], "--tune-space"),
        (["train", "--tune-space", "nonsense"], "--tune-space"),
        (["tune", "--stable-within", "5"], "--stable-within"),  # a number without its % sign
        (["tune", "--stable-within", "0.05"], "--stable-within"),
        (["tune", "--stable-within", "0%"], "--stable-within"),
        (["tune", "--stable-within", "30%"], "--stable-within"),
        (["train", "--stable-within", "nan%"], "--stable-within"),
        (["tune", "--stable-within", "-3%"], "--stable-within"),
    ],
)
def test_gptop_other_flags(argv, needle, capsys, monkeypatch):
    from gptop import cli

    monkeypatch.setattr(cli, "Session", _never)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err


def _duration_actions():
    """Every gptop flag that takes a duration (tuner.budget.duration_arg), in every subcommand."""
    from gptop.cli import build_parser

    parser = build_parser()
    return [
        (name, a)
        for name, p in [("", parser), *parser.commands.items()]
        for a in p.actions
        if getattr(a.type, "__name__", "") == "duration"
    ]


def test_every_duration_flag_needs_a_unit_and_says_so(capsys, monkeypatch):
    """`--budget 2` once meant 2 seconds, silently: 0 trials ran. Every duration flag refuses a number without a
    unit (exit 2, the flag, the accepted forms) and its help gives the format; a flag that takes plain seconds
    says so in its metavar and help (`--interval S`, `--timeout S`)."""
    from gptop import cli

    monkeypatch.setattr(cli, "Session", _never)
    found = _duration_actions()
    assert {a.option_strings[0] for _, a in found} >= {"--budget", "--tune"}
    for command, action in found:
        flag = action.option_strings[0]
        assert "90s" in action.help and "unit" in action.help, (flag, action.help)
        for value in ("2", "2.5", "0", "45 "):
            with pytest.raises(SystemExit) as e:
                cli.main([command, f"{flag}={value}"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and flag in err and "has no unit" in err and "1h30m" in err, err
        for value in ("5x", "-5m", "1h1h"):
            with pytest.raises(SystemExit) as e:
                cli.main([command, f"{flag}={value}"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and flag in err and "accepted" in err and "Traceback" not in err, err
    from gptop.cli import build_parser

    parser = build_parser()
    for name, p in [("", parser), *parser.commands.items()]:
        for a in p.actions:
            words = (a.help or "").lower()
            if (
                a.option_strings
                and any(w in words for w in ("seconds", "minutes", "duration"))
                and getattr(a.type, "__name__", "") != "duration"
                and a.type is not None
            ):
                assert a.metavar == "S" and "seconds" in words, (name, a.option_strings, a.help)


def _never(*a, **kw):
    raise AssertionError("a session was created: an input passed its checks")


# --- paths ----------------------------------------------------------------------------------------------------------


def write(p: Path, data: bytes | str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def good_tokenizer(d: Path) -> Path:
    write(d / "tokenizer.json", json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}))
    return d


def good_model(d: Path, positions: int = 512) -> Path:
    write(d / "config.json", json.dumps({"model_type": "llama", "max_position_embeddings": positions}))
    write(d / "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    good_tokenizer(d)
    return d


def model_without_tokenizer(d: Path) -> Path:
    (good_model(d) / "tokenizer.json").unlink()
    return d


def good_run(d: Path) -> Path:
    write(d / "config.toml", TrainConfig().to_toml())
    write(d / "checkpoints" / "step-00000002.pt", b"PK\x03\x04 a zip")
    write(d / "events.jsonl", '{"type": "hello", "t": 0}\n')
    return d


UNREADABLE = PermissionError(13, "Permission denied")

# (option, failure kind, setup(tmp) -> (argv, fake)) where fake is None, ("unreadable", path) or ("readonly", path);
# every path option of the config (by metadata) and --config must have each kind that applies to it.
PATH_CASES = [
    ("--config", "missing", lambda t: (["--config", str(t / "nope.toml")], None), "does not exist"),
    ("--config", "directory", lambda t: (["--config", str((t / "d").mkdir() or t / "d")], None), "is a directory"),
    (
        "--config",
        "not utf-8",
        lambda t: (["--config", str(write(t / "c.toml", b"\xff\xfe[optim]"))], None),
        "not UTF-8",
    ),
    (
        "--config",
        "not what it claims",
        lambda t: (["--config", str(write(t / "c.toml", "a = = b"))], None),
        "not valid TOML",
    ),
    (
        "--config",
        "unreadable",
        lambda t: (["--config", str(write(t / "c.toml", ""))], ("unreadable", t / "c.toml")),
        "Permission denied",
    ),
    ("--data", "missing", lambda t: (["--data", str(t / "nope.txt")], None), "does not exist"),
    (
        "--data",
        "directory without data",
        lambda t: (["--data", str(write(t / "d" / "x.csv", "a").parent)], None),
        "holds no",
    ),
    (
        "--data",
        "unknown extension",
        lambda t: (["--data", str(write(t / "x.csv", "a,b"))], None),
        "unsupported file type",
    ),
    ("--data", "not utf-8", lambda t: (["--data", str(write(t / "x.txt", b"caf\xe9 " * 10))], None), "not UTF-8"),
    ("--data", "binary", lambda t: (["--data", str(write(t / "x.txt", b"\x00\x01\x02" * 10))], None), "binary"),
    (
        "--data",
        "not what it claims (jsonl)",
        lambda t: (["--data", str(write(t / "x.jsonl", "plain text\n"))], None),
        "not valid JSON",
    ),
    (
        "--data",
        "not what it claims (parquet)",
        lambda t: (["--data", str(write(t / "x.parquet", "text"))], None),
        "not a parquet file",
    ),
    (
        "--data",
        "unreadable",
        lambda t: (["--data", str(write(t / "x.txt", "hello"))], ("unreadable", t / "x.txt")),
        "Permission denied",
    ),
    (
        "--data",
        "unreadable folder",
        lambda t: (["--data", str(write(t / "d" / "x.txt", "hi").parent)], ("unreadable", t / "d" / "x.txt")),
        "Permission denied",
    ),
    ("--data", "empty file", lambda t: (["--data", str(write(t / "x.txt", ""))], None), "is empty"),
    ("--data", "empty string", lambda t: (["--data", ""], None), "is empty"),
    ("--tokenizer", "missing", lambda t: (["--tokenizer", str(t / "nope")], None), "does not exist"),
    (
        "--tokenizer",
        "no tokenizer files",
        lambda t: (["--tokenizer", str((t / "d").mkdir() or t / "d")], None),
        "holds no tokenizer files",
    ),
    (
        "--tokenizer",
        "not utf-8",
        lambda t: (["--tokenizer", str(write(t / "d" / "tokenizer.json", b"\xff").parent)], None),
        "not UTF-8",
    ),
    (
        "--tokenizer",
        "not what it claims",
        lambda t: (["--tokenizer", str(write(t / "tokenizer.json", "[1, 2]"))], None),
        "not an object",
    ),
    (
        "--tokenizer",
        "unreadable",
        lambda t: (["--tokenizer", str(good_tokenizer(t / "d"))], ("unreadable", t / "d" / "tokenizer.json")),
        "Permission denied",
    ),
    ("--model", "missing", lambda t: (["--model", str(t / "nope")], None), "neither a model family"),
    ("--model", "a file", lambda t: (["--model", str(write(t / "m.bin", "x"))], None), "is a file"),
    (
        "--model",
        "no config.json",
        lambda t: (["--model", str((t / "d").mkdir() or t / "d")], None),
        "has no config.json",
    ),
    (
        "--model",
        "no weights",
        lambda t: (["--model", str(write(t / "d" / "config.json", '{"model_type": "llama"}').parent)], None),
        "has no weights",
    ),
    (
        "--model",
        "not utf-8",
        lambda t: (["--model", str(write(t / "d" / "config.json", b"\xff{").parent)], None),
        "not UTF-8",
    ),
    (
        "--model",
        "unreadable",
        lambda t: (["--model", str(good_model(t / "d"))], ("unreadable", t / "d" / "config.json")),
        "Permission denied",
    ),
    (
        "--model",
        "no tokenizer",
        lambda t: (["--model", str(model_without_tokenizer(t / "d"))], None),
        "holds no tokenizer files",
    ),
    (
        "--model",
        "not a transformers config",
        lambda t: (["--model", str(write(good_model(t / "d") / "config.json", "{}").parent)], None),
        "model_type",
    ),
    (
        "--seq-len",
        "beyond a gpt2-style n_positions",
        lambda t: (
            [
                "--model",
                str(write(good_model(t / "d") / "config.json", '{"model_type": "gpt2", "n_positions": 64}').parent),
                "--seq-len",
                "128",
            ],
            None,
        ),
        "64 positions",
    ),
    (
        "--seq-len",
        "beyond the model's positions",
        lambda t: (["--model", str(good_model(t / "d", 128)), "--seq-len", "256"], None),
        "128 positions",
    ),
    ("--resume", "missing", lambda t: (["--resume", str(t / "nope")], None), "does not exist"),
    (
        "--resume",
        "nothing to resume",
        lambda t: (["--resume", str((t / "d").mkdir() or t / "d")], None),
        "nothing to resume",
    ),
    (
        "--resume",
        "made no checkpoint",
        lambda t: (["--resume", str(write(t / "r" / "config.toml", "").parent)], None),
        "made no checkpoint",
    ),
    (
        "--resume",
        "not a checkpoint",
        lambda t: (["--resume", str(write(t / "step-00000001.pt", "hello"))], None),
        "not a checkpoint",
    ),
    (
        "--resume",
        "unreadable",
        lambda t: (["--resume", str(write(t / "c.pt", b"PK\x03\x04"))], ("unreadable", t / "c.pt")),
        "Permission denied",
    ),
    (
        "--resume",
        "malformed config.toml",
        lambda t: (["--resume", str(write(good_run(t / "r") / "config.toml", "[optim\n").parent)], None),
        "config.toml is not valid TOML",
    ),
    (
        "--resume",
        "wrongly typed config.toml",
        lambda t: (
            ["--resume", str(write(good_run(t / "r") / "config.toml", "[optim]\nmax_steps = 'x'\n").parent)],
            None,
        ),
        "optim.max_steps",
    ),
    ("--run-dir", "empty string", lambda t: (["--run-dir", ""], None), "is empty"),
    ("--run-dir", "a file", lambda t: (["--run-dir", str(write(t / "f", "x"))], None), "is a file"),
    ("--run-dir", "under a file", lambda t: (["--run-dir", str(write(t / "f", "x") / "run")], None), "is a file"),
    (
        "--run-dir",
        "read-only",
        lambda t: (["--run-dir", str(t / "ro" / "run")], ("readonly", t / "ro")),
        "read-only file system",
    ),
    (
        "--run-dir",
        "not writable",
        lambda t: (["--run-dir", str(t / "locked")], ("notwritable", t / "locked")),
        "not writable",
    ),
]

ROOT_CASES_BY_OPTION = {c[0] for c in PATH_CASES}


def test_every_path_option_of_the_config_is_in_the_table():
    assert set(PATH_FIELDS.values()) <= ROOT_CASES_BY_OPTION, set(PATH_FIELDS.values()) - ROOT_CASES_BY_OPTION
    kinds = {}
    for option, kind, _, _ in PATH_CASES:
        kinds.setdefault(option, set()).add(kind)
    for option in ("--config", "--data", "--tokenizer", "--model", "--resume"):
        assert {"missing", "unreadable"} <= kinds[option], option


PATHLIKE = ("PATH", "DIR", "TOML", "URL", "FILE")


def test_every_path_flag_is_checked():
    """A config field that takes a path names its check; a gptop flag or argument that takes one (any subcommand,
    a new one included) runs an input check as its argparse type."""
    for _, f, _ in TrainConfig().items():
        if any(w in (f.metadata.get("metavar") or "") for w in PATHLIKE):
            assert f.metadata.get("path") in inputs.PATH_CHECKS, f"{f.name}: no input check"
    from gptop.cli import build_parser

    parser = build_parser()
    assert {"train", "tune", "report"} <= set(parser.commands)
    for name, p in [("", parser), *parser.commands.items()]:
        for a in p.actions:
            pathlike = any(w in (a.metavar or "") for w in PATHLIKE)
            if pathlike and "." not in a.dest and a.dest != "config":
                assert getattr(a.type, "check", None) is not None, f"gptop {name} {a.option_strings or a.dest}"


def apply_fake(monkeypatch, fake):
    if fake is None:
        return
    kind, target = fake
    target = Path(target)
    if kind == "unreadable":
        real_head, real_list = inputs.read_head, inputs.list_dir

        def read_head(path, n):
            if Path(path) == target:
                raise UNREADABLE
            return real_head(path, n)

        def list_dir(path):
            if Path(path) == target:
                raise UNREADABLE
            return real_list(path)

        monkeypatch.setattr(inputs, "read_head", read_head)
        monkeypatch.setattr(inputs, "list_dir", list_dir)
    else:
        target.mkdir(parents=True, exist_ok=True)
        real = inputs.writable
        why = "on a read-only file system" if kind == "readonly" else "not writable (permission denied)"
        monkeypatch.setattr(inputs, "writable", lambda p: why if Path(p) == target else real(p))


def run_gptop(argv, monkeypatch) -> tuple[int, str]:
    from gptop import cli

    monkeypatch.setattr(cli, "Session", _never)
    try:
        return cli.main(["--no-ui", "train", *argv]), ""
    except SystemExit as e:
        return e.code, ""


def run_trainer(argv, monkeypatch) -> tuple[int, str]:
    import trainer.runner
    from trainer import worker_cli as cli

    monkeypatch.setattr(trainer.runner, "main_run", _never)
    return cli.main(argv), ""


@pytest.mark.parametrize("run", [run_gptop, run_trainer], ids=["gptop", "trainer"])
@pytest.mark.parametrize("option,kind,setup,reason", PATH_CASES, ids=[f"{c[0]}:{c[1]}" for c in PATH_CASES])
def test_path_failures_exit_2_naming_the_option(run, option, kind, setup, reason, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv, fake = setup(tmp_path)
    apply_fake(monkeypatch, fake)
    before = sorted(p for p in tmp_path.rglob("*"))
    code, _ = run([*argv, "--size", "tiny", "--device", "cpu"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert option in err and reason in err and "Traceback" not in err, err
    assert sorted(p for p in tmp_path.rglob("*")) == before, "something was created"


@pytest.mark.process
def test_real_read_only_filesystem(tmp_path, capsys, monkeypatch):
    """A real read-only mount where the tests may mount (root in a container), the fake above otherwise."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        code, _ = run_gptop(["--run-dir", str(mnt / "run")], monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and "--run-dir" in err and "read-only file system" in err, err
        code, _ = run_trainer(["--run-dir", str(mnt)], monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and "read-only file system" in err, err
        with pytest.raises(ConfigError, match="read-only"):
            inputs.check_storage(f"sqlite:///{mnt}/tuning.sqlite3")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_toml_path_is_expanded_once_so_the_checks_see_what_the_run_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    toml = write(tmp_path / "c.toml", '[run]\nrun_dir = "~/runs/x"\n[data]\ndata = "~/nope.txt"\n')
    with pytest.raises(ConfigError, match=f"--data: {tmp_path}/nope.txt does not exist"):
        parse(["--config", str(toml)])
    write(tmp_path / "nope.txt", "some text")
    assert parse(["--config", str(toml)]).run.run_dir == f"{tmp_path}/runs/x"


def test_valid_paths_pass(tmp_path, monkeypatch):
    """The same checks accept what is right (so the refusals above are about the fault, not the setup)."""
    monkeypatch.chdir(tmp_path)
    run = good_run(tmp_path / "run")
    write(tmp_path / "data" / "a.txt", "hello world\n")
    write(tmp_path / "data" / "b.jsonl", '{"text": "hi"}\n')
    cfg = parse(
        [
            "--data",
            str(tmp_path / "data"),
            "--model",
            str(good_model(tmp_path / "m")),
            "--run-dir",
            str(tmp_path / "new" / "run"),
            "--seq-len",
            "512",
        ]
    )
    assert cfg.model.model.endswith("m")
    from trainer.worker_cli import parse_config

    resumed = parse_config(["--resume", str(run)])
    assert resumed.run.run_dir == str(run) and resumed.checkpoint.resume == str(run)
    old = good_run(tmp_path / "old")
    write(old / "config.toml", '[toggles]\nmicro_batch = "8"\n')  # written before micro_batch was a number
    assert parse_config(["--resume", str(old)]).toggles.micro_batch == 8
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()


# --- gptop's own path inputs -------------------------------------------------------------------------------------

STORAGE_CASES = [
    ("nonsense", None, "neither an Optuna storage URL"),
    ("journal:", None, "needs a file path"),
    ("sqlite:///{t}/d", None, "is a directory"),
    ("sqlite:///{t}/not.db", None, "not an SQLite database"),
    ("sqlite:///{t}/f/x.db", None, "is a file, not a directory"),
    ("journal:{t}/j.log", None, "not an Optuna journal file"),
    ("journal:{t}/ok.log", ("unreadable", "{t}/ok.log"), "Permission denied"),
    ("journal:{t}/ok.log", ("notwritable", "{t}/ok.log"), "not writable"),
    ("sqlite:///{t}/ro/x.db", ("readonly", "{t}/ro"), "read-only file system"),
]


@pytest.mark.parametrize("url,fake,reason", STORAGE_CASES)
def test_storage_url_checks(url, fake, reason, tmp_path, monkeypatch, capsys):
    (tmp_path / "d").mkdir()
    write(tmp_path / "not.db", "hello")
    write(tmp_path / "f", "x")
    write(tmp_path / "j.log", "not json\n")
    write(tmp_path / "ok.log", '{"op_code": 0}\n')
    if fake is not None:
        target = Path(fake[1].format(t=tmp_path))
        if fake[0] == "notwritable":
            monkeypatch.setattr(
                inputs, "writable", lambda p: "not writable (permission denied)" if Path(p) == target else None
            )
        else:
            apply_fake(monkeypatch, (fake[0], target))
    code, _ = run_gptop(["--storage", url.format(t=tmp_path)], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "--storage" in err and reason in err, err


def test_storage_accepts_what_optuna_takes(tmp_path):
    for url in (
        None,
        f"sqlite:///{tmp_path}/new/x.db",
        f"journal:{tmp_path}/j.log",
        "postgresql://u@h/db",
        "mysql+pymysql://u@h/db",
        "sqlite://",
    ):
        inputs.check_storage(url)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda t: t / "nope", "does not exist"),
        (lambda t: write(t / "f", "x"), "is a file"),
        (lambda t: t / "empty", "has no events.jsonl"),
        (lambda t: write(t / "r" / "events.jsonl", "").parent, "Permission denied"),
    ],
)
def test_report_and_monitor_run_dirs(make, reason, tmp_path, monkeypatch, capsys):
    from gptop import cli

    (tmp_path / "empty").mkdir()
    target = make(tmp_path)
    if reason == "Permission denied":
        apply_fake(monkeypatch, ("unreadable", target / "events.jsonl"))
    for argv, name in ((["report", str(target)], "RUN_DIR"), (["--run-dir", str(target)], "--run-dir")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        expect = "holds no run" if name == "--run-dir" and reason.startswith("has no") else reason
        assert e.value.code == 2 and name in err and expect in err, err


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda t: t, "is a directory"),
        (lambda t: write(t / "f", "x") / "doctor.log", "is a file, not a directory"),
        (lambda t: t / "ro" / "doctor.log", "read-only"),
    ],
)
def test_a_file_to_write_is_checked_where_it_enters(make, reason, tmp_path, monkeypatch, capsys):
    """`gptop doctor --log FILE`: a file gptop writes must be one it can write, or exit 2 naming the flag."""
    from gptop import cli

    target = make(tmp_path)
    if reason == "read-only":
        apply_fake(monkeypatch, ("readonly", tmp_path / "ro"))
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--log", str(target)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--log" in err and reason in err, err
    assert inputs.check_file_to_write(tmp_path / "new" / "doctor.log", "--log") == tmp_path / "new" / "doctor.log"
    assert not (tmp_path / "new").exists()


# --- real processes: exit 2, nothing created, no traceback ---------------------------------------------------------


@pytest.mark.parametrize(
    "cmd,option",
    [
        (["-m", "gptop", "--no-ui", "train", "--resume", "{empty}"], "--resume"),
        (["-m", "gptop", "--no-ui", "train", "--config", "{empty}"], "--config"),
        (["-m", "gptop", "--no-ui", "tune", "--lr", "inf"], "--lr"),
        (["-m", "gptop", "--no-ui", "train", "--interval", "nan"], "--interval"),
        (["-m", "trainer", "--resume", "{empty}"], "--resume"),
        (["-m", "trainer", "--min-lr-ratio", "nan"], "--min-lr-ratio"),
        (["-m", "trainer", "--data", "{empty}/x.csv"], "--data"),
    ],
)
@pytest.mark.process
def test_real_processes_exit_2_and_create_nothing(cmd, option, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, *[c.format(empty=empty) for c in cmd]],
        cwd=work,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert option in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(work.iterdir()) == [] and list(empty.iterdir()) == [], "something was created"
    assert "[trainer]" not in r.stdout + r.stderr  # no trainer process said anything
