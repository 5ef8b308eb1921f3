import optuna
import pytest

from trainer.contract.config import ConfigError
from fixtures.toggles import Toggles
from trainer.contract.device import DeviceInfo
from tuner.space import NUMERICS_CHANGING, SearchSpace, micro_batch_choices

CPU = DeviceInfo(type="cpu", name="cpu", cpu_count=8, has_compiler=True)
CPU_NO_CC = DeviceInfo(type="cpu", name="cpu", has_compiler=False)
H100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=int(80e9))
V100 = DeviceInfo(type="cuda", name="Tesla V100", capability=(7, 0), total_memory=int(16e9))


def test_cpu_space_offers_only_cpu_values():
    s = SearchSpace.for_device(Toggles(), CPU, global_batch=32)
    assert s.choices["precision"] == ("fp32", "bf16")
    assert s.choices["compile"] == ("off", "default", "max-autotune-no-cudagraphs")
    assert s.choices["cuda_allocator"] == ("default",)
    assert "cuda_allocator" not in s.params and s.frozen["cuda_allocator"] == "default"
    assert s.choices["micro_batch"] == (1, 2, 4, 8, 16, 32)
    assert s.choices["prefetch"] == (0, 1, 2, 4) and s.choices["workers"] == (0, 1, 2)
    assert SearchSpace.for_device(Toggles(), CPU_NO_CC, 32).choices["compile"] == ("off",)


def test_cpu_without_native_bf16_leaves_it_out_unless_asked():
    avx2 = DeviceInfo(type="cpu", name="cpu", cpu_count=2, cpu_bf16=False)
    assert SearchSpace.for_device(Toggles(), avx2, 32).choices["precision"] == ("fp32",)
    widened = SearchSpace.for_device(Toggles(), avx2, 32, spec="precision+=bf16")
    assert widened.choices["precision"] == ("fp32", "bf16")
    started_in_bf16 = SearchSpace.for_device(Toggles(precision="bf16"), avx2, 32)
    assert started_in_bf16.choices["precision"] == ("fp32", "bf16")  # the start is always in the space


def test_h100_space_and_older_gpu():
    s = SearchSpace.for_device(Toggles(), H100, global_batch=32)
    assert {"tf32", "bf16", "fp16"} <= set(s.choices["precision"])
    assert "reduce-overhead" in s.choices["compile"] and "max-autotune" in s.choices["compile"]
    assert s.choices["cuda_allocator"] == ("default", "expandable_segments")
    old = SearchSpace.for_device(Toggles(), V100, global_batch=32)
    assert "bf16" not in old.choices["precision"] and "tf32" not in old.choices["precision"]
    assert not any(p.startswith("fp8") for p in old.choices["precision"])


def test_micro_batch_divides_per_rank_batch():
    assert micro_batch_choices(24) == (1, 2, 4, 8)
    s = SearchSpace.for_device(Toggles(), CPU, global_batch=32, world_size=4)
    assert s.per_rank == 8 and s.choices["micro_batch"] == (1, 2, 4, 8)
    with pytest.raises(ConfigError):
        SearchSpace.for_device(Toggles(), CPU, global_batch=30, world_size=4)


def test_spec_grammar_restrict_freeze_widen():
    base = Toggles(precision="fp32", compile="off", prefetch=2)
    s = SearchSpace.for_device(base, H100, 32, spec="precision=bf16 compile=off,default -cuda-allocator prefetch+=8")
    assert s.choices["precision"] == ("bf16",)
    assert s.choices["compile"] == ("off", "default")
    assert s.choices["cuda_allocator"] == ("default",)
    assert s.choices["prefetch"] == (0, 1, 2, 4, 8)
    s2 = SearchSpace.for_device(base, CPU, 32, spec="-all;fused_adamw=on,off")
    assert s2.params == ("fused_adamw",)
    assert s2.to_toggles({"fused_adamw": True}) == Toggles(precision="fp32", fused_adamw=True, prefetch=2)


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("foo=1", "'foo=1': unknown toggle 'foo'"),
        ("compile=fast", "'fast' is not one of"),
        ("precision=fp16", "fp16 is not supported on cpu"),
        ("micro_batch=3", "does not divide the per-rank batch 32"),
        ("prefetch=x", "'x' is not a whole number"),
        ("workers=-1", "'workers=-1': -1 must be at least 0"),
        ("compile=", "empty value"),
        ("compile=off,,default", "empty value"),
        ("fused_adamw=maybe", "'maybe' is not on/off"),
        ("junk", "expected NAME=V1,V2"),
        ("-bogus", "unknown toggle 'bogus'"),
        ("   ", "empty"),
    ],
)
def test_spec_errors_name_the_bad_part(spec, fragment):
    with pytest.raises(ConfigError) as e:
        SearchSpace.for_device(Toggles(), CPU, 32, spec=spec)
    assert e.value.option == "--tune-space"
    assert fragment in str(e.value)


def test_suggest_key_and_numerics():
    s = SearchSpace.for_device(Toggles(), CPU, 32)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        t = s.suggest(study.ask())
        assert s.contains(t) and isinstance(t.micro_batch, int)
    assert s.key() == SearchSpace.for_device(Toggles(), CPU, 32).key()
    assert s.key() != SearchSpace.for_device(Toggles(), CPU, 32, spec="-precision").key()
    assert NUMERICS_CHANGING == {"precision", "optimizer", "quantize_base"}
    assert s.numerics_changing(Toggles(precision="bf16"))
    assert s.numerics_changing(Toggles(optimizer="adamw-8bit"))
    assert s.numerics_changing(Toggles(quantize_base="nf4"))
    assert not s.numerics_changing(Toggles(compile="default", micro_batch=4, fused_adamw=True))
    assert s.to_params(Toggles(micro_batch=4))["micro_batch"] == 4
    assert not s.contains(Toggles(micro_batch=3))
