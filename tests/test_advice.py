"""Why a step is slow (gptop.advice): a ranked list, each item with the figure it rests on, what to try, and
the toggles the tuner would try first; never a value the device cannot run at full speed."""

from __future__ import annotations

from fixtures.streams import gpu_profile
from gptop.advice import Concern
from test_state import PH, ev, fed, hello, step


def concerns(state):
    return [a.concern for a in state.advice()]


def test_a_data_bound_run_names_data_first_and_a_compute_bound_one_compute():
    data_bound = fed(hello(), step(1, 1.0, {**PH, "data": 40.0, "forward": 15.0, "backward": 30.0}))
    assert concerns(data_bound)[0] is Concern.DATA
    first = data_bound.advice()[0]
    assert first.evidence == "data loading is 40% of the step"
    assert dict(first.toggles) == {"prefetch": 4, "workers": 2}  # what the tuner would try first
    compute = fed(hello(precision="fp32"), step(1, 1.0, PH))
    assert concerns(compute) == [Concern.COMPUTE]
    assert dict(compute.advice()[0].toggles) == {"compile": "default", "precision": "bf16"}


def test_recompilations_come_first_with_their_step():
    s = fed(
        hello(compile="default"),
        step(1, 1.0, PH),
        ev("warning", 2.0, message="torch.compile recompiled 1x at step 7 (...)", kind="recompile", step=7),
    )
    first = s.advice()[0]
    assert first.concern is Concern.COMPILE and "recompiled 1x (last at step 7)" in first.evidence
    assert s.bottleneck_hint() == first.line


def test_a_profile_with_short_operators_is_launch_bound_on_the_cpu():
    p = gpu_profile()
    cpu_profile = ev("profile", 3.0, first=4, last=6, path="t.json", step_ms=100.0, phases=[], short_op_share=0.35)
    s = fed(hello("cpu", compile="off"), step(1, 1.0, PH), cpu_profile)
    launch = [a for a in s.advice() if a.concern is Concern.LAUNCH]
    assert launch and "35% of the step in operators under 10 µs (profile of steps 4-6)" in launch[0].evidence
    assert dict(launch[0].toggles) == {"compile": "default"}
    # the GPU fixture's profile has few short kernels: no launch item
    g = fed(hello(), step(1, 1.0, PH), p)
    assert Concern.LAUNCH not in concerns(g)


def test_cuda_graphs_are_never_advised_with_gradient_accumulation():
    acc = hello()
    acc = ev(
        "hello",
        0.0,
        config=acc.config,
        device=acc.device.to_dict(),
        model={"family": "llama", "size": "small"},
        accumulation=4,
    )
    s = fed(acc, step(1, 1.0, PH, gpu_idle_ms=30.0))
    host = [a for a in s.advice() if a.concern is Concern.HOST]
    assert host and "reduce-overhead" not in host[0].action and host[0].toggles == ()


def test_a_throttled_gpu_is_named():
    reading = {"index": 0, "name": "H100", "util_pct": 99.0, "clock_reasons": ["sw thermal"]}
    s = fed(hello(), step(1, 1.0, PH), ev("device", 2.0, mode="gpu", devices=[reading]))
    assert Concern.THROTTLE in concerns(s)
    assert "sw thermal" in next(a for a in s.advice() if a.concern is Concern.THROTTLE).evidence


def client_hello(config: dict, command: bool = True):
    """A probe client's hello (it reports its precision and little else), after gptop's record of the start."""
    base = hello()
    start = ev("hello", 0.0, early=True, config={}, device=base.device.to_dict(), model={}, command=["python", "t.py"])
    said = ev("hello", 0.1, config=config, device=base.device.to_dict(), model={}, client="probe")
    return (start, said) if command else (said,)


def test_a_clients_program_is_taken_to_run_at_pytorchs_defaults_where_it_did_not_say():
    """A probe client says only its precision: its optimizer is not known to be fused, nor its model compiled,
    so an optimizer-bound or launch-bound step is still named (without a gptop flag to try: not its program)."""
    s = fed(
        *client_hello({"toggles": {"precision": "fp32"}, "log": {"log_every": 1}}),
        step(1, 1.0, {**PH, "optimizer": 35.0, "forward": 25.0, "backward": 30.0}),
    )
    items = {a.concern: a for a in s.advice()}
    assert items[Concern.OPTIMIZER].evidence == "optimizer is 35% of the step"
    assert items[Concern.OPTIMIZER].action == "" and items[Concern.OPTIMIZER].toggles == ()
    assert s.precision_label() == "fp32"


def test_before_a_client_says_its_toggles_nothing_is_claimed():
    start, _ = client_hello({})
    s = fed(start)
    assert s.toggles is None and s.precision_label() is None and s.toggle_diff(None) == {}


def test_cuda_graphs_are_never_advised_with_several_ranks():
    """Nor under DDP or FSDP2, whose collectives inductor's CUDA graphs do not capture; one rank is advised."""
    base = hello()
    for world, parallel, advised in ((1, None, True), (2, "ddp", False), (4, "fsdp", False)):
        h = ev(
            "hello",
            0.0,
            config=base.config,
            device=base.device.to_dict(),
            model={"family": "llama", "size": "small"},
            accumulation=1,
            world_size=world,
            parallel=parallel,
        )
        host = [a for a in fed(h, step(1, 1.0, PH, gpu_idle_ms=30.0)).advice() if a.concern is Concern.HOST]
        assert host and ("reduce-overhead" in host[0].action) is advised, (world, host[0].action)
