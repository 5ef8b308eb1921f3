import math

import pytest
import torch

from trainer.autobatch import candidates, find_micro_batch


def test_candidates_divide_the_batch():
    assert candidates(32) == [1, 2, 4, 8, 16, 32]
    assert candidates(12) == [1, 2, 4, 12]


def test_largest_that_fits_with_margin():
    tried = []

    def probe(mb):
        tried.append(mb)
        if mb > 16:
            raise torch.OutOfMemoryError("boom")
        return 100 + 50 * mb

    assert find_micro_batch(probe, 64, capacity=10_000, margin=0.1) == 16
    assert find_micro_batch(lambda mb: 100 + 50 * mb, 64, capacity=950, margin=0.1) == 8  # 16 would need 900 > 855
    # sizes predicted to exceed the limit are never run
    tried.clear()
    find_micro_batch(lambda mb: tried.append(mb) or 100 + 100 * mb, 1024, capacity=2000)
    assert max(tried) <= 16


def test_nothing_fits():
    with pytest.raises(torch.OutOfMemoryError):
        find_micro_batch(lambda mb: 10_000, 8, capacity=1000)


def test_jumps_to_the_largest_predicted_to_fit():
    tried = []
    assert find_micro_batch(lambda mb: tried.append(mb) or 100 + 10 * mb, 16, capacity=10_000) == 16
    assert tried == [1, 2, 16]  # not 4 and 8: the line through 1 and 2 says 16 fits


def test_steps_down_when_the_jump_does_not_fit():
    tried = []

    def probe(mb):  # memory grows faster than the first two probes suggest
        tried.append(mb)
        return 100 + 10 * mb + (40 * mb if mb >= 8 else 0)

    assert find_micro_batch(probe, 32, capacity=1000, margin=0.0) == 16
    assert tried == [1, 2, 32, 16]


def test_only_the_allowed_candidates_are_probed():
    """A CUDA-graph compile mode runs without accumulation: `--micro-batch auto` probes the whole batch only."""
    probed = []

    def probe(mb):
        probed.append(mb)
        return mb * 10

    assert find_micro_batch(probe, 16, capacity=1000, only=[16]) == 16 and probed == [16]
    with pytest.raises(torch.OutOfMemoryError, match="even micro-batch 16 does not fit"):
        find_micro_batch(probe, 16, capacity=100, only=[16])


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_the_state_counted_for_the_first_step_is_what_the_step_allocates(name):
    from trainer import optim
    from trainer.contract.config import TrainConfig

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    cfg = TrainConfig()
    cfg.toggles.optimizer = name
    opt = optim.build_optimizer(model, cfg)
    pending = optim.pending_state_bytes(opt, name)
    assert pending > 0 and optim.state_bytes(opt) == 0
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert optim.state_bytes(opt) == pending  # counted exactly as the step allocated it
    assert optim.pending_state_bytes(opt, name) == 0  # nothing left to allocate (also after a resume)


class FakeCudaMemoryApi:
    """torch.cuda's memory functions for one GPU: 80 GiB, of which another process holds 30 GiB."""

    GiB = 2**30

    def mem_get_info(self, device):
        return 40 * self.GiB, 80 * self.GiB  # free, total

    def memory_reserved(self, device):
        return 10 * self.GiB  # this process's caching allocator

    def max_memory_reserved(self, device):
        return 12 * self.GiB

    def max_memory_allocated(self, device):
        return 9 * self.GiB


def test_gpu_capacity_is_free_memory_plus_what_this_process_holds():
    """`--micro-batch auto` plans against what the process can still grow into, not the device's total (a
    CUDA context, another process or a library may hold part of it)."""
    from trainer.memory import CudaMemory

    m = CudaMemory(torch.device("cuda:1"), cuda=FakeCudaMemoryApi())
    assert m.capacity() == 50 * 2**30
    assert m.figures() == {
        "allocated_peak": 9 * 2**30,
        "reserved_peak": 12 * 2**30,
        "total": 80 * 2**30,
        "capacity": 50 * 2**30,
    }


@pytest.mark.parametrize(
    "environ, var, want, warned",
    [
        ({}, "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", False),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size_mb:128,expandable_segments:True",
            True,
        ),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,roundup_power2_divisions:4"},
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True,roundup_power2_divisions:4",
            True,
        ),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True",
            False,
        ),
        (
            {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8", "PYTORCH_CUDA_ALLOC_CONF": "x:1"},
            "PYTORCH_ALLOC_CONF",
            "garbage_collection_threshold:0.8,expandable_segments:True",
            True,
        ),
    ],
)
def test_expandable_segments_merge_into_the_users_allocator_settings(environ, var, want, warned):
    """`--cuda-allocator expandable_segments` was a silent no-op for anyone who had set the allocator
    variable: now it is merged into the variable torch reads, keeping the user's options, with a warning."""
    from trainer.memory import enable_expandable_segments

    env = dict(environ)
    note = enable_expandable_segments(env)
    assert env[var] == want and (note is not None) == warned
    if note:
        assert var in note and "expandable_segments" in note
    assert {k: v for k, v in env.items() if k != var} == {k: v for k, v in environ.items() if k != var}


class TwoRanks:
    """This rank's view of a two-rank `--micro-batch auto` probe (the Group interface probe_micro_batch uses): its
    own probe counts the collectives it issues; the peer's probe of each micro-batch is `peer(mb)` -> (peak bytes
    or None when it ran out of memory, collectives issued); the control group's MAX/MIN combine the two."""

    PER_PROBE = 6  # the collectives a whole forward and backward issues (FSDP's all-gathers, reduce-scatters)

    def __init__(self, mine, peer, counted: bool = True):
        self.mine, self.peer, self.counted = mine, peer, counted
        self.issued = 0
        self.mb = 0

    def probe_local(self, mb: int) -> int:
        self.mb = mb
        peak, issued = self.mine(mb)
        self.issued += issued
        if peak is None:
            raise torch.OutOfMemoryError(f"micro-batch {mb}")
        return peak

    def collectives(self) -> int | None:
        return self.issued if self.counted else None  # None: a torch that does not count them

    def host_min(self, value: float) -> float:
        return value

    def host_max(self, value: float) -> float:
        raise AssertionError("the probe agrees on its outcome and its collectives in one all-reduce")

    def host_maxes(self, values: list[float]) -> list[float]:
        peak, issued = self.peer(self.mb)
        peak = math.inf if peak is None else float(peak)
        theirs = [peak, float(issued), -float(issued)] if self.counted else [peak, -peak]
        assert len(values) == len(theirs)
        return [max(a, b) for a, b in zip(values, theirs)]


def fits_up_to(limit: int, oom_after: int):
    """A rank whose probe fits micro-batches up to `limit`; above, it runs out of memory after `oom_after` of a
    probe's collectives."""
    return lambda mb: (1000 * mb, TwoRanks.PER_PROBE) if mb <= limit else (None, oom_after)


@pytest.mark.parametrize(
    "mine, peer, want",
    [
        (fits_up_to(4, 3), fits_up_to(4, 3), 4),  # both ran out at the same collective: still in step
        (fits_up_to(4, 3), fits_up_to(64, 0), "out of step"),  # only this rank ran out, part-way
        (fits_up_to(64, 0), fits_up_to(4, 2), "out of step"),  # only the peer did
        (fits_up_to(4, 3), fits_up_to(4, 5), "out of step"),  # both, at different collectives
        (fits_up_to(4, 6), fits_up_to(64, 0), 4),  # out of memory after its last collective: in step
    ],
    ids=["both-same-point", "this-rank-only", "peer-only", "both-different-points", "after-the-collectives"],
)
def test_ranks_agree_on_a_probe_before_any_issues_another_collective(mine, peer, want):
    """FSDP's forward and backward are collective: a rank that runs out of memory part-way through a probe leaves
    the peers' later all-gathers unmatched, and the next probe's would pair with them (a hang, or wrong buffers).
    The ranks agree on each probe's outcome and on how many collectives it issued, in one all-reduce on the
    control group, before any issues another; out of step, every rank stops with the same error, naming the
    largest micro-batch that fitted everywhere."""
    from trainer.autobatch import probe_micro_batch
    from trainer.contract.config import ConfigError

    for counted in (True, False):
        ranks = TwoRanks(mine, peer, counted)
        run = lambda: probe_micro_batch(  # noqa: E731
            ranks.probe_local, 64, capacity=1000 * 64 * 2, group=ranks, compile_mode="off", log=lambda s: None
        )
        # Without torch's count, an out-of-memory on some ranks and not others is taken as out of step.
        one_sided = (mine(64)[0] is None) != (peer(64)[0] is None)  # 64: the first size that does not fit
        if (want == "out of step") if counted else one_sided:
            with pytest.raises(ConfigError, match=r"--micro-batch.*out of step.*--micro-batch 2\b"):
                run()
        else:
            assert run() == 4
