"""What the tuner tries first and what it screens out before running (tuner.proposals), without a study."""

import dataclasses

from fixtures.toggles import Toggles
from trainer.contract.device import DeviceInfo
from trainer.contract.states import TrialOutcome, TrialStatus
from tuner.proposals import advised, first_guesses, nearest, predicted_oom, screen
from tuner.space import SearchSpace

CPU = DeviceInfo(type="cpu", name="cpu", has_compiler=True)
START = Toggles(micro_batch=8, fused_adamw=False)
SPACE = SearchSpace.for_device(
    START,
    CPU,
    32,
    spec="-all compile=off,default fused_adamw=on,off prefetch=0,2,4 micro_batch=4,8,16,32 precision=fp32,bf16",
)


def test_nearest_keeps_an_allowed_value_else_the_closest_integer_larger_on_a_tie():
    assert nearest((0, 2, 4), 2) == 2
    assert nearest((0, 2, 4), 8) == 4 and nearest((0, 2, 4), 3) == 4 and nearest((0, 2, 4), 1) == 2
    assert nearest(("off", "default"), "max-autotune") is None
    assert nearest((0, 2), True) is None  # a bool is not an integer here


def test_advice_tries_are_single_changes_on_the_start_in_the_space():
    tries = [
        ("fused_adamw", True, "optimizer is 31% of the step"),
        ("prefetch", 8, "data-bound"),  # not in the space: the nearest value, 4
        ("workers", 2, "host-bound"),  # frozen by the spec: left alone
        ("fused_adamw", True, "again"),  # the same change again: dropped
        ("micro_batch", 8, "already the start"),
    ]  # no change: dropped
    out = advised(tries, START, SPACE)
    assert [t for t, _, _ in out] == [
        dataclasses.replace(START, fused_adamw=True),
        dataclasses.replace(START, prefetch=4),
    ]
    assert all(src == "advice" for _, src, _ in out)
    assert [x["advice"] for _, _, x in out] == [
        "optimizer is 31% of the step: fused_adamw=on",
        "data-bound: prefetch=4",
    ]


def test_first_guesses_come_in_order_start_advice_recipe():
    guesses = first_guesses(START, SPACE, CPU, 16, [("fused_adamw", True, "evidence")])
    assert [src for _, src, _ in guesses] == ["current", "advice", "recipe"]
    assert guesses[0][0] == START
    assert guesses[2][0].micro_batch == 16  # the recipe takes the largest micro-batch that fits


def test_a_micro_batch_above_what_fits_is_predicted_to_run_out_of_memory():
    assert "predicted OOM: micro-batch 16 > 8" in predicted_oom(Toggles(micro_batch=16), 8, START)
    assert predicted_oom(Toggles(micro_batch=8), 8, START) is None
    assert predicted_oom(Toggles(micro_batch=16, activation_checkpointing=True), 8, START) is None
    assert predicted_oom(Toggles(micro_batch=16, precision="bf16"), 8, START) is None  # narrower: 2x fits
    assert "x2 for the narrower precision" in predicted_oom(Toggles(micro_batch=32, precision="bf16"), 8, START)
    assert predicted_oom(Toggles(micro_batch=16), None, START) is None  # nothing known: try it


def test_screening_names_the_status_and_the_failure_kind():
    kw = dict(start=START, max_mb=8, dev=CPU, space=SPACE, slow_compile=set(), trial_timeout_s=600.0)
    assert screen(Toggles(micro_batch=8), **kw) is None
    oom = screen(Toggles(micro_batch=32), **kw)
    assert oom.status is TrialStatus.INFEASIBLE and oom.failure is TrialOutcome.OOM
    no_cc = DeviceInfo(type="cpu", name="cpu", has_compiler=False)
    refused = screen(Toggles(micro_batch=8, compile="default"), **{**kw, "dev": no_cc})
    assert refused.status is TrialStatus.INFEASIBLE and refused.failure is TrialOutcome.COMPILE
    assert refused.reason.startswith("compile=default: torch.compile needs a C++ compiler")
    fp16 = screen(Toggles(micro_batch=8, precision="fp16"), **kw)  # any other refusal would crash the trainer
    assert fp16.failure is TrialOutcome.CRASH and fp16.reason.startswith("precision=fp16: ")
    slow = screen(Toggles(micro_batch=8, compile="default"), **{**kw, "slow_compile": {"default"}})
    assert slow.status is TrialStatus.PRUNED and slow.failure is None and "within a trial's 600 s" in slow.reason
