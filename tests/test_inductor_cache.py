"""A compiled artefact of the shared inductor cache that does not load (a file a killed process left
half-written) is not a verdict on the setting: the trainer compiles again, once, in the run's own cache
(trainer.inductor_cache). The failure is faked at its boundary: no real compile."""

import os

import torch

from trainer.contract import rundir
from trainer.contract.events import CompileWarning
from trainer.inductor_cache import ENV, OwnCache, artefact_failure
from trainer.train import EXIT_COMPILE, EXIT_OK

from test_trainer import of, run


class InductorError(RuntimeError):
    """The shape of torch._inductor.exc.InductorError: the loader's error is its cause."""


def corrupt(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 16)
    return path


def wrapped(path):
    try:
        raise ImportError(f"{path}: invalid ELF header")
    except ImportError as e:
        err = InductorError(f"ImportError: {path}: invalid ELF header")
        err.__cause__ = e
        return err


def test_only_a_library_that_does_not_load_is_an_artefact_failure(tmp_path):
    so = tmp_path / "go" / "cgocx.main.so"
    art = artefact_failure(wrapped(so))
    assert art is not None and art.path == so and art.reason == "invalid ELF header"
    assert artefact_failure(OSError(f"{so}: file too short")).reason == "file too short"
    for other in (
        RuntimeError("LoweringException: aten.foo"),
        ImportError("No module named 'triton'"),
        OSError("[Errno 28] No space left on device"),
        InductorError("CppCompileError: error: ..."),
    ):
        assert artefact_failure(other) is None  # the setting's (or the disk's): not retried


def test_recover_removes_the_bad_file_and_switches_to_the_runs_own_cache_once(tmp_path, monkeypatch):
    shared = tmp_path / "torchinductor_me"
    monkeypatch.setenv(ENV, str(shared))
    bad = corrupt(shared / "go" / "cgocx.main.so")
    good = shared / "ab" / "fine.main.so"
    good.parent.mkdir(parents=True)
    good.write_bytes(b"\x7fELF" + b"\1" * 200)
    cleared = []
    own = OwnCache(tmp_path / "run" / "inductor-cache", clear=lambda: cleared.append(1))
    assert own.recover(RuntimeError("a lowering error")) is None and not own.used
    art = own.recover(wrapped(bad))
    assert art is not None and art.path == bad
    assert not bad.exists()  # the next build makes it again, for every run
    assert (
        os.environ[ENV] == str(tmp_path / "run" / "inductor-cache") and (tmp_path / "run" / "inductor-cache").is_dir()
    )
    assert cleared == [1]
    assert own.recover(wrapped(good)) is None  # once per process: a second failure is the setting's
    assert good.exists()
    # a library that loads is never removed, even when a failure names it
    monkeypatch.setenv(ENV, str(shared))
    assert OwnCache(tmp_path / "other", clear=lambda: None).recover(wrapped(good)) is not None and good.exists()


def test_a_run_that_hits_a_corrupt_artefact_retries_the_step_and_learns_the_same(tmp_path, monkeypatch):
    """`--fault compile-cache@2` leaves a half-written library in the shared cache and fails the third step's
    forward loading it: the trainer warns (kind compile_cache, step 3), goes on in RUN_DIR/inductor-cache, and
    its weights at the end are bitwise those of the same run without the fault."""
    monkeypatch.setenv(ENV, str(tmp_path / "shared"))
    code, events, run_dir = run(tmp_path, "--max-steps", "4", "--fault", "compile-cache@2", name="faulted")
    assert code == EXIT_OK
    warned = [w for w in of(events, "warning") if w.kind == CompileWarning.COMPILE_CACHE]
    assert len(warned) == 1 and warned[0].step == 3 and "invalid ELF header" in warned[0].message
    assert not list((tmp_path / "shared").rglob("*.so"))  # the bad file is gone from the shared cache
    assert os.environ[ENV] == str(run_dir / "inductor-cache")
    assert [s.step for s in of(events, "step")][-1] == 4
    monkeypatch.setenv(ENV, str(tmp_path / "shared"))
    code, _, clean_dir = run(tmp_path, "--max-steps", "4", name="clean")
    assert code == EXIT_OK
    a = torch.load(rundir.list_checkpoints(run_dir)[-1].path, weights_only=False)["model"]
    b = torch.load(rundir.list_checkpoints(clean_dir)[-1].path, weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_corrupt_artefact_is_the_settings_compile_error(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "shared"))
    code, events, run_dir = run(tmp_path, "--max-steps", "4", "--fault", "compile-cache@1,compile-cache@2")
    assert code == EXIT_COMPILE
    err = of(events, "error")[-1]
    assert err.kind == "compile" and "again in the run's own inductor cache" in err.message
