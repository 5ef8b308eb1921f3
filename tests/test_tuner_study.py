import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from trainer.contract.config import ConfigError, TrainConfig
from fixtures.toggles import Toggles
from trainer.contract.device import DeviceInfo
from tuner.space import SearchSpace, params_key
from tuner.storage import dashboard_command, default_storage_url, shown_storage_url, storage_from_url
from tuner.study import TuneStudy
from tuner.study_key import study_key, study_name

REPO = Path(__file__).resolve().parents[1]
CPU = DeviceInfo(type="cpu", name="cpu", has_compiler=True)
H100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=int(80e9))
SPEC = "-all compile=off,default fused_adamw=on,off prefetch=0,1,2,4 micro_batch=4,8"  # 32 configs


def speed(t: Toggles) -> float:
    return 1000 + 300 * (t.compile == "default") + 50 * t.fused_adamw + 10 * t.prefetch + 100 * (t.micro_batch == 8)


def summary(v):
    return {"tokens_per_s": v, "spread": v * 0.01, "samples": [v * 0.99, v, v * 1.01], "peak_mem": 123, "steps": 20}


def make(tmp_path, storage=None, seed=0, spec=SPEC):
    """A study in `storage` (default: a journal file in tmp_path; sqlite is tested through the default path)."""
    cfg = TrainConfig()
    cfg.toggles.micro_batch = 4
    space = SearchSpace.for_device(cfg.toggles, CPU, cfg.optim.global_batch, spec=spec)
    return TuneStudy.open(cfg, CPU, space, storage=storage or f"journal:{tmp_path}/tuning.log", seed=seed)


def test_storage_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path / "cache"))
    assert default_storage_url() == f"sqlite:///{tmp_path}/cache/tuning.sqlite3"
    assert isinstance(storage_from_url(None), optuna.storages.BaseStorage)
    assert (tmp_path / "cache" / "tuning.sqlite3").exists()
    j = storage_from_url(f"journal:{tmp_path}/j/tuning.log")
    assert isinstance(j, optuna.storages.JournalStorage)
    with pytest.raises(ConfigError) as e:
        storage_from_url("not-a-url")
    assert e.value.option == "--storage"


@pytest.mark.parametrize(
    "url, shown, command",
    [
        (None, "sqlite:///{cache}/tuning.sqlite3", "optuna-dashboard sqlite:///{cache}/tuning.sqlite3"),
        ("sqlite:///rel/s.db", "sqlite:///{cwd}/rel/s.db", "optuna-dashboard sqlite:///{cwd}/rel/s.db"),
        ("journal:j.log", "journal:{cwd}/j.log", "optuna-dashboard {cwd}/j.log"),
        (
            "postgresql://bob:s3cret@db.example:5432/optuna",
            "postgresql://bob:***@db.example:5432/optuna",
            "optuna-dashboard 'postgresql://bob:***@db.example:5432/optuna'",
        ),
        (
            "mysql+pymysql://u@h/db?password=s3cret&charset=utf8",
            "mysql+pymysql://u@h/db?password=***&charset=utf8",
            "optuna-dashboard 'mysql+pymysql://u@h/db?password=***&charset=utf8'",
        ),
        ("postgresql://h/db", "postgresql://h/db", "optuna-dashboard postgresql://h/db"),
    ],
)
def test_the_storage_a_report_records(tmp_path, monkeypatch, url, shown, command):
    """Absolute (a dashboard started elsewhere finds it), the default explicit, no password in it."""
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    fill = {"cache": tmp_path / "cache", "cwd": tmp_path}
    assert shown_storage_url(url) == shown.format(**fill)
    assert dashboard_command(shown_storage_url(url)) == command.format(**fill)
    assert "s3cret" not in shown_storage_url(url)


def test_study_key_is_readable_and_distinguishes_setups():
    cfg = TrainConfig()
    space = SearchSpace.for_device(cfg.toggles, CPU, 32)
    k = study_key(cfg, CPU, space, versions={"torch": "2.9", "transformers": "4.57"})
    assert k["device"] == "cpu" and k["seq_len"] == 256 and k["versions"]["torch"] == "2.9"
    other = dict(k, device="NVIDIA H100 80GB HBM3")
    assert study_name(k) != study_name(other) and study_name(k).startswith("gptop-llama-")
    assert study_name(k) == study_name(json.loads(json.dumps(k)))


def test_persistence_and_warm_start_across_two_study_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path))  # the default per-user SQLite file
    sqlite = storage_from_url(None)
    s1 = make(tmp_path, storage=sqlite)
    import sqlite3

    assert sqlite3.connect(tmp_path / "tuning.sqlite3").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    base = Toggles(micro_batch=4)
    recipe = Toggles(compile="default", fused_adamw=True, micro_batch=8)
    assert s1.warm_start([(base, "current"), (recipe, "recipe")]) == [base, recipe]
    assert s1.warm_start([(base, "current")]) == []  # already queued
    sources = []
    for _ in range(6):
        p = s1.ask()
        sources.append(p.source)
        s1.tell_ok(p, summary(speed(p.toggles)))
    assert sources[:2] == ["current", "recipe"]
    best1 = s1.best_known()
    assert best1 is not None and best1[1] == pytest.approx(speed(best1[0]))
    assert s1.study.user_attrs["key"]["space"] == s1.space.key()

    s2 = make(tmp_path, storage=storage_from_url(None), seed=1)  # a second run, a fresh connection
    assert s2.name == s1.name
    assert len([t for t in s2.trials() if "duplicate_of" not in t.user_attrs]) == 6
    assert s2.best_known()[0] == best1[0]
    assert s2.warm_start([(base, "current"), (recipe, "recipe")]) == []  # known: not enqueued again
    ran = {params_key(t.params) for t in s2.trials()}
    for _ in range(6):
        p = s2.ask()
        assert params_key(p.params) not in ran  # never runs a known configuration
        ran.add(params_key(p.params))
        s2.tell_ok(p, summary(speed(p.toggles)))
        assert p.trial.user_attrs["run"] == s2.run_id


def test_infeasible_recorded_via_constraints_and_not_reproposed(tmp_path):
    s = make(tmp_path, spec="-all compile=off,default fused_adamw=on,off prefetch=0,2")  # 8 configs
    failed = set()
    measured = []
    while (p := s.ask()) is not None:
        key = params_key(p.params)
        assert key not in failed and key not in measured
        if p.toggles.compile == "default" and p.toggles.prefetch == 0:
            s.tell_infeasible(p, "oom", "CUDA out of memory")
            failed.add(key)
        else:
            s.tell_ok(p, summary(speed(p.toggles)))
            measured.append(key)
    assert len(failed) == 2 and len(measured) == 6  # the space was used up, once each
    bad = [t for t in s.trials() if t.user_attrs.get("status") == "infeasible"]
    assert bad and all(t.state == TrialState.COMPLETE and t.value == 0.0 for t in bad)
    assert all(t.constraints == {"failure": 1.0} and t.user_attrs["constraint"] == [1.0] for t in bad)
    assert s.study.best_trial.user_attrs["status"] == "ok"  # Optuna's own best skips infeasible
    best, value = s.best_known()
    assert best.compile == "default" and best.prefetch == 2 and best.fused_adamw


def test_pruned_and_duplicate_handling(tmp_path):
    s = make(tmp_path, spec="-all compile=off,default")
    p = s.ask()
    s.tell_pruned(p, summary(500.0), "slower than the best")
    t = s.trials()[-1]
    assert t.state == TrialState.PRUNED and t.intermediate_values == {20: 500.0}
    q = s.ask()
    assert params_key(q.params) != params_key(p.params)
    s.tell_ok(q, summary(900.0))
    assert s.ask() is None  # 2 configs, both known
    assert s.record(q.toggles, summary(950.0)) is None  # already measured: not added twice


def test_baseline_record_and_remeasure_pooling(tmp_path):
    s = make(tmp_path)
    n = s.record(Toggles(micro_batch=4), summary(1000.0), source="baseline")
    assert n == 0 and s.trials()[0].user_attrs["source"] == "baseline"
    s.record_remeasure(0, summary(1010.0))
    c = s.candidates()[0]
    assert c.number == 0 and c.remeasured == 1 and c.n == 6
    assert s.record(Toggles(precision="bf16"), summary(1.0)) is None  # outside the space


WORKER = textwrap.dedent("""
    import sys, time, random
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from trainer.contract.config import TrainConfig
    from trainer.contract.device import DeviceInfo
    from tuner.space import SearchSpace
    from tuner.study import TuneStudy
    cfg = TrainConfig()
    cfg.toggles.micro_batch = 4
    dev = DeviceInfo(type="cpu", name="cpu", has_compiler=True)
    space = SearchSpace.for_device(cfg.toggles, dev, cfg.optim.global_batch, spec={spec!r})
    st = TuneStudy.open(cfg, dev, space, storage="journal:" + {journal!r}, seed={seed}, run_id="w{seed}")
    st.warm_start([(cfg.toggles, "current")])
    Path({ready!r}).touch()
    while not Path({go!r}).exists():
        time.sleep(0.01)
    rng = random.Random({seed})
    for _ in range(8):
        p = st.ask()
        if p is None:
            break
        time.sleep(rng.uniform(0.01, 0.05))          # the "trial"
        v = 1000 + 300 * (p.toggles.compile == "default") + 50 * p.toggles.fused_adamw + 10 * p.toggles.prefetch
        if p.toggles.prefetch == 4 and p.toggles.compile == "default":
            st.tell_infeasible(p, "oom", "out of memory")
        else:
            st.tell_ok(p, {{"tokens_per_s": float(v), "spread": 1.0, "samples": [float(v)]}})
""")


@pytest.mark.process
def test_two_processes_share_a_journal_without_repeats(tmp_path):
    journal = str(tmp_path / "shared.log")
    procs = []
    for seed in (1, 2):
        code = WORKER.format(
            repo=str(REPO),
            spec=SPEC,
            journal=journal,
            seed=seed,
            ready=str(tmp_path / f"ready{seed}"),
            go=str(tmp_path / "go"),
        )
        procs.append(subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True))
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{s}").exists() for s in (1, 2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.stderr.read() for p in procs]
        time.sleep(0.02)
    (tmp_path / "go").touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()

    s = make(tmp_path, storage=f"journal:{journal}")  # the journal still loads
    ran = [
        t
        for t in s.trials()
        if t.user_attrs.get("status") in ("ok", "infeasible") and "duplicate_of" not in t.user_attrs
    ]
    keys = [params_key(t.params) for t in ran]
    assert len(keys) == len(set(keys)), "a configuration was run twice"
    assert {t.user_attrs["run"] for t in ran} == {"w1", "w2"}  # both contributed
    assert len(ran) == 16
    assert not [t for t in s.trials() if t.state == TrialState.RUNNING]


def test_toggles_stored_by_an_older_version_read_as_todays_types(tmp_path):
    """micro_batch was the string "8" before it was a number: a study's stored records still compare equal."""
    s = make(tmp_path)
    params = {"compile": "off", "fused_adamw": True, "prefetch": 2, "micro_batch": 8}
    legacy = {**dataclasses.asdict(s.space.to_toggles(params)), "micro_batch": "8"}
    old = optuna.trial.create_trial(
        params=params, distributions=s.space.distributions(), value=1000.0, user_attrs={"toggles": legacy}
    )
    assert s.toggles_of(old).micro_batch == 8 and s.toggles_of(old) == s.space.to_toggles(params)
    broken = optuna.trial.create_trial(
        params=params,
        distributions=s.space.distributions(),
        value=1000.0,
        user_attrs={"toggles": {**legacy, "removed_toggle": 1}},
    )
    assert s.toggles_of(broken) == s.space.to_toggles(params)  # a record that does not load: the params
