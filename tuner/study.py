"""The persisted Optuna study: storage, naming, warm start, asking without repeats, telling outcomes.

Storage: tuner.storage (the default per-user SQLite file, `--storage` URLs, how a report shows them).
Naming: tuner.study_key (what decides which toggles are fast; the key is stored readable in the study's
user_attrs["key"]).

Sampler. TPE (`TPESampler(multivariate=True, n_startup_trials=4,
constant_liar=True)`): it handles categorical spaces, learns from pruned and
infeasible trials, and with constant_liar steers concurrent workers away
from each other's running trials. GPSampler would need scipy and is built for
continuous spaces; the toggles are all categorical. The first trials are
enqueued (`enqueue_trial`): the current configuration and a known-good recipe
for the device, unless the persisted study already has them, so a second run
starts from what was learned (`best_known()`).

Infeasible trials (OOM, NaN, divergence, compile error, crash) are told
COMPLETE with value 0 tokens/s and a violated constraint, the documented way
in Optuna 5 (`Trial.set_constraint`; older Optuna: `constraints_func` reading
user_attrs["constraint"]): TPE then ranks them below every feasible trial and
stops proposing their region, and `study.best_trial` skips them. FAIL would
hide them from the sampler, which would re-propose them. Pruned trials are
told PRUNED after reporting their estimate as an intermediate value, so TPE
ranks them. Every trial carries user_attrs: toggles, tokens_per_s, spread,
peak_mem, energy_per_token, status, reason, source, run, samples, overhead_s.

No repeats. TPE re-proposes configurations in small categorical spaces. A
proposal whose parameters match a finished trial is not run: it is told with
that trial's result (user_attrs["duplicate_of"]), which is what Optuna's
maintainers recommend, and the sampler is asked again; after
`max_asks` repeats an untried configuration is enqueued instead. Across
processes sharing a storage, a trial *claims* its configuration before
running (user_attrs["claimed"]) and re-reads the study: if another live trial
has claimed the same parameters, it withdraws (told FAIL, ignored by the
sampler). Any two claimants write before they read, so at least one sees the
other: two processes never run the same configuration at once. The price is
that both may withdraw in a tie, and the configuration is proposed again
later. A claim older than `stale_after_s` without a heartbeat (`touch`) is
from a dead process and is ignored.

Skipped proposals. `ask(accept=...)` lets the caller turn down a proposal
that this run cannot afford (a compile trial in a run too short to pay for
it): it is told FAIL with status "skipped", which the sampler ignores and
which is not a result, so a later, longer run of the same setup still tries
it. After `max_asks` refusals an untried configuration that `accept` takes
is enqueued instead.

Which run measured what. Every trial records its run (`user_attrs["run"]`),
every re-measurement too, and each run's baseline is kept as
`baseline:<run>` (`baseline_of`). `candidates(run=R)` estimates each
configuration from run R's measurements only: a speed-up is a ratio of two
measurements made on the same machine at the same time, never of one from
an earlier run over a baseline of this one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from trainer.contract.config import ConfigError, TrainConfig, Toggles, section_from_dict
from trainer.contract.device import DeviceInfo

from .measure import median_ci
from .storage import shown_storage_url, storage_from_url
from .space import SearchSpace
from .study_key import study_key, study_name

_HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")
FEASIBLE, INFEASIBLE = -1.0, 1.0

optuna.logging.set_verbosity(optuna.logging.WARNING)  # one INFO line per trial would scribble over the TUI


# --- the study ------------------------------------------------------------------------------


@dataclass
class Proposal:
    """A trial to run: the live Optuna trial and the toggles it stands for."""

    trial: optuna.Trial
    toggles: Toggles
    params: dict[str, Any]
    source: str = "sampler"
    advice: str | None = None  # source "advice": the evidence of the advice it tries

    @property
    def number(self) -> int:
        return self.trial.number


@dataclass
class Candidate:
    """A measured feasible configuration, pooled over its trial and any re-measurements (of one run, with
    `candidates(run=...)`). `run` is the run of its trial."""

    number: int
    toggles: Toggles
    tokens_per_s: float
    spread: float
    lo: float
    hi: float
    n: int
    remeasured: int = 0
    overhead_s: float | None = None
    run: str | None = None

    @property
    def rel_spread(self) -> float:
        """The interval's half-width as a share of the estimate (inf without an estimate)."""
        return self.spread / self.tokens_per_s if self.tokens_per_s > 0 and math.isfinite(self.spread) else math.inf


def _intended(t: FrozenTrial) -> dict[str, Any]:
    return t.system_attrs.get("fixed_params") or t.params


class TuneStudy:
    """One persisted Optuna study for a setup, with the tuner's conventions on top."""

    def __init__(
        self,
        space: SearchSpace,
        key: dict[str, Any],
        storage: str | optuna.storages.BaseStorage | None = None,
        *,
        seed: int | None = None,
        n_startup_trials: int = 4,
        stale_after_s: float = 1800.0,
        max_asks: int = 12,
        run_id: str | None = None,
        wall: Any = time.time,
    ):
        self.space = space
        self.key = key
        self.name = study_name(key)
        self.storage = storage if isinstance(storage, optuna.storages.BaseStorage) else storage_from_url(storage)
        # What a report records (optuna-dashboard's argument); None for a storage object passed in.
        self.storage_url = None if isinstance(storage, optuna.storages.BaseStorage) else shown_storage_url(storage)
        self.stale_after_s = stale_after_s
        self.max_asks = max_asks
        self.wall = wall
        self.run_id = run_id or (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self._rng = random.Random(seed)
        self.options = dict(
            seed=seed, n_startup_trials=n_startup_trials, stale_after_s=stale_after_s, max_asks=max_asks, wall=wall
        )
        kwargs: dict[str, Any] = {}
        if not _HAS_SET_CONSTRAINT:  # Optuna < 5: the constraints_func route
            kwargs["constraints_func"] = lambda ft: ft.user_attrs.get("constraint", [FEASIBLE])
        self.sampler = optuna.samplers.TPESampler(
            n_startup_trials=n_startup_trials, multivariate=True, constant_liar=True, seed=seed, **kwargs
        )
        self.study = optuna.create_study(
            study_name=self.name, storage=self.storage, sampler=self.sampler, direction="maximize", load_if_exists=True
        )
        if "key" not in self.study.user_attrs:
            self.study.set_user_attr("key", key)

    @classmethod
    def open(
        cls,
        cfg: TrainConfig,
        dev: DeviceInfo,
        space: SearchSpace,
        storage: str | None = None,
        world_size: int = 1,
        **kwargs: Any,
    ) -> "TuneStudy":
        """The study for this run's setup, created or loaded from `storage` (see module doc)."""
        return cls(space, study_key(cfg, dev, space, world_size), storage, **kwargs)

    def for_space(self, space: SearchSpace) -> "TuneStudy":
        """The study of the same setup over another space (a space widened when memory turned out to be the
        constraint): another study, since the space is part of the key, in the same storage, for the same run."""
        other = TuneStudy(space, {**self.key, "space": space.key()}, self.storage, run_id=self.run_id, **self.options)
        other.storage_url = self.storage_url
        return other

    # --- reading ----------------------------------------------------------------------
    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def get_attr(self, name: str, default: Any = None) -> Any:
        return self.study.user_attrs.get(name, default)

    def set_attr(self, name: str, value: Any) -> None:
        self.study.set_user_attr(name, value)

    def _live(self, t: FrozenTrial) -> bool:
        """A RUNNING trial that claimed its configuration and whose process still shows signs of life."""
        if t.state != TrialState.RUNNING or "claimed" not in t.user_attrs:
            return False
        last = max(float(t.user_attrs.get("claimed", 0)), float(t.user_attrs.get("heartbeat", 0)))
        return self.wall() - last < self.stale_after_s

    def _known(self, key: tuple, exclude: int | None = None) -> FrozenTrial | None:
        """A finished (COMPLETE/PRUNED) or live claimed trial with parameters `key`: the config needs no run."""
        finished = None
        for t in self.trials():
            if t.number == exclude or self.space.config_key(_intended(t)) != key:
                continue
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                if "duplicate_of" not in t.user_attrs:
                    return t
                finished = finished or t
            elif self._live(t):
                return t
        return finished

    def tried_keys(self, waiting: bool = True) -> set[tuple]:
        """Configurations measured, claimed by a live trial, or (with `waiting`) queued."""
        states = (TrialState.COMPLETE, TrialState.PRUNED) + ((TrialState.WAITING,) if waiting else ())
        return {self.space.config_key(_intended(t)) for t in self.trials() if t.state in states or self._live(t)}

    # --- warm start -------------------------------------------------------------------
    def warm_start(
        self, configs: list[tuple[Toggles, str]] | list[tuple[Toggles, str, dict[str, Any]]]
    ) -> list[Toggles]:
        """Enqueue (toggles, source[, user attrs]) entries, in order, that the study has neither measured nor
        queued; returns those enqueued. The attrs go with the trial (the advice's evidence: `Proposal.advice`)."""
        queued = {self.space.config_key(_intended(t)) for t in self.trials((TrialState.WAITING,))}
        out = []
        for toggles, source, *rest in configs:
            attrs = dict(rest[0]) if rest else {}
            if not self.space.contains(toggles):
                continue
            params = self.space.to_params(toggles)
            key = self.space.config_key(params)
            if key in queued or self._known(key) is not None:
                continue
            self.study.enqueue_trial(params, user_attrs={**attrs, "source": source})
            queued.add(key)
            out.append(toggles)
        return out

    # --- asking -----------------------------------------------------------------------
    def ask(self, accept: Callable[[Toggles], str | None] | None = None) -> Proposal | None:
        """The next configuration to run, never one already measured or running; None when the space is used up
        (or nothing untried is left that `accept` takes). `accept(toggles)` returns None to take a proposal or
        why not: a refused one is told FAIL as "skipped" (see the module doc)."""
        if len(self.tried_keys(waiting=False)) >= self.space.size():
            return None
        for round_ in range(2):
            for _ in range(self.max_asks):
                trial = self.study.ask()
                toggles = self.space.suggest(trial)
                params = dict(trial.params)
                source = trial.user_attrs.get("source", "sampler")
                if self._settle_duplicate(trial, params):
                    continue
                why = accept(toggles) if accept is not None else None
                if why:
                    self._skip(trial, toggles, source, why)
                    continue
                trial.set_user_attr("claimed", self.wall())
                trial.set_user_attr("run", self.run_id)
                trial.set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
                if self._settle_duplicate(trial, params):  # someone claimed it between our write and read
                    continue
                trial.set_user_attr("toggles", dataclasses.asdict(toggles))
                trial.set_user_attr("source", source)
                return Proposal(trial, toggles, params, source, trial.user_attrs.get("advice"))
            if round_ == 0:
                untried = self._untried(accept)
                if untried is None:
                    return None
                self.study.enqueue_trial(untried, user_attrs={"source": "fallback"})
        return None

    def _skip(self, trial: optuna.Trial, toggles: Toggles, source: str, why: str) -> None:
        trial.set_user_attr("toggles", dataclasses.asdict(toggles))
        trial.set_user_attr("source", source)
        trial.set_user_attr("run", self.run_id)
        trial.set_user_attr("status", "skipped")
        trial.set_user_attr("reason", why)
        self.study.tell(trial, state=TrialState.FAIL)

    def skipped(self, run: str | None = None) -> int:
        """How many proposals `ask(accept=...)` turned down (in `run`, or in every run)."""
        return sum(
            1
            for t in self.trials((TrialState.FAIL,))
            if t.user_attrs.get("status") == "skipped" and (run is None or t.user_attrs.get("run") == run)
        )

    def _untried(self, accept: Callable[[Toggles], str | None] | None = None) -> dict[str, Any] | None:
        tried = self.tried_keys()

        def ok(p: dict[str, Any]) -> bool:
            return self.space.config_key(p) not in tried and (accept is None or not accept(self.space.to_toggles(p)))

        if self.space.size() <= 20000:
            todo = [p for p in self.space.all_params() if ok(p)]
            return self._rng.choice(todo) if todo else None
        for _ in range(2000):
            p = self.space.random_params(self._rng)
            if ok(p):
                return p
        return None

    def _settle_duplicate(self, trial: optuna.Trial, params: dict[str, Any]) -> bool:
        """Finish `trial` without running it if its configuration is known; True when it was."""
        other = self._known(self.space.config_key(params), exclude=trial.number)
        if other is None:
            return False
        if other.state == TrialState.RUNNING:
            trial.set_user_attr("duplicate_of", other.number)
            trial.set_user_attr("status", "withdrawn")
            trial.set_user_attr("reason", f"trial {other.number} is running the same configuration")
            self.study.tell(trial, state=TrialState.FAIL)
            return True
        for k in ("toggles", "tokens_per_s", "spread", "peak_mem", "energy_per_token", "reason", "kind"):
            if k in other.user_attrs:
                trial.set_user_attr(k, other.user_attrs[k])
        trial.set_user_attr("status", "duplicate")
        trial.set_user_attr("duplicate_of", other.number)
        trial.set_user_attr("run", self.run_id)
        feasible = (
            all(v <= 0 for v in other.constraints.values())
            if hasattr(other, "constraints")
            else all(v <= 0 for v in other.user_attrs.get("constraint", [FEASIBLE]))
        )
        self._set_feasible(trial, feasible)
        if other.state == TrialState.PRUNED:
            if other.intermediate_values:
                step, value = max(other.intermediate_values.items())
                trial.report(value, step)
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            self.study.tell(trial, other.value)
        return True

    def touch(self, proposal: Proposal) -> None:
        """Heartbeat: keeps a long trial's claim from looking stale to other processes."""
        proposal.trial.set_user_attr("heartbeat", self.wall())

    # --- telling ----------------------------------------------------------------------
    @staticmethod
    def _set_feasible(trial: optuna.Trial, feasible: bool) -> None:
        v = FEASIBLE if feasible else INFEASIBLE
        trial.set_user_attr("constraint", [v])
        if _HAS_SET_CONSTRAINT:
            trial.set_constraint("failure", v)

    @staticmethod
    def _attrs(
        trial: optuna.Trial, summary: dict[str, Any] | None, status: str, reason: str, extra: dict[str, Any] | None
    ) -> None:
        s = summary or {}
        attrs = {
            "status": status,
            "reason": reason,
            "tokens_per_s": s.get("tokens_per_s"),
            "spread": s.get("spread"),
            "peak_mem": s.get("peak_mem"),
            "energy_per_token": s.get("energy_per_token"),
            "samples": s.get("samples", []),
            "load": s.get("load"),
            "measure": {
                k: s[k] for k in ("n", "steps", "seconds", "done_reason", "warmed_up", "ci", "step_ms") if k in s
            },
        }
        attrs.update(extra or {})
        for k, v in attrs.items():
            trial.set_user_attr(k, v)

    def tell_ok(
        self,
        p: Proposal,
        summary: dict[str, Any],
        status: str = "ok",
        reason: str = "",
        extra: dict[str, Any] | None = None,
        feasible: bool = True,
    ) -> None:
        """A healthy measured trial: COMPLETE with its tokens/s. `feasible` False: measured, but not a setting
        to apply (its compile kept recompiling): a violated constraint, so neither the sampler nor
        `candidates` takes it as a result to build on."""
        value = summary.get("tokens_per_s")
        if value is None or not math.isfinite(value):
            raise ValueError("tell_ok needs a measured tokens_per_s; use tell_pruned for trials without one")
        self._attrs(p.trial, summary, status, reason, extra)
        self._set_feasible(p.trial, feasible)
        self.study.tell(p.trial, float(value))

    def tell_pruned(
        self, p: Proposal, summary: dict[str, Any] | None, reason: str, extra: dict[str, Any] | None = None
    ) -> None:
        """Healthy but stopped early (slower than the best, or cut): PRUNED, estimate as intermediate value."""
        self._attrs(p.trial, summary, "pruned", reason, extra)
        self._set_feasible(p.trial, True)
        value = (summary or {}).get("tokens_per_s")
        if value is not None and math.isfinite(value):
            p.trial.report(float(value), int((summary or {}).get("steps") or 0))
        self.study.tell(p.trial, state=TrialState.PRUNED)

    def tell_infeasible(
        self,
        p: Proposal,
        kind: str,
        reason: str,
        summary: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """OOM/NaN/divergence/compile error/crash: COMPLETE, 0 tokens/s, violated constraint (module doc)."""
        self._attrs(p.trial, summary, "infeasible", reason, {"kind": kind, **(extra or {})})
        self._set_feasible(p.trial, False)
        self.study.tell(p.trial, 0.0)

    def tell_failed(self, p: Proposal, reason: str) -> None:
        """Abandoned without a verdict on the configuration (the session stopped): FAIL, ignored by the sampler."""
        p.trial.set_user_attr("status", "abandoned")
        p.trial.set_user_attr("reason", reason)
        self.study.tell(p.trial, state=TrialState.FAIL)

    def record(
        self,
        toggles: Toggles,
        summary: dict[str, Any],
        source: str = "baseline",
        status: str = "ok",
        reason: str = "",
        extra: dict[str, Any] | None = None,
    ) -> int | None:
        """Add a measurement made outside ask/tell (the baseline, which runs anyway) as a finished trial.

        Returns its number, or None when `toggles` is outside the space or the
        configuration is already in the study (then nothing is added).
        """
        value = summary.get("tokens_per_s")
        if not self.space.contains(toggles) or value is None or not math.isfinite(value):
            return None
        params = self.space.to_params(toggles)
        if self._known(self.space.config_key(params)) is not None:
            return None
        attrs = {
            "status": status,
            "reason": reason,
            "source": source,
            "run": self.run_id,
            "toggles": dataclasses.asdict(toggles),
            "tokens_per_s": value,
            "spread": summary.get("spread"),
            "peak_mem": summary.get("peak_mem"),
            "energy_per_token": summary.get("energy_per_token"),
            "samples": summary.get("samples", []),
            "load": summary.get("load"),
            "constraint": [FEASIBLE],
            **(extra or {}),
        }
        kwargs: dict[str, Any] = {
            "params": params,
            "distributions": self.space.distributions(),
            "value": float(value),
            "user_attrs": attrs,
        }
        if _HAS_SET_CONSTRAINT:
            kwargs["constraints"] = {"failure": FEASIBLE}
        else:
            kwargs["system_attrs"] = {"constraints": [FEASIBLE]}
        self.study.add_trial(optuna.trial.create_trial(**kwargs))
        return self.trials()[-1].number

    def record_baseline(self, toggles: Toggles, summary: dict[str, Any], status: str) -> None:
        """This run's measurement of its starting configuration: the study's `baseline` (the latest) and
        `baseline:<run>` (`baseline_of`), whether or not the configuration lies in the space."""
        entry = {
            "run": self.run_id,
            "tokens_per_s": summary.get("tokens_per_s"),
            "spread": summary.get("spread"),
            "energy_per_token": summary.get("energy_per_token"),
            "status": status,
            "samples": summary.get("samples", []),
            "load": summary.get("load"),
            "toggles": dataclasses.asdict(toggles),
        }
        self.set_attr("baseline", {k: v for k, v in entry.items() if k != "samples"})
        self.set_attr(f"baseline:{self.run_id}", entry)

    def baseline_of(self, run: str | None) -> dict[str, Any] | None:
        """Run `run`'s baseline as `record_baseline` stored it, or None."""
        entry = self.get_attr(f"baseline:{run}") if run else None
        return entry if isinstance(entry, dict) else None

    def baselines(self) -> dict[str, dict[str, Any]]:
        """Every run's baseline (`record_baseline`), by run."""
        return {
            k.split(":", 1)[1]: v
            for k, v in self.study.user_attrs.items()
            if k.startswith("baseline:") and isinstance(v, dict)
        }

    def record_remeasure(self, number: int, summary: dict[str, Any], status: str = "ok", reason: str = "") -> None:
        """Keep a re-measurement of trial `number` (study attrs: a finished trial cannot be changed)."""
        key = f"remeasure:{number}"
        entries = list(self.get_attr(key, []))
        entries.append(
            {
                "run": self.run_id,
                "status": status,
                "reason": reason,
                "tokens_per_s": summary.get("tokens_per_s"),
                "spread": summary.get("spread"),
                "samples": summary.get("samples", []),
                "load": summary.get("load"),
            }
        )
        self.set_attr(key, entries)

    # --- results ----------------------------------------------------------------------
    def candidates(self, run: str | None = None) -> list[Candidate]:
        """Feasible measured configurations, best first, each once, pooled with its re-measurements.

        A configuration whose latest re-measurement failed is left out: it did not hold up. With `run`, only
        that run's measurements count (a configuration it did not measure is left out).
        """
        seen: set[tuple] = set()
        out: list[Candidate] = []
        for t in self.trials((TrialState.COMPLETE,)):
            ua = t.user_attrs
            if "duplicate_of" in ua or ua.get("status") == "infeasible" or t.value is None:
                continue
            if any(v > 0 for v in ua.get("constraint", [FEASIBLE])):
                continue
            key = self.space.config_key(t.params)
            if key in seen:
                continue
            seen.add(key)
            remeasures = self.get_attr(f"remeasure:{t.number}", [])
            if remeasures and remeasures[-1].get("status") != "ok":
                continue
            own = run is None or ua.get("run") == run
            if run is not None:
                remeasures = [r for r in remeasures if r.get("run") == run]
                if not own and not remeasures:
                    continue
            samples = list(ua.get("samples") or []) if own else []
            for r in remeasures:
                samples += list(r.get("samples") or [])
            if samples:
                est, lo, hi = median_ci(samples)
            elif not own:
                continue
            else:
                est = float(t.value)
                sp = float(ua.get("spread") or 0.0)
                lo, hi = est - sp, est + sp
            toggles = self.toggles_of(t)
            out.append(
                Candidate(
                    t.number,
                    toggles,
                    est,
                    (hi - lo) / 2,
                    lo,
                    hi,
                    len(samples),
                    len(remeasures),
                    ua.get("overhead_s"),
                    ua.get("run"),
                )
            )
        out.sort(key=lambda c: c.tokens_per_s, reverse=True)
        return out

    def toggles_of(self, trial: Any) -> Toggles:
        """The toggles a trial ran: its stored record (read as today's types, so an older version's
        `micro_batch: "8"` is 8), or its sampled parameters where the record does not load."""
        stored = trial.user_attrs.get("toggles")
        if isinstance(stored, dict):
            try:
                return section_from_dict(Toggles, stored)
            except ConfigError:
                pass
        return self.space.to_toggles(trial.params)

    def best_known(self) -> tuple[Toggles, float] | None:
        """The best feasible configuration learned so far and its tokens/s, or None: lets a session skip tuning."""
        c = self.candidates()
        return (c[0].toggles, c[0].tokens_per_s) if c else None
