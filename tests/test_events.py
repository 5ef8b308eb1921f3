"""The typed event schema: parse validates once, dumps round-trips, unknown fields and types survive,
malformed records are counted and skipped by every reader, and what the previous version wrote still replays."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import threading
from pathlib import Path

import pytest

from fixtures.streams import cpu_run, gpu_run
from gptop.headless import HeadlessView, event_line
from gptop.monitor import MonitorSession
from gptop.report import format_report, summarize
from gptop.state import RunState
from gptop.supervisor import Supervisor
from helpers import wait_for
from trainer.contract import events as ev
from trainer.contract.config import Toggles, section_from_dict
from trainer.contract.device import DeviceInfo
from trainer.contract.states import StoppedBy

HERE = Path(__file__).resolve().parent
V1 = HERE / "fixtures" / "events_v1.jsonl"  # lines written by the previous version (b2eeb9a), unchanged


def full_instances() -> list[ev.Event]:
    """One event of every type with every field set to something other than its default."""
    t = 1_700_000_000.5
    toggles = {"precision": "bf16", "compile": "default", "micro_batch": "8"}
    return [
        ev.HelloEvent(
            time=t,
            rank=0,
            config={"toggles": toggles, "optim": {"max_steps": 10}},
            device=DeviceInfo(
                type="cuda",
                index=0,
                name="H100",
                capability=(9, 0),
                total_memory=80,
                cpu_count=16,
                has_compiler=True,
                cpu_bf16=False,
            ),
            model=ev.ModelInfo(
                family="deepseek",
                size="tiny",
                total_params=3,
                active_params=2,
                embedding_params=1,
                vocab_size=64,
                flops_per_token=18,
                objective="causal",
            ),
            pid=42,
            world_size=2,
            parallel="ddp",
            data={"train_tokens": 5, "fingerprint": "ab"},
            accumulation=2,
            micro_batch=4,
            tokens_per_step=256,
            peak_flops=1e12,
            resumed_from="/r/c.pt",
            start_step=6,
            torch="2.13.0",
            early=True,
            estimate={"total_bytes": 1 << 30, "step_s": 2.5},
        ),
        ev.StepEvent(
            time=t,
            rank=1,
            step=7,
            tokens=700,
            loss=2.5,
            lr=1e-3,
            grad_norm=0.5,
            step_ms=100.0,
            phases_ms={p: 20.0 for p in ev.PHASES},
            tokens_per_s=7000.0,
            mfu=0.3,
            mem_bytes=1 << 30,
            interval_steps=2,
            wall_ms=101.0,
            batch=6,
            gpu_idle_ms=3.0,
            comm_ms=4.0,
            expert_load=[[0.5, 0.5], [0.25, 0.75]],
        ),
        ev.EvalEvent(time=t, step=7, loss=2.6, seconds=0.5),
        ev.CheckpointEvent(time=t, step=7, path="/r/c.pt", seconds=0.2, reason="interval", tokens=700),
        ev.LogEvent(time=t, message="hi", source="tuner", path="/r/p.json", study="s", decision={"apply": True}),
        ev.WarningEvent(time=t, message="w", kind="nan_rollback", step=4, batch=5, skip_batches=[5], lr_scale=0.5),
        ev.ErrorEvent(
            time=t, kind="oom", message="m", step=3, exit_code=3, toggles=toggles, memory={"rss": 1}, lost_peer=True
        ),
        ev.DoneEvent(time=t, step=10, tokens=1000, seconds=9.5, reason="max_steps", checkpoint="/r/c.pt"),
        ev.ExitEvent(
            time=t, pid=42, exit_code=3, signal=9, seconds=9.6, stopped_by=StoppedBy.USER, stderr=["Traceback"]
        ),
        ev.DeviceEvent(
            time=t,
            mode="gpu",
            devices=[
                ev.GpuReading(
                    index=0,
                    name="H100",
                    util_pct=90.0,
                    mem_used=1,
                    mem_total=2,
                    power_w=500.0,
                    power_limit_w=700.0,
                    energy_j=1e5,
                    temp_c=60.0,
                    sm_clock_mhz=1980.0,
                    proc_mem=1,
                )
            ],
            cpu=ev.CpuReading(
                name="Xeon",
                util_pct=10.0,
                per_core=[5.0, 15.0],
                mem_used=1,
                mem_total=2,
                proc_rss=1,
                proc_cpu_pct=3.0,
                power_w=90.0,
                energy_j=10.0,
            ),
        ),
        ev.TrialEvent(
            time=t,
            number=3,
            toggles=toggles,
            status="infeasible",
            tokens_per_s=1.0,
            spread=0.1,
            peak_mem=5,
            energy_per_token=0.01,
            reason="nan",
            kind="trial",
            source="sampler",
            duration_s=3.0,
            remeasure_tokens_per_s=1.1,
            remeasure_spread=0.2,
            rollback={"step": 2, "path": None, "deleted": []},
        ),
        ev.ApplyEvent(
            time=t,
            toggles=toggles,
            decision={"apply": True},
            number=3,
            tokens_per_s=2.0,
            baseline_tokens_per_s=1.0,
            step=9,
        ),
        ev.TunerEvent(
            time=t,
            phase="done",
            budget_left_s=10.0,
            trial=3,
            trials_run=4,
            trials_planned=8,
            study="s",
            outcome="applied trial 3",
            applied=True,
        ),
        ev.StatusEvent(time=t, status="failed", message="why"),
        ev.ProgressEvent(time=t, step=8, tokens=800, step_ms=99.0),
        ev.PhaseEvent(time=t, phase="tokenizing", message="tokenizing builtin", pct=40.0),
        ev.AlertEvent(
            time=t,
            id="stall-1",
            kind=ev.AlertKind.STALL,
            severity=ev.Severity.CRITICAL,
            message="no step for 31 s",
            resolved=True,
            step=7,
            figures={"seconds": 31.0},
            ranks=[1],
            node="n1",
            device="gpu0",
        ),
        ev.ProfileEvent(
            time=t,
            first=3,
            last=5,
            path="/r/profiles/steps-3-5.json",
            summary_path="/r/profiles/steps-3-5.summary.json",
            step_ms=12.5,
            phases=[
                ev.PhaseProfile(
                    phase="forward",
                    ms=20.0,
                    op_share=0.8,
                    gpu_ms=18.0,
                    ops=[ev.OpTime(name="aten::mm", ms=10.0, share=0.5, calls=6)],
                    kernels=[ev.OpTime(name="gemm", ms=9.0, share=0.5, calls=6)],
                )
            ],
            short_op_share=0.1,
            short_kernel_share=0.2,
            gpu_idle_share=0.3,
            gpu_idle_host_share=0.2,
            comm_overlap=0.7,
        ),
    ]


# --------------------------------------------------------------------------- round trip


def test_full_instances_cover_every_type():
    assert {type(e) for e in full_instances()} == set(ev.EVENT_TYPES.values())


@pytest.mark.parametrize(
    "event", full_instances() + gpu_run(60, ranks=2, tuning_done=True) + cpu_run(30), ids=lambda e: e.type
)
def test_dumps_round_trips_through_parse(event):
    line = ev.dumps(event)
    back = ev.parse(line)
    assert back == event and type(back) is type(event)
    assert ev.dumps(back) == line


def _kept(old, new) -> bool:
    """`new` holds `old`: equal, or a mapping with every old key kept and only null keys added."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(_kept(v, new.get(k)) for k, v in old.items()) and all(new[k] is None for k in set(new) - set(old))
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_kept(a, b) for a, b in zip(old, new))
    return old == new


def test_a_previous_versions_lines_parse_into_their_classes_with_nothing_unknown():
    lines = V1.read_text().splitlines()
    assert len(lines) > 30
    seen = set()
    for line in lines:
        e = ev.parse(line)
        old = json.loads(line)
        assert type(e) is ev.EVENT_TYPES[old["type"]] and e.extra == {}, line  # every field they wrote is declared
        new = json.loads(ev.dumps(e))
        if e.type in ("trial", "apply"):
            # toggles are decoded as a stored config is: an older version's values as today's (micro_batch
            # "8" -> 8), the toggles added since at their defaults
            assert new["toggles"] == dataclasses.asdict(section_from_dict(Toggles, old.pop("toggles"))), line
            new.pop("toggles")
        # the wire keeps every name and value it had (an optional null may now be left out: the same to a
        # reader); what it adds are defaults written out (world_size, start_step, lost_peer), and inside a
        # device reading the fields added since, null (a reading writes every field)
        assert all(_kept(x, new.get(k)) for k, x in old.items()), line
        assert all(new[k] is not None and new[k] == getattr(e, k) for k in set(new) - set(old) - {"toggles"}), line
        seen.add(e.type)
    assert seen == set(ev.EVENT_TYPES) - {"progress", "phase", "profile", "alert", "exit"}  # the types added since


def test_a_previous_versions_run_replays_in_the_views_and_the_report(tmp_path):
    events = list(ev.read_events(V1, strict=True))
    state = RunState(status="replay")
    out = io.StringIO()
    view = HeadlessView(state, json=False, stream=out, err=io.StringIO())
    for e in events:
        state.apply(e)
        view.on_event(e)
        event_line(e, state)
    view.close()
    assert state.malformed == 0 and state.step == 4 and state.model.family == "deepseek"
    assert state.done.reason == "max_steps" and state.tuner.phase == "done" and state.tuner.applied
    assert state.device_keys() == ["gpu0", "cpu"] and state.errors[-1].lost_peer
    assert "step 4/4 loss" in out.getvalue() and "error [oom]" in out.getvalue()
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(
        "".join(
            line + "\n"
            for line in V1.read_text().splitlines()  # rank 0's file
            if '"rank":1' not in line
        )
    )
    (run / "device.jsonl").write_text(
        "".join(line + "\n" for line in V1.read_text().splitlines() if '"type":"device"' in line)
    )
    s = summarize(run)
    assert s["steps"] == 4 and s["model"]["family"] == "deepseek" and "malformed" not in s
    assert {e["kind"] for e in s["errors"]} == {"nan", "oom"} and s["done"] == "max_steps"
    format_report(s)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "line, why",
    [
        ("not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"type":"log","time":1,"rank":0,"message":"m"}', "missing 'v'"),
        ('{"v":1,"time":1,"rank":0,"message":"m"}', "missing 'type'"),
        ('{"v":1,"type":"log","rank":0,"message":"m"}', "missing 'time'"),
        ('{"v":1,"type":"log","time":1,"message":"m"}', "missing 'rank'"),
        ('{"v":2,"type":"log","time":1,"rank":0,"message":"m"}', "schema version"),
        ('{"v":true,"type":"log","time":1,"rank":0,"message":"m"}', "schema version"),
        ('{"v":1,"type":7,"time":1,"rank":0}', "'type'"),
        ('{"v":1,"type":"log","time":"now","rank":0,"message":"m"}', "log.time"),
        ('{"v":1,"type":"log","time":NaN,"rank":0,"message":"m"}', "not a finite number"),
        ('{"v":1,"type":"log","time":1,"rank":0.5,"message":"m"}', "log.rank"),
        ('{"v":1,"type":"log","time":1,"rank":0}', "log event missing message"),
        ('{"v":1,"type":"log","time":1,"rank":0,"message":5}', "log.message"),
        ('{"v":1,"type":"step","time":1,"rank":0,"step":1}', "step event missing tokens"),
        ('{"v":1,"type":"device","time":1,"rank":0,"devices":5}', "device.devices"),
        ('{"v":1,"type":"device","time":1,"rank":0,"devices":[{"name":"g"}]}', "GpuReading missing index"),
        (
            '{"v":1,"type":"hello","time":1,"rank":0,"config":{"toggles":3},"device":{"type":"cpu"},"model":{}}',
            "hello.config",
        ),
        (
            '{"v":1,"type":"hello","time":1,"rank":0,"config":{},"device":{"type":"cpu","capability":[9]},"model":{}}',
            "capability",
        ),
        (
            '{"v":1,"type":"hello","time":1,"rank":0,"config":{},"device":{"type":"cpu"},"model":{"total_params":1.5}}',
            "total_params",
        ),
        ('{"v":1,"type":"trial","time":1,"rank":0,"number":1,"toggles":[],"status":"ok"}', "trial.toggles"),
        ('{"v":1,"type":"error","time":1,"rank":0,"kind":"oom","message":"m","lost_peer":"yes"}', "error.lost_peer"),
    ],
)
def test_malformed_records_raise_malformed_event(line, why):
    with pytest.raises(ev.MalformedEvent, match=why):
        ev.parse(line)


STEP = dict(
    v=1,
    type="step",
    time=1.0,
    rank=0,
    step=1,
    tokens=4,
    loss=2.0,
    lr=1e-3,
    grad_norm=1.0,
    step_ms=10.0,
    phases_ms={"data": 1.0},
    tokens_per_s=400.0,
    mfu=None,
    mem_bytes=1,
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("phases_ms", "x"),
        ("phases_ms", {"data": "x"}),
        ("phases_ms", [1.0]),
        ("step", 1.5),
        ("step", True),
        ("tokens", "4"),
        ("loss", "2.0"),
        ("loss", True),
        ("mem_bytes", 1.0),
        ("expert_load", [1.0, 2.0]),
        ("expert_load", [["a"]]),
        ("interval_steps", 2.0),
    ],
)
def test_every_field_is_type_checked(field, value):
    with pytest.raises(ev.MalformedEvent, match=f"step.{field}"):
        ev.from_dict(dict(STEP, **{field: value}))


def test_non_finite_numbers_are_null_where_a_field_allows_it():
    e = ev.parse(json.dumps(dict(STEP, loss=None)).replace("null", "NaN"))
    assert e.loss is None
    made = ev.make(
        "step", **{k: v for k, v in STEP.items() if k not in ("v", "type", "time", "grad_norm")}, grad_norm=float("inf")
    )
    assert made.grad_norm is None and ev.parse(ev.dumps(made)) == made
    assert ev.from_dict(dict(STEP, phases_ms={"data": float("nan")})).phases_ms == {"data": None}
    with pytest.raises(ev.MalformedEvent, match="not a finite number"):
        ev.from_dict(dict(STEP, expert_load=[[float("inf")]]))  # inside a list a number must be a number


def test_unknown_fields_are_kept_and_written_back():
    line = json.dumps(dict(STEP, energy_j=12.5, progress={"phase": "compile"}))
    e = ev.parse(line)
    assert isinstance(e, ev.StepEvent) and e.extra == {"energy_j": 12.5, "progress": {"phase": "compile"}}
    assert json.loads(ev.dumps(e))["energy_j"] == 12.5 and ev.parse(ev.dumps(e)) == e
    nested = ev.parse('{"v":1,"type":"device","time":1,"rank":0,"devices":[{"index":0,"sm_activity":0.5}]}')
    assert nested.devices[0].extra == {"sm_activity": 0.5}
    assert json.loads(ev.dumps(nested))["devices"][0]["sm_activity"] == 0.5


def test_an_unknown_type_is_a_generic_event_that_consumers_ignore():
    e = ev.parse('{"v":1,"type":"forecast","time":5.0,"rank":0,"phase":"compile","done":0.5}')
    assert isinstance(e, ev.UnknownEvent) and e.type == "forecast" and e.extra == {"phase": "compile", "done": 0.5}
    assert ev.parse(ev.dumps(e)) == e
    state = RunState()
    state.apply(e)
    assert state.malformed == 0 and state.last_time == 5.0 and state.step is None
    assert event_line(e, state) is None


def test_make_builds_by_name_and_refuses_what_is_not_declared():
    e = ev.make("checkpoint", rank=2, step=3, path="p", seconds=0.1)
    assert isinstance(e, ev.CheckpointEvent) and e.rank == 2 and e.reason is None
    with pytest.raises(ev.MalformedEvent, match="has no field 'energy_j'"):
        ev.make("checkpoint", step=3, path="p", seconds=0.1, energy_j=1.0)
    with pytest.raises(ev.MalformedEvent, match="missing path"):
        ev.make("checkpoint", step=3, seconds=0.1)
    with pytest.raises(ev.MalformedEvent, match="unknown event type"):
        ev.make("forecast", phase="x")
    with pytest.raises(ev.MalformedEvent, match="checkpoint.step"):
        ev.make("checkpoint", step="3", path="p", seconds=0.1)


def test_events_are_immutable_values():
    e = full_instances()[1]
    with pytest.raises(AttributeError):
        e.step = 8  # type: ignore[misc]
    assert e == ev.parse(ev.dumps(e)) and e != ev.from_dict(dict(json.loads(ev.dumps(e)), step=8))


# --------------------------------------------------------------------------- every reader counts and skips


BAD_LINES = [
    b"{not json",
    b'{"v":1,"type":"device","time":1,"rank":0,"devices":5}',
    b'{"v":1,"type":"step","time":1,"rank":0,"step":"ten"}',
    b"[]",
]


def mixed_file(path: Path) -> list[ev.Event]:
    good = cpu_run(30)
    lines = [ev.dumps(e).encode() for e in good]
    for i, bad in enumerate(BAD_LINES):
        lines.insert(3 * i + 1, bad)
    path.write_bytes(b"\n".join(lines) + b"\n\n")
    return good


def test_read_events_skips_and_counts_malformed_lines(tmp_path):
    good = mixed_file(tmp_path / "events.jsonl")
    seen = []
    assert list(ev.read_events(tmp_path / "events.jsonl", on_malformed=lambda line, e: seen.append(line))) == good
    assert seen == BAD_LINES
    with pytest.raises(ev.MalformedEvent):
        list(ev.read_events(tmp_path / "events.jsonl", strict=True))


def test_report_counts_malformed_lines_in_events_and_device_files(tmp_path):
    good = mixed_file(tmp_path / "events.jsonl")
    devices = [ev.dumps(e).encode() for e in good if isinstance(e, ev.DeviceEvent)]
    (tmp_path / "device.jsonl").write_bytes(b"\n".join(devices[:3] + BAD_LINES[1:2] + devices[3:]) + b"\n")
    s = summarize(tmp_path)
    assert s["malformed"]["events.jsonl"]["lines"] == len(BAD_LINES)
    assert s["malformed"]["device.jsonl"] == {"lines": 1, "first": "device.devices: expected a list, got int '5'"}
    assert s["steps"] == 30
    text = format_report(s)
    assert "skipped   4 malformed line(s) in events.jsonl" in text and "in device.jsonl" in text


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{oops", "not readable JSON"),
        (b"\xff\xfe\x00", "not readable JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"best": 5}', "'best' is int"),
        (b'{"speedup": "fast"}', "'speedup' is str"),
        (b'{"trials": {"a": 1}}', "'trials' is dict"),
        (b'{"trials": [5]}', "trials[0] is int"),
        (b'{"trials": [{"run": "this", "status": 3}]}', "trials[0].status"),
        (b'{"ledger": {"tuning_s": "10s"}}', "'ledger.tuning_s'"),
        (b'{"best_number": true}', "'best_number' is bool"),
    ],
)
def test_a_damaged_tuning_json_is_reported_and_skipped(tmp_path, content, why):
    for e in cpu_run(20):
        with open(tmp_path / "events.jsonl", "a") as f:
            f.write(ev.dumps(e) + "\n")
    (tmp_path / "tuning.json").write_bytes(content)
    s = summarize(tmp_path)
    assert "tuning" not in s and why in s["tuning_skipped"]
    assert "tuning    skipped: tuning.json: " in format_report(s)


def test_a_tuning_json_with_nulls_is_summarized(tmp_path):
    for e in cpu_run(20):
        with open(tmp_path / "events.jsonl", "a") as f:
            f.write(ev.dumps(e) + "\n")
    (tmp_path / "tuning.json").write_text(json.dumps({"best": None, "ledger": {"tuning_s": None}, "trials": []}))
    s = summarize(tmp_path)
    assert "tuning_skipped" not in s and "no feasible configuration" in format_report(s)


@pytest.mark.parametrize("trials", [[], [{"run": "earlier", "status": "complete"}]])
def test_a_report_never_prints_empty_parentheses(tmp_path, trials):
    """No trial this run (none at all, or only a shared study's earlier ones): '0 trials this run in ...', not '()'."""
    for e in cpu_run(20):
        with open(tmp_path / "events.jsonl", "a") as f:
            f.write(ev.dumps(e) + "\n")
    (tmp_path / "tuning.json").write_text(
        json.dumps({"best": None, "trials": trials, "ledger": {"tuning_s": 12.0, "budget_s": 60.0}})
    )
    text = format_report(summarize(tmp_path))
    assert "0 trials this run in " in text
    assert "()" not in text and "( " not in text
    (tmp_path / "tuning.json").write_text(json.dumps({"best": None, "trials": [{"run": "this", "status": "pruned"}]}))
    assert "1 trials this run (1 pruned) in " in format_report(summarize(tmp_path))


class NoSampler:
    def subscribe(self, fn):
        return lambda: None

    def start(self):
        pass

    def stop(self):
        pass


def test_monitor_replay_counts_malformed_lines(tmp_path):
    good = mixed_file(tmp_path / "events.jsonl")
    m = MonitorSession(tmp_path, sampler=NoSampler())
    m.start()
    try:
        wait_for(lambda: m.state.step == 30, 10, "the replay's last step", poll=0.02)
    finally:
        m.close()
    assert m.state.status == "replay" and m.state.step == 30
    assert m.state.malformed == len(BAD_LINES)
    assert len([e for e in good if isinstance(e, ev.StepEvent)]) == 3


@pytest.mark.process
def test_supervisor_counts_malformed_lines_from_the_socket(tmp_path):
    """The live path: a process writes good and bad lines to the channel socket; the bad ones are reported
    (the session counts them) and the reader goes on."""
    good = [ev.dumps(e) for e in cpu_run(10)[:5]]
    lines = [good[0], BAD_LINES[0].decode(), good[1], BAD_LINES[1].decode(), *good[2:]]
    (tmp_path / "lines").write_text("\n".join(lines) + "\n")
    script = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "s.sendall(open(sys.argv[2], 'rb').read()); s.close()"
    )
    events, bad, done = [], [], threading.Event()
    sup = Supervisor(
        [],
        tmp_path,
        on_event=events.append,
        on_log=lambda line, stream: None,
        on_exit=lambda code: done.set(),
        on_malformed=lambda line, why: bad.append(why),
    )
    sup.argv = [sys.executable, "-c", script, sup.socket_path, str(tmp_path / "lines")]
    sup.start()
    assert done.wait(30)
    sup.close()
    assert [ev.dumps(e) for e in events] == good
    assert len(bad) == 2 and "not JSON" in bad[0] and "device.devices" in bad[1]


def test_the_hellos_estimate_and_the_tuners_best_cross_as_typed_records():
    """The early hello's estimate and a tuner event's best toggles are decoded once where a line is read, so
    views read fields instead of re-checking a dict; the wire keeps its keys (an older line still reads)."""
    from trainer.contract.config import Toggles

    hello = ev.parse(
        json.dumps(
            {
                "v": 1,
                "type": "hello",
                "time": 1.0,
                "rank": 0,
                "pid": 7,
                "config": {},
                "device": {"type": "cpu", "name": "cpu"},
                "model": {},
                "early": True,
                "estimate": {"total_bytes": 1 << 30, "step_s": 2, "capacity_bytes": None, "newer_key": 1},
            }
        )
    )
    est = hello.estimate
    assert isinstance(est, ev.EstimateInfo) and est.total_bytes == 1 << 30 and est.step_s == 2
    assert est.capacity_bytes is None and est.extra == {"newer_key": 1}
    assert json.loads(ev.dumps(hello))["estimate"]["newer_key"] == 1  # kept for a newer reader
    tuner = ev.parse(
        json.dumps(
            {
                "v": 1,
                "type": "tuner",
                "time": 1.0,
                "rank": 0,
                "phase": "trials",
                "best": {"number": 3, "toggles": {"micro_batch": "8", "precision": "bf16"}},
            }
        )
    )
    assert isinstance(tuner.best.toggles, Toggles)
    assert tuner.best.toggles.micro_batch == 8 and tuner.best.toggles.precision == "bf16"
    assert json.loads(ev.dumps(tuner))["best"]["toggles"]["micro_batch"] == 8


@pytest.mark.parametrize(
    "config, want",
    [
        ({"optim": {"max_steps": 10}, "log": {"log_every": 5}, "checkpoint": {"checkpoint_every": 0}}, (10, 5, 0)),
        ({}, (None, None, None)),  # gptop's record of a command's start, or a client that said nothing
        ({"log": {"log_every": 2}}, (None, 2, None)),  # a client's program: what it reported
        (
            {"optim": {"max_steps": True}, "log": {"log_every": "5"}, "checkpoint": {"checkpoint_every": 2.5}},
            (None,) * 3,
        ),
    ],
)
def test_the_hellos_reported_numbers_are_read_and_checked_in_one_place(config, want):
    hello = dataclasses.replace(full_instances()[0], config=config)
    assert (hello.max_steps, hello.log_every, hello.checkpoint_every) == want


def test_the_hellos_toggles_are_decoded_once_over_what_the_process_ran_at():
    from trainer.contract.client import PLAIN_PYTORCH

    own = dataclasses.replace(full_instances()[0], config={"toggles": {"precision": "fp32", "micro_batch": "8"}})
    assert own.toggles is own.toggles  # decoded once, then read
    # gptop's own trainer: what an older one did not name ran at Toggles()'s default; "8" as an older one wrote it
    assert own.toggles == dataclasses.replace(Toggles(), precision="fp32", micro_batch=8)
    assert "toggles" not in ev.to_dict(own) and json.loads(ev.dumps(own))["config"] == own.config  # not on the wire
    # a client's program: PyTorch's own defaults under what it said
    client = dataclasses.replace(own, client="probe", config={"toggles": {"precision": "bf16"}})
    assert client.toggles == dataclasses.replace(PLAIN_PYTORCH, precision="bf16")
    assert client.reported_toggles == {"precision": "bf16"}  # the record, as said
    # a newer trainer's toggle, or a value this version cannot take, is read past, not refused
    newer = dataclasses.replace(own, config={"toggles": {"precision": "fp9", "compile": "default", "warp": 1}})
    assert newer.toggles == dataclasses.replace(Toggles(), compile="default")
    # gptop's record of a command's start says no toggles
    assert dataclasses.replace(own, config={}).toggles is None
