"""The docs check (issue 13): every command shown in README.md, docs/*.md and BENCHMARKS.md is run, parsed or
skipped for a stated reason, by an explicit rule table.

* run (slow): the command itself, or its short form from the rule (fewer steps, a smaller batch), in a
  scratch directory where the README's first command, shortened, has made `runs/demo` (one shared run for
  every command that needs a run directory). It must exit 0.
* parse: the command line is parsed as the program would parse it, without running it: `gptop` through its
  own parser and, for train/tune, the same config resolution and input checks that run before anything starts
  (`gptop.preflight.resolve_config`, `check_run_args`); a Python script or module through its argparse parser (the
  run stops when the top-level parse returns). A bad flag, value or path fails the check.
* skip: only with a reason (a GPU, a database server, the network, several machines).

Code blocks are read as shell: a line is a command (a trailing `\\` continues it, `# ...` is a comment, `&&`
chains), except in a block with `$ ` prompts, where only the prompted lines are. Inline code in the text that
starts with `gptop` or `python` is parsed too, with its placeholders (RUN_DIR, TEXT, ...) filled in. A new
command that no rule covers fails `test_every_command_has_a_rule`: add a rule, a short form or a reason.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT, gptop_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]
SHARED_RUN = "runs/demo"  # made by the README's first command (short form) in the scratch directory


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # one command, continuations joined, comment and `$ ` removed
    inline: bool

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.text[:70]}"


def _strip_comment(line: str) -> str:
    """A shell comment: `#` at the start or after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(body: str) -> list[tuple[int, str]]:
    """(line offset, command) for each shell command of a code block."""
    lines = body.split("\n")
    prompted = any(x.startswith("$ ") for x in lines)
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        if prompted:
            if not text.startswith("$ "):
                continue  # the command's output, shown
            text = text[2:]
        text = _strip_comment(text).strip()
        if not text:
            continue
        for part in text.split("&&"):
            out.append((start, part.strip()))
    return out


SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


def extract() -> tuple[list[Command], list[tuple[str, int, str, str]]]:
    """Commands of every doc, and the other code blocks as (doc, line, language, body)."""
    cmds: list[Command] = []
    blocks: list[tuple[str, int, str, str]] = []
    for path in DOCS:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            line = text[: m.start()].count("\n") + 2
            lang, body = m.group(1), m.group(2)
            if lang not in SHELL_LANGS:
                blocks.append((name, line - 1, lang, body))
                continue
            if LISTING.match(body):
                continue  # a directory listing, not commands
            for off, c in block_commands(body):
                cmds.append(Command(name, line + off, c, inline=False))
        prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for m in re.finditer(r"`([^`\n]+)`", prose):
            c = m.group(1)
            if re.match(r"(gptop|python3?|OMP_NUM_THREADS=\S+ python)( |$)", c):
                cmds.append(Command(name, prose[: m.start()].count("\n") + 1, c, inline=True))
    return cmds, blocks


LISTING = re.compile(r"\s*\w+/\s{2,}")  # README's "trainer/   the training worker ..." tree


# --------------------------------------------------------------------------- the rule table
@dataclass(frozen=True)
class Rule:
    pattern: str  # re.search on the command text
    action: str  # run | parse | skip
    reason: str = ""
    short: Callable[[str], str] | None = None  # run: the short form of a command too long to run whole


def flags(**kv: str) -> Callable[[str], str]:
    """A short form: set each --flag to its value (replacing it if the command has it)."""

    def f(cmd: str) -> str:
        for k, v in kv.items():
            flag = "--" + k.replace("_", "-")
            cmd, n = re.subn(rf"{flag}(=| )\S+", f"{flag} {v}", cmd)
            if not n:
                cmd += f" {flag} {v}"
        return cmd

    return f


def no_ui(cmd: str) -> str:
    return cmd if "--no-ui" in cmd else cmd.replace("gptop ", "gptop --no-ui ", 1)


SHORT_TRAIN = flags(max_steps="3", seq_len="64", global_batch="4", log_every="1")

# the README's first command: the shared run every later command uses
FIRST = Rule(
    r"^gptop train --max-steps 200$",
    "run",
    "the shared run (runs/demo), 3 steps",
    lambda c: no_ui(SHORT_TRAIN(c)) + f" --run-dir {SHARED_RUN}",
)  # its own --size auto, as typed

RULES: list[Rule] = [
    # setting up: not what a test does
    Rule(
        r"^python3 -m venv |^\. \S+/activate$|^(uv )?pip install|^createdb ",
        "skip",
        "sets up an environment or a database server (network, root); the tests run in the installed one",
    ),
    Rule(r"-m pytest", "skip", "the test suite itself"),
    Rule(
        r"^ruff (check|format --check) \.$|^mypy$",
        "skip",
        "the lint, format and type checks before the test suite (.ci/run runs them)",
    ),
    Rule(r"^optuna-dashboard ", "skip", "a separate tool (pip install optuna-dashboard) serving a web page"),
    Rule(r"^tensorboard ", "skip", "a separate tool (pip install 'gptop[tensorboard]') serving a web page"),
    FIRST,
    Rule(
        r"^gptop --no-ui train --model llama --size tiny --max-steps 200 --run-dir runs/demo$",
        "parse",
        "the README's first command made this run (llama tiny is what --size auto picks on this CPU)",
    ),
    # models.md: export, load with transformers, sample; the llada family end to end
    Rule(
        r"^gptop export \S+ hf/(adapter|merged)",
        "parse",
        "exports a --lora run's adapters (tests/test_lora.py trains and exports one)",
    ),
    Rule(r"^gptop export ", "run"),
    Rule(r"^gptop sample .*--diffusion-steps", "run", "", flags(max_new_tokens="8", diffusion_steps="4")),
    Rule(r"^gptop sample ", "run", "", flags(max_new_tokens="4")),
    Rule(r"^gptop --no-ui train --model llada .*--run-dir runs/llada$", "run", "", SHORT_TRAIN),
    # monitor and report on the shared run
    Rule(r"^gptop --no-ui --run-dir ", "run"),
    # your own code (docs/your-code.md): the examples, under gptop run and without it
    Rule(
        r"^gptop --no-ui run .*examples/train_lightning\.py",
        "parse",
        "Lightning is an optional extra (pip install 'gptop[lightning]'); tests/test_gptop_run.py and "
        "tests/test_integrations_lightning.py run it where it is installed",
    ),
    Rule(r"^gptop --no-ui run .*examples/", "run", "", flags(steps="10")),
    Rule(r"^python3? examples/", "run", "", flags(steps="10")),
    Rule(
        r"^gptop run -- torchrun ",
        "parse",
        "a script of yours on two ranks (tests/test_gptop_run.py runs two ranks of a test loop under gptop run)",
    ),
    Rule(r"^gptop report ", "run"),
    # minutes of tuning or training, several GPUs or nodes, a database: parsed (tests/test_tuning_e2e.py,
    # tests/test_distributed.py and BENCHMARKS.md run them at test size)
    Rule(r"--nproc [3-9]|--nproc \d\d|--device cuda", "parse", "needs several GPUs"),
    Rule(r"--nnodes [2-9]", "parse", "needs several machines"),
    Rule(r"^gptop tune|--tune ", "parse", "tunes for minutes (tests/test_tuning_e2e.py runs a short one)"),
    Rule(r"-m torch\.distributed\.run ", "parse", "torchrun with 8 GPUs: the trainer's own flags are parsed"),
    Rule(r"^gptop", "parse", "trains for minutes or waits for input; parsed and checked as on a real start"),
    Rule(r"^([A-Z_]+=\S+ )*python3? (bench|docs)/", "parse", "a benchmark or tool that runs for minutes"),
    Rule(
        r"^python3? -m trainer\.sample$",
        "skip",
        "named in prose: the module `gptop sample` runs (its commands run above)",
    ),
    Rule(r"^ls ", "skip", "lists the files the command above it wrote"),
    Rule(r"^git worktree add ", "skip", "makes a second checkout to compare with (bench/dashboard.py --baseline-tree)"),
    Rule(
        r"^WANDB_MODE=offline gptop --no-ui train .*--wandb",
        "parse",
        "trains with wandb, an optional extra (tests/test_wandb.py runs real offline runs)",
    ),
    Rule(r"^wandb sync ", "skip", "uploads to Weights & Biases: needs the network and an account"),
    Rule(
        r"^tensorboard --logdir ",
        "skip",
        "a separate tool serving a web page (tests/test_tensorboard.py reads the files)",
    ),
    Rule(r"^python3? -m trainer", "parse", "the trainer's flags, as `gptop train` takes them"),
    Rule(r"^python3? -m gptop\.doctor ", "parse", "prints the README's table or the schema (tests/test_doctor.py)"),
    Rule(r"^python3? -c ", "skip", "a Python one-liner quoted as a baseline, not a gptop command"),
]


def rule_for(cmd: Command) -> Rule | None:
    for r in RULES:
        if re.search(r.pattern, cmd.text):
            return r
    return None


COMMANDS, OTHER_BLOCKS = extract()


# --------------------------------------------------------------------------- placeholders
def fill(text: str, work: Path, toml: Path) -> str:
    """Placeholders and elisions of the docs made concrete: RUN_DIR and friends are the shared run."""
    run = str(work / SHARED_RUN)
    subs = [
        (r" \.\.\.", ""),
        (r" \[options\]", ""),
        (r"\[RUN_DIR\]", run),
        (r"runs/<run>/best\.toml|FILE\.toml|(?<![/\w])best\.toml", str(toml)),
        (r"runs/<run>", run),
        (r"\bRUN_DIR\b", run),
        (r"--resume RUN\b", f"--resume {run}"),
        (r"/tmp/ui1", run),
        (r"--model OUT_DIR\b", "--model hf/demo"),
        (r"\./my-model\b", "hf/demo"),
        (r"\bOUT_DIR\b", str(work / "hf" / "out")),
        (r"\bTEXT\b", "'def main('"),
        (r"--nproc N\b", "--nproc 1"),
        (r"/shared/runs/run42", str(work / "shared" / "run42")),
        (r"journal:/shared/gptop/", f"journal:{work}/"),
        (r"\bBEFORE\b|\bAFTER\b", str(ROOT)),
        (r"cpu-<isa>-", "cpu-avx512-"),
        (r"\bgptop --budget\b", "gptop tune --budget"),
        (r"tuned/cpu-", str(ROOT / "bench" / "tuned") + "/cpu-"),
    ]
    for pat, rep in subs:
        text = re.sub(pat, rep.replace("\\", "\\\\"), text)
    return text


def argv_of(text: str) -> tuple[dict[str, str], list[str]]:
    """Environment assignments and the argv, with `gptop`/`python` as this interpreter."""
    words = shlex.split(text)
    if "|" in words:
        words = words[: words.index("|")]  # `gptop ... | head`: gptop's own command line
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[0] == "gptop":
        words = [sys.executable, "-m", "gptop", *words[1:]]
    elif words[0] in ("python", "python3"):
        words = [sys.executable, *words[1:]]
    if "--" in words and words[words.index("--") + 1 :][:1] in (["python"], ["python3"]):
        words[words.index("--") + 1] = sys.executable  # `gptop run -- python ...`: this interpreter too
    return env, [str(ROOT / w) if re.match(r"(bench|docs|examples)/\S+\.py$", w) else w for w in words]


# --------------------------------------------------------------------------- parse without running
class Parsed(Exception):
    """Raised when a program's top-level argparse parse returned: it parses, and nothing runs."""


@contextlib.contextmanager
def stop_after_parse():
    original = argparse.ArgumentParser.parse_known_args
    depth = {"n": 0}

    def parse_known_args(self, args=None, namespace=None):
        depth["n"] += 1  # subparsers parse inside their parent's parse
        try:
            result = original(self, args, namespace)
        finally:
            depth["n"] -= 1
        if depth["n"] == 0:
            raise Parsed()
        return result

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def parse_gptop(argv: list[str]) -> None:
    """`gptop ARGV` up to the point where it would start something: its parser, then for train/tune the
    config resolution and the input checks that run before a process starts or a directory is made."""
    from gptop import cli, preflight
    from trainer.contract.config import ConfigError

    ns = cli.build_parser().parse_args(argv)
    if ns.command in ("train", "tune"):
        try:
            preflight.check_run_args(ns, preflight.resolve_config(ns))
        except ConfigError as e:
            pytest.fail(f"gptop: error: {e}")


def parse_python(argv: list[str]) -> None:
    """`python SCRIPT ARGV` or `python -m MODULE ARGV`, run until its argparse parse returns."""
    old = sys.argv
    try:
        with stop_after_parse():
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
    except Parsed:
        return
    finally:
        sys.argv = old


def check_mention(argv: list[str]) -> str | None:
    """Inline prose names a command or a flag (`gptop report`, `gptop tune --budget`) without its values: the
    command must exist and each flag must be one of its options. None if so, else what is wrong."""
    from gptop import cli

    parser = cli.build_parser()
    words = [w for w in argv if not w.startswith("-")]
    if words and words[0] in parser.commands:
        parser = parser.commands[words[0]]
    elif words:
        return f"{words[0]!r} is not a gptop command (choose from {', '.join(parser.commands)})"
    known = {s for a in parser.actions for s in a.option_strings} | {"--no-ui", "--json", "--interval", "--help"}
    bad = [w for w in argv if w.startswith("--") and w.split("=")[0] not in known]
    return f"no such option: {', '.join(bad)}" if bad else None


INCOMPLETE = ("the following arguments are required", "expected one argument")


def check_parses(text: str, inline: bool = False) -> None:
    env, argv = argv_of(text)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[1:3] == ["-m", "gptop"]:
                parse_gptop(argv[3:])
            elif argv[1:3] == ["-m", "torch.distributed.run"]:
                i = argv.index("-m", 3)
                parse_python(argv[i:])
            else:
                parse_python(argv[1:])
    except SystemExit as e:
        if e.code not in (0, None):
            if inline and argv[1:3] == ["-m", "gptop"] and any(x in err.getvalue() for x in INCOMPLETE):
                problem = check_mention(argv[3:])
                if problem is None:
                    return
                pytest.fail(f"{text!r}: {problem}")
            pytest.fail(f"{text!r} does not parse (exit {e.code}): {err.getvalue().strip()[-800:]}")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def docs_toml(tmp_path_factory) -> Path:
    """docs/reference.md's TOML example as a file: the config `--config FILE.toml` and `best.toml` stand for."""
    tomls = [body for doc, _, lang, body in OTHER_BLOCKS if lang == "toml" and doc == "docs/reference.md"]
    assert tomls, "docs/reference.md shows a --config TOML example"
    path = tmp_path_factory.mktemp("toml") / "best.toml"
    path.write_text(tomls[0])
    return path


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs")


def run_here(text: str, work: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env, argv = argv_of(text)
    return subprocess.run(argv, cwd=work, env=gptop_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def shared_run(work: Path) -> Path:
    """The README's first command, short: the run directory every other command reads."""
    first = next(c for c in COMMANDS if rule_for(c) is FIRST)
    cmd = FIRST.short(first.text)
    r = run_here(cmd, work)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stderr[-3000:]}"
    assert (work / SHARED_RUN / "checkpoints").is_dir()
    return work / SHARED_RUN


# --------------------------------------------------------------------------- tests
def test_the_docs_show_commands():
    docs = {c.doc for c in COMMANDS}
    assert {
        "README.md",
        "docs/reference.md",
        "docs/run-directory.md",
        "docs/dashboard.md",
        "docs/models.md",
        "docs/tuning.md",
        "docs/distributed.md",
        "docs/your-code.md",
        "BENCHMARKS.md",
    } <= docs
    assert any(c.text == "gptop train --max-steps 200" for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.id)
def test_every_command_has_a_rule(cmd: Command):
    rule = rule_for(cmd)
    assert rule is not None, f"{cmd.id}: no rule says how to check this command; add one to RULES"
    assert rule.action in ("run", "parse", "skip")
    assert rule.action != "skip" or rule.reason, f"{cmd.id}: a skip needs its reason"


def test_code_blocks_are_shell_toml_or_python():
    langs = {lang for _, _, lang, _ in OTHER_BLOCKS}
    assert COMMANDS and {"toml", "python"} <= langs, "the docs scan found no commands or no toml/python blocks"
    for doc, line, lang, body in OTHER_BLOCKS:
        assert lang in ("toml", "python"), f"{doc}:{line}: a ```{lang} block the docs check does not read"


def test_the_readme_test_command_is_what_ci_runs():
    """The README's test command and .ci/run's are one command (CI only quiets pip), so what a contributor runs
    is what CI runs: two workers (tests/conftest.py orders the files and keeps speed tests alone), and both end
    by listing the slowest tests."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("python3 -m venv ") and " -m pytest " in line
    ]
    assert len(readme) == 1, readme
    assert re.sub(r"\bpip install -q ", "pip install ", ci) == readme[0]
    assert readme[0].endswith(
        " && python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25"
    )


def test_the_toml_example_is_a_valid_config(docs_toml: Path):
    from trainer.contract.config import config_from_toml

    config_from_toml(docs_toml).validate()


def _needs_run(text: str) -> bool:
    """Does the command read a run directory or an export (made by the slow fixtures)?"""
    return bool(
        re.search(r"RUN_DIR|OUT_DIR|runs/<run>|runs/demo|--resume RUN\b|/tmp/ui1|runs/llada|hf/|my-model", text)
    )


PARSED = [
    c for c in COMMANDS if (r := rule_for(c)) is not None and (r.action == "parse" or c.inline) and r.action != "skip"
]


@pytest.mark.parametrize(
    "cmd",
    [c if not _needs_run(c.text) else pytest.param(c, marks=[pytest.mark.slow, pytest.mark.process]) for c in PARSED],
    ids=lambda c: c.id,
)
def test_command_parses(cmd: Command, request, work: Path, docs_toml: Path):
    if _needs_run(cmd.text):
        request.getfixturevalue("ran_docs")  # the shared run, and models.md's exports and llada run
    old = os.getcwd()
    os.chdir(work)  # relative paths as a user in the scratch directory would type them
    try:
        check_parses(fill(cmd.text, work, docs_toml), inline=cmd.inline)
    finally:
        os.chdir(old)


RUN = [c for c in COMMANDS if not c.inline and (r := rule_for(c)) is not None and r.action == "run" and r is not FIRST]


def chain_of(text: str) -> str:
    """Which run a documented command reads or makes: the llada run and its export are one chain, the examples
    of your own code another, everything else (the shared run, its export) the third; each chain keeps document
    order, the chains run side by side."""
    if re.search(r"\bexamples/", text):
        return "examples"
    return "llada" if re.search(r"\b(runs|hf)/llada\b", text) else "shared"


@pytest.fixture(scope="session")
def ran_docs(shared_run: Path, work: Path, docs_toml: Path) -> dict[str, str]:
    """Every `run` command in document order within its chain (an export before the sample that reads it),
    short forms where the rule gives one, the two chains side by side (each command is mostly seconds of
    imports); then the Python snippet of models.md as a script. {command: problem} for those that failed."""
    from concurrent.futures import ThreadPoolExecutor

    failed: dict[str, str] = {}
    chains: dict[str, list[tuple[Command, str]]] = {}
    for cmd in RUN:
        rule = rule_for(cmd)
        text = fill(rule.short(cmd.text) if rule.short else cmd.text, work, docs_toml)
        if text.startswith("gptop ") and " train " in f" {text} ":
            text = no_ui(text)
        chain = chains.setdefault(chain_of(text), [])
        if all(text != ran for _, ran in chain):  # a command documented twice runs once
            chain.append((cmd, text))

    def run_chain(chain: list[tuple[Command, str]]) -> None:
        for cmd, text in chain:
            r = run_here(text, work)
            if r.returncode != 0:
                failed[f"{cmd.id} -> {text}"] = f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}"

    with ThreadPoolExecutor(len(chains)) as pool:
        list(pool.map(run_chain, chains.values()))
    failed.update(run_python_blocks(work))
    return failed


# Each Python block of the docs in turn, in one Python (its start-up, importing torch and transformers, is most of
# a block's time): each in a namespace of its own as a script's `__main__`, so a block that leaves out an import
# fails as it would alone. Prints {block: traceback} for those that raised.
PYTHON_BLOCKS = """
import json, sys, traceback
failed = {}
for name, body in json.loads(sys.argv[1]).items():
    try:
        exec(compile(body, name, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code not in (0, None):
            failed[name] = f"exit {e.code}"
    except BaseException:
        failed[name] = traceback.format_exc()[-1500:]
print(json.dumps(failed))
"""


def run_python_blocks(work: Path) -> dict[str, str]:
    """The docs' Python blocks, run in `work` (after the commands: models.md's reads their export)."""
    import json

    blocks = {f"{doc}:{line} (python)": body for doc, line, lang, body in OTHER_BLOCKS if lang == "python"}
    r = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS, json.dumps(blocks)],
        cwd=work,
        env=gptop_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        return {"the docs' Python blocks": f"exit {r.returncode}: {r.stderr[-1500:]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_documented_runs_split_into_two_ordered_chains():
    """The side-by-side chains of ran_docs: each keeps what it reads after what makes it."""
    chains: dict[str, list[str]] = {}
    for cmd in RUN:
        verb = next((w for w in cmd.text.split()[1:] if not w.startswith("-")), "")  # train, export, ...
        chains.setdefault(chain_of(cmd.text), []).append(verb)
    assert set(chains) == {"shared", "llada", "examples"}
    llada = chains["llada"]
    assert llada.index("train") < llada.index("export") < llada.index("sample"), llada
    shared = chains["shared"]
    assert shared.index("export") < shared.index("sample"), shared


@pytest.mark.slow
@pytest.mark.process
def test_documented_commands_run(ran_docs: dict[str, str]):
    assert RUN, "the docs show commands that run"
    assert not ran_docs, "\n\n".join(f"{k}\n  {v}" for k, v in ran_docs.items())


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -."""
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


def test_every_relative_link_in_the_docs_resolves():
    """A link from README.md, docs/*.md or BENCHMARKS.md to a file of the repository names one that exists, and
    its #anchor a heading there (the docs moved between files; a dead link is what a reader meets first)."""
    checked = 0
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(ROOT)}: link to {target}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest.read_text()), (
                    f"{doc.relative_to(ROOT)}: link to {target}: no such heading"
                )
            checked += 1
    assert checked > 30, checked
