"""Model side of the trainer on the CPU: families, sizes, objectives, MoE balancing, fp8 filter, FLOPs."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from trainer import flops, fp8, moe, objectives
from trainer.contract.config import ConfigError, ModelConfig, Toggles
from trainer.contract.device import DeviceInfo
from trainer.models import (
    SIZES,
    SIZE_ORDER,
    ModelBundle,
    build_model,
    is_pretrained_path,
    pad_vocab,
    param_counts,
    resolve_size,
    vocab_and_mask,
)
from trainer.models_guide import model_table, model_table_markdown

CPU = DeviceInfo(type="cpu", name="test-cpu", cpu_count=2, total_memory=8 << 30)
VOCAB = 500  # a small tokenizer keeps the tiny models' embeddings small and the tests fast
SEQ = 32


def cuda_dev(gib: float, name: str = "NVIDIA H100 80GB HBM3") -> DeviceInfo:
    return DeviceInfo(
        type="cuda", index=0, name=name, capability=(9, 0), total_memory=int(gib * (1 << 30)), cpu_count=16
    )


def build(
    family: str,
    *,
    attention: str = "sdpa",
    ac: bool = False,
    mask_id: int | None = None,
    seed: int = 0,
    vocab: int = VOCAB,
) -> ModelBundle:
    return build_model(
        ModelConfig(model=family, size="tiny"),
        vocab_size=vocab,
        seq_len=SEQ,
        toggles=Toggles(attention=attention, activation_checkpointing=ac),
        dev=CPU,
        mask_id=mask_id,
        seed=seed,
    )


def batch(b: int = 2, n: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, n + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> dict[str, ModelBundle]:
    return {f: build(f) for f in ("llama", "deepseek", "llada")}


# --- building ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek", "llada"])
def test_tiny_builds_and_trains_one_step(tiny, family):
    b = tiny[family]
    assert b.family == family and b.size == "tiny"
    assert b.objective == ("llada" if family == "llada" else "causal")
    assert next(b.model.parameters()).dtype == torch.float32
    assert b.total_params == sum(p.numel() for p in b.model.parameters())
    assert b.embedding_params == b.model.get_input_embeddings().weight.numel()
    assert 0.5e6 < b.total_params < 10e6  # a few million with the builtin 8192-token vocabulary
    x, y = batch()
    b.model.train()
    b.model.zero_grad()
    loss = objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(0))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in b.model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads if g is not None)
    assert b.model.get_input_embeddings().weight.grad is not None


def test_active_params(tiny):
    assert tiny["deepseek"].active_params < tiny["deepseek"].total_params
    assert tiny["deepseek"].is_moe
    for f in ("llama", "llada"):
        assert tiny[f].active_params == tiny[f].total_params and not tiny[f].is_moe
    # deepseek's active count: every non-routed-expert parameter plus top_k/E of the routed ones
    b = tiny["deepseek"]
    routed = sum(p.numel() for n, p in b.model.named_parameters() if ".mlp.experts." in n)
    d = SIZES["tiny"]
    assert b.active_params == b.total_params - routed + routed * d.top_k // d.experts


def test_deepseek_is_mla_and_routed_moe(tiny):
    m = tiny["deepseek"].model
    cfg = tiny["deepseek"].hf_config
    assert hasattr(m.model.layers[0].self_attn, "kv_a_proj_with_mqa")  # multi-head latent attention
    assert type(m.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace = 1
    assert type(m.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert cfg.n_routed_experts % cfg.n_group == 0
    per_group = cfg.n_routed_experts // cfg.n_group
    assert per_group >= 2 and cfg.topk_group * per_group >= cfg.num_experts_per_tok


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = build("llama", seed=1), build("llama", seed=1), build("llama", seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    wa, wb, wc = (m.model.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_vocab_padding_and_mask_id():
    assert pad_vocab(8192) == 8192 and pad_vocab(8193) == 8256 and pad_vocab(1) == 64
    assert vocab_and_mask("llama", 8192, None) == (8192, None)
    assert vocab_and_mask("deepseek", 8001, None) == (8064, None)
    assert vocab_and_mask("llada", 8192, None) == (8256, 8192)  # first padded slot
    assert vocab_and_mask("llada", 8000, None) == (8064, 8000)  # 8000 is a multiple of 64: still a slot
    assert vocab_and_mask("llada", 8192, 3) == (8192, 3)  # the data's own mask token
    assert vocab_and_mask("llada", 8192, 8200) == (8256, 8200)
    b = build("llada", vocab=448)  # 448 = 7 * 64
    assert b.vocab_size == 512 and b.mask_id == 448
    assert b.model.get_input_embeddings().weight.shape[0] == 512
    assert b.model.lm_head.out_features == 512
    assert build("llama", vocab=448).vocab_size == 448


# --- llada: bidirectional attention ----------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_llada_attends_to_later_tokens_and_llama_does_not(attention):
    x, _ = batch(1)
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % VOCAB  # change only the last token
    for family, expect_change in (("llada", True), ("llama", False)):
        m = build(family, attention=attention).model.eval()
        with torch.no_grad():
            a = m(input_ids=x).logits[0, 0]
            b = m(input_ids=x2).logits[0, 0]
        changed = not torch.allclose(a, b, atol=1e-6)
        assert changed == expect_change, (family, attention)


# --- objectives ------------------------------------------------------------------------


def test_llada_loss_is_deterministic_given_the_generator(tiny):
    b = tiny["llada"]
    b.model.eval()
    x, y = batch()
    with torch.no_grad():
        l1 = objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(7))
        torch.manual_seed(123)  # the global RNG must not matter
        l2 = objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(7))
        l3 = objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(8))
    assert torch.equal(l1, l2)
    assert not torch.equal(l1, l3)


def test_llada_loss_matches_the_paper_formula(tiny):
    b = tiny["llada"]
    b.model.eval()
    x, _ = batch(4)
    g = torch.Generator().manual_seed(3)
    noisy, masked, t = objectives.llada_mask(x, b.mask_id, torch.Generator().manual_seed(3))
    assert torch.equal(noisy[masked], torch.full_like(noisy[masked], b.mask_id))
    assert torch.equal(noisy[~masked], x[~masked])
    assert ((t > 0) & (t <= 1)).all() and (t == t[:, :1]).all()  # one t per sequence
    with torch.no_grad():
        loss = objectives.loss_fn("llada", b.model, x, None, generator=g, mask_id=b.mask_id)
        logits = b.model(input_ids=noisy).logits
    # LLaDA's reference: CE over the masked tokens / p_mask, summed, over batch * seq_len
    ce = torch.nn.functional.cross_entropy(logits[masked], x[masked], reduction="none") / t[masked]
    expected = ce.sum() / x.numel()
    assert torch.allclose(loss, expected, rtol=1e-5)


def test_causal_loss_is_mean_cross_entropy(tiny):
    b = tiny["llama"]
    b.model.eval()
    x, y = batch()
    with torch.no_grad():
        loss = objectives.loss_fn("causal", b.model, x, y)
        logits = b.model(input_ids=x).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    assert torch.allclose(loss, expected, rtol=1e-6)


def test_losses_never_read_back_from_the_device(tiny, monkeypatch):
    """No .item()/.tolist() in the loss path: on a GPU they would sync every micro-batch."""

    def forbidden(*a, **k):
        raise AssertionError("host read-back in the loss path")

    x, y = batch()
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    for b in tiny.values():
        objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(0)).backward()


@pytest.mark.parametrize("family", ["llama", "deepseek", "llada"])
def test_eager_and_sdpa_attention_give_the_same_loss(family):
    x, y = batch()
    losses = []
    for attention in ("sdpa", "eager"):
        b = build(family, attention=attention)
        assert b.model.config._attn_implementation == attention
        b.model.eval()
        with torch.no_grad():
            losses.append(objectives.loss_fn(b, b.model, x, y, generator=torch.Generator().manual_seed(0)))
    assert torch.allclose(losses[0], losses[1], rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_gives_the_same_loss_and_grads():
    x, y = batch()
    out = []
    for ac in (False, True):
        b = build("llama", ac=ac)
        assert b.model.is_activation_checkpointing == ac
        b.model.train()
        loss = objectives.loss_fn(b, b.model, x, y)
        loss.backward()
        out.append((loss.detach(), b.model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-6)
    assert torch.allclose(out[0][1], out[1][1], rtol=1e-4, atol=1e-7)


# --- sizes -------------------------------------------------------------------------------


def test_resolve_size_rule():
    assert resolve_size("small", "llama", CPU) == "small"
    assert resolve_size("auto", "llama", CPU) == "tiny"
    big_cpu = dataclasses.replace(CPU, cpu_count=64, total_memory=256 << 30)
    assert resolve_size("auto", "llama", big_cpu) == "small"
    assert resolve_size("auto", "llama", cuda_dev(8, "NVIDIA GeForce RTX 3070")) == "small"
    assert resolve_size("auto", "llama", cuda_dev(23.6, "NVIDIA GeForce RTX 4090")) == "medium"
    assert resolve_size("auto", "llama", cuda_dev(79.2)) == "large"
    assert resolve_size("auto", "llada", cuda_dev(39.4, "NVIDIA A100-SXM4-40GB")) == "medium"
    # MoE: total parameters decide; 16 GiB cannot hold medium deepseek's training state
    assert resolve_size("auto", "llama", cuda_dev(15.8, "Tesla V100-SXM2-16GB")) == "medium"
    assert resolve_size("auto", "deepseek", cuda_dev(15.8, "Tesla V100-SXM2-16GB")) == "small"
    # ... the run's own state decides: a low-bit optimizer, Adafactor or LoRA keep medium there
    for options in ({"optimizer": "adamw-8bit"}, {"optimizer": "adamw-4bit"}, {"optimizer": "adafactor"}, {"lora": 8}):
        assert resolve_size("auto", "deepseek", cuda_dev(15.8, "Tesla V100-SXM2-16GB"), **options) == "medium"
    with pytest.raises(ConfigError):
        resolve_size("huge", "llama", CPU)


def test_model_table_and_nominal_sizes():
    rows = model_table()
    assert [(r["family"], r["size"]) for r in rows] == [
        (f, s) for f in ("llama", "deepseek", "llada") for s in SIZE_ORDER
    ]
    by = {(r["family"], r["size"]): r for r in rows}
    for r in rows:
        assert 0 < r["active"] <= r["total"]
    for size, (low, high) in {
        "tiny": (1e6, 10e6),
        "small": (100e6, 150e6),
        "medium": (300e6, 400e6),
        "large": (1e9, 1.3e9),
    }.items():
        assert low < by[("llama", size)]["total"] < high
        assert low < by[("deepseek", size)]["active"] < high  # deepseek matches in active params
        assert by[("deepseek", size)]["total"] > by[("deepseek", size)]["active"]
    assert param_counts("llama", "tiny", VOCAB)["total"] == build("llama").total_params
    assert "| deepseek | large |" in model_table_markdown()


# --- FLOPs and MFU ---------------------------------------------------------------------


def test_flops_formula_by_hand():
    # 6 * N + 12 * L * H * Q * T with N = 1e6, L = 4, H = 8, Q = 64, T = 512
    assert flops.flops_per_token(1_000_000, 4, 8, 64, 512) == 6_000_000 + 12 * 4 * 8 * 64 * 512 == 18_582_912
    # MLA: scores over the qk head dim (96), values over the v head dim (64)
    assert flops.flops_per_token(10, 2, 4, 96, 100, v_head_dim=64) == 60 + 6 * 2 * 4 * (96 + 64) * 100


def test_bundle_flops_use_active_non_embedding_params(tiny):
    b = tiny["llama"]
    cfg = b.hf_config
    n = b.total_params - b.embedding_params  # the untied lm_head stays in N
    hd = cfg.hidden_size // cfg.num_attention_heads
    assert b.flops_per_token == 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * SEQ
    d = tiny["deepseek"]
    dc = d.hf_config
    expected = (
        6 * (d.active_params - d.embedding_params)
        + 6
        * dc.num_hidden_layers
        * dc.num_attention_heads
        * (dc.qk_nope_head_dim + dc.qk_rope_head_dim + dc.v_head_dim)
        * SEQ
    )
    assert d.flops_per_token == expected


def test_gpu_peak_table_has_blackwell_and_h800_and_divides_a_mig_slice():
    """B200, GB200 and H800 have rows (dense datasheet figures), matched before their neighbours; a MIG instance
    gets its compute slices' share of its GPU's peak, not the whole GPU's (MFU ~7x low on a 1g slice)."""
    assert flops.gpu_entry("NVIDIA B200")[0] == "B200" and flops.gpu_entry("NVIDIA GB200")[0] == "GB200"
    assert flops.gpu_peak_flops("NVIDIA B200", "bf16") == pytest.approx(2250e12)
    assert flops.gpu_peak_flops("NVIDIA GB200", "bf16") == pytest.approx(2500e12)
    assert flops.gpu_peak_flops("NVIDIA B200", "tf32") == pytest.approx(1125e12)
    assert flops.gpu_peak_flops("NVIDIA GB200", "fp32") == pytest.approx(80e12)
    assert flops.gpu_entry("NVIDIA H800")[0] == "H800 SXM" and flops.gpu_entry("NVIDIA H800 PCIe")[0] == "H800 PCIe"
    assert flops.gpu_peak_flops("NVIDIA H800", "bf16") == pytest.approx(989.5e12)
    assert flops.gpu_peak_flops("NVIDIA H800 PCIe", "bf16") == pytest.approx(756.5e12)
    whole = flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16") == pytest.approx(whole / 7)
    assert flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "tf32") == pytest.approx(156e12 * 3 / 7)
    assert flops.gpu_peak_flops("NVIDIA A100-SXM4-40GB MIG 7g.40gb", "bf16") == pytest.approx(312e12)
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", "bf16") == pytest.approx(whole / 7)
    assert flops.gpu_peak_flops("NVIDIA GB200 MIG 2g.47gb+me", "bf16") == pytest.approx(2500e12 * 2 / 7)
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3 MIG something", "bf16") is None  # not understood: no MFU
    p = flops.peak(DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3 MIG 2g.20gb"), "bf16")
    assert p.flops == pytest.approx(whole * 2 / 7) and "MIG" in p.source and "2 of 7" in p.source


def test_gpu_peak_table():
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67e12)
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.5e12)
    assert flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "fp8-rowwise") == pytest.approx(989.5e12)  # bf16 peak
    assert flops.gpu_peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert flops.gpu_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.5e12)
    assert flops.gpu_peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == pytest.approx(312e12)
    assert flops.gpu_peak_flops("NVIDIA A100 80GB PCIe", "tf32") == pytest.approx(156e12)
    assert flops.gpu_entry("NVIDIA L4")[0] == "L4"
    assert flops.gpu_entry("NVIDIA L40S")[0] == "L40S"
    assert flops.gpu_entry("NVIDIA A10G")[0] == "A10G"
    assert flops.gpu_entry("NVIDIA A10")[0] == "A10"
    assert flops.gpu_entry("NVIDIA GeForce RTX 4090")[0] == "RTX 4090"
    assert flops.gpu_entry("NVIDIA GeForce RTX 3090")[0] == "RTX 3090"
    assert flops.gpu_entry("NVIDIA GeForce RTX 3090 Ti") is None
    assert flops.gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert flops.gpu_peak_flops("Tesla V100-SXM2-16GB", "fp16") == pytest.approx(125e12)
    for _, _, peaks, source in flops.PEAK_TABLE:
        assert source and set(peaks) == {"fp32", "tf32", "bf16", "fp16", "fp8"}


def test_mfu_is_none_without_a_known_peak():
    assert flops.gpu_peak_flops("Some Future GPU 9000", "bf16") is None
    assert flops.peak_flops(cuda_dev(80, "Some Future GPU 9000"), "bf16") is None
    assert flops.mfu(1000.0, 1e9, None) is None
    assert flops.mfu(1000.0, 1e9, 0.0) is None
    assert flops.mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path))
    t = time.perf_counter()
    peak = flops.peak_flops(CPU, "fp32")
    assert time.perf_counter() - t < 2.0
    assert peak is not None and peak > 1e8
    cached = json.loads((tmp_path / "cpu_peak.json").read_text())
    (key,) = cached
    assert "test-cpu" in key and f"threads={torch.get_num_threads()}" in key and torch.__version__ in key
    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda *a, **k: pytest.fail("measured twice"))
    assert flops.peak_flops(CPU, "fp32") == peak


def test_cpu_peak_is_kept_per_number_of_processes_and_can_be_forgotten(tmp_path, monkeypatch):
    # Ranks sharing the cores measure together, so each gets its share: that figure must not
    # become the single-process peak (which would then give MFU > 1).
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path))
    rates = iter([100e9, 45e9, 90e9])
    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    assert flops.peak_flops(CPU, "fp32") == 100e9
    assert flops.peak_flops(CPU, "fp32", procs=2) == 45e9
    assert flops.peak_flops(CPU, "fp32") == 100e9  # cached, not the 2-process figure
    keys = sorted(json.loads((tmp_path / "cpu_peak.json").read_text()))
    assert [("procs=1" in k, "procs=2" in k) for k in keys] == [(True, False), (False, True)]
    assert flops.forget_cpu_peak(torch.float32, cpu_name="test-cpu") is True
    assert flops.forget_cpu_peak(torch.float32, cpu_name="test-cpu") is False  # already gone
    assert flops.peak_flops(CPU, "fp32") == 90e9  # measured again
    assert flops.peak_flops(CPU, "fp32", procs=2) == 45e9


def test_cpu_peak_cache_keeps_the_best_measurement_per_key(tmp_path, monkeypatch):
    """A measurement taken on a busy machine (lower) never replaces a better one; each is counted."""
    monkeypatch.setenv("GPTOP_CACHE", str(tmp_path))
    rates = iter([50e9, 30e9, 80e9])
    monkeypatch.setattr(flops, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    e = flops.cpu_peak_entry(cpu_name="test-cpu")
    assert (e["best"], e["n"]) == (50e9, 1)
    assert flops.cpu_peak_entry(cpu_name="test-cpu")["n"] == 1  # cached: not measured
    e = flops.cpu_peak_entry(cpu_name="test-cpu", remeasure=True)
    assert (e["best"], e["n"], e["last"]) == (50e9, 2, 30e9)  # the busy one is counted, not kept
    e = flops.cpu_peak_entry(cpu_name="test-cpu", remeasure=True)
    assert (e["best"], e["n"]) == (80e9, 3)
    (entry,) = json.loads((tmp_path / "cpu_peak.json").read_text()).values()
    assert entry == {"best": 80e9, "n": 3, "last": 80e9}
    p = flops.peak(CPU, "fp32")
    assert p.flops == 80e9 and p.measured and p.source.startswith("measured: best of 3 CPU matmul measurements")

    key = next(iter(json.loads((tmp_path / "cpu_peak.json").read_text())))
    (tmp_path / "cpu_peak.json").write_text(json.dumps({key: 42e9}))  # an older gptop's bare number
    assert flops.cpu_peak_entry(cpu_name="test-cpu") == {"best": 42e9, "n": 1, "threads": torch.get_num_threads()}


def test_peak_says_where_it_came_from():
    p = flops.peak(cuda_dev(80), "bf16")
    assert p.flops == pytest.approx(989.5e12) and not p.measured
    assert p.source.startswith("datasheet: H100 SXM bf16 (https://www.nvidia.com/")
    assert flops.peak(cuda_dev(80, "Some Future GPU 9000"), "bf16") == flops.Peak(None, None)


def test_cpu_peak_is_timed_in_busy_cpu_seconds_not_wall_seconds():
    """The same work timed while another process holds the core half the time: the wall clock runs twice
    as fast as the thread's CPU clock, and the peak is the same."""

    def clocks(wall_per_cpu):
        cpu = iter(0.001 * i for i in range(10_000))  # every matmul: 1 ms of busy CPU time
        wall = iter(0.05 * wall_per_cpu * i for i in range(10_000))  # a wall-clock tick per call
        return dict(cpu_time=lambda: next(cpu), wall=lambda: next(wall), budget_s=1.0)

    idle = flops.measure_cpu_matmul_flops(**clocks(1.0))
    busy = flops.measure_cpu_matmul_flops(**clocks(2.0))
    assert idle == pytest.approx(busy) and idle > 0
    one = flops.measure_cpu_matmul_flops(procs=2, threads=1, **clocks(1.0))
    assert flops.measure_cpu_matmul_flops(procs=1, threads=2, **clocks(1.0)) == pytest.approx(
        one * flops.usable_cores(2, 1)
    )  # per core x the cores one process may use


# --- MoE balancing -------------------------------------------------------------------------


def test_moe_balancer_evens_out_a_skewed_router():
    b = build("deepseek")
    bal = moe.MoEBalancer(b.model, update_rate=0.02)
    assert len(bal) == SIZES["tiny"].layers - 1  # every MoE layer, not the dense first one
    x, y = batch(4)
    # Skew every router: experts 0 and 1 get weights along the mean direction of the router's
    # inputs, so they score highest for almost every token.
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        router.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])))
        for i, (_, router) in enumerate(bal.routers)
    ]
    with torch.no_grad():
        b.model(input_ids=x)
        for h in hooks:
            h.remove()
        for i, (_, router) in enumerate(bal.routers):
            mean = inputs[i].mean(dim=0)
            router.weight[:2] = 2 * mean / mean.norm()
    b.model.train()

    def step() -> dict:
        b.model(input_ids=x)  # a training forward (grad enabled) is counted
        bal.update()
        return bal.summary()

    first = step()
    assert first["max_load_ratio"] > 3.5  # 4.0 would be: all tokens on 2 of 8 experts
    ratios = [step()["max_load_ratio"] for _ in range(30)]
    # sign updates oscillate around balance by about one rate step: judge the last few steps
    assert sum(ratios[-5:]) / 5 < 0.6 * first["max_load_ratio"]
    loads = bal.load()
    assert len(loads) == len(bal) and all(abs(sum(row) - 1) < 1e-6 for row in loads)
    for _, router in bal.routers:
        bias = router.e_score_correction_bias
        assert not bias.requires_grad and bias.grad_fn is None
        assert bias[:2].max() < 0 < bias[2:].max()  # the favored experts were pushed down
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in b.model.state_dict()


def test_moe_balancer_counts_training_forwards_once():
    x, y = batch(2)
    counts = []
    for ac in (False, True):
        b = build("deepseek", ac=ac)
        bal = moe.MoEBalancer(b.model)
        b.model.train()
        with torch.no_grad():  # eval forwards are not counted
            b.model(input_ids=x)
        assert all(int(c.sum()) == 0 for c in bal._counts)
        objectives.loss_fn(b, b.model, x, y).backward()  # with AC the backward recomputes the forward
        counts.append(torch.stack(bal._counts).clone())
        bal.remove()
    k = SIZES["tiny"].top_k
    assert (counts[0].sum(dim=-1) == x.numel() * k).all()
    assert torch.equal(counts[0], counts[1])


def test_moe_balancer_update_rule():
    b = build("deepseek")
    bal = moe.MoEBalancer(b.model, update_rate=0.1)
    for c in bal._counts:
        c.copy_(torch.tensor([10, 0, 2, 4, 4, 4, 4, 4]))  # mean 4: over, under, under, equal...
    bal.update()
    bias = bal.routers[0][1].e_score_correction_bias
    assert torch.allclose(bias, torch.tensor([-0.1, 0.1, 0.1, 0, 0, 0, 0, 0]))
    assert all(int(c.sum()) == 0 for c in bal._counts)
    assert bal.load()[0][0] == pytest.approx(10 / 32)
    bal._counts[0].fill_(3)
    bal.reset()  # probe forwards are discarded
    assert all(int(c.sum()) == 0 for c in bal._counts)
    assert moe.MoEBalancer(b.model).load() == []  # nothing to show before a step


def test_no_balancer_hooks_on_dense_models(tiny):
    assert len(moe.MoEBalancer(tiny["llama"].model)) == 0


# --- fp8 ------------------------------------------------------------------------------------


def test_fp8_module_filter():
    lin = torch.nn.Linear
    assert fp8.module_filter(lin(128, 256), "model.layers.0.mlp.up_proj")
    assert not fp8.module_filter(lin(128, 256), "lm_head")
    assert not fp8.module_filter(lin(128, 256), "model.lm_head")
    assert not fp8.module_filter(lin(128, 200), "model.layers.0.mlp.up_proj")  # 200 % 16 != 0
    assert not fp8.module_filter(lin(24, 128), "model.layers.0.mlp.down_proj")
    assert not fp8.module_filter(torch.nn.Embedding(64, 128), "model.embed_tokens")
    assert not fp8.module_filter(torch.nn.LayerNorm(128), "model.norm")


def test_fp8_eligible_layers_and_cpu_refusal(tiny):
    names = fp8.eligible(tiny["llama"].model)
    assert "lm_head" not in names and "model.layers.0.self_attn.q_proj" in names
    assert len(names) == 7 * SIZES["tiny"].layers  # q k v o gate up down per layer
    with pytest.raises(ConfigError, match="fp8"):
        fp8.convert(tiny["llama"].model, "fp8-tensorwise", CPU)
    with pytest.raises(ConfigError, match="CUDA"):  # the trainer's entry point: model on CPU
        fp8.convert_to_fp8(tiny["llama"].model, "tensorwise")
    with pytest.raises(ValueError):
        fp8.convert_to_fp8(tiny["llama"].model, "fp8-rowwise")
    with pytest.raises(ConfigError):  # Ampere has no fp8 tensor cores
        fp8.convert(
            tiny["llama"].model,
            "fp8-rowwise",
            dataclasses.replace(cuda_dev(80, "NVIDIA A100-SXM4-80GB"), capability=(8, 0)),
        )


# --- pretrained directories -------------------------------------------------------------------


def test_is_pretrained_path(tmp_path):
    assert not is_pretrained_path("llama")
    assert not is_pretrained_path(str(tmp_path))  # no config.json
    assert not is_pretrained_path(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    assert is_pretrained_path(str(tmp_path))


def test_fine_tune_a_local_pretrained_model(tmp_path, tiny):
    src = tiny["llama"]
    src.model.save_pretrained(tmp_path)
    assert is_pretrained_path(str(tmp_path))
    b = build_model(
        ModelConfig(model=str(tmp_path), size="auto"),
        vocab_size=VOCAB,
        seq_len=SEQ,
        toggles=Toggles(attention="eager"),
        dev=CPU,
    )
    assert (b.family, b.size, b.objective, b.mask_id) == ("pretrained", "pretrained", "causal", None)
    assert b.model.config._attn_implementation == "eager"
    assert next(b.model.parameters()).dtype == torch.float32
    assert b.total_params == src.total_params and b.vocab_size == src.vocab_size
    assert b.flops_per_token == src.flops_per_token
    for (n1, p1), (n2, p2) in zip(src.model.state_dict().items(), b.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    x, y = batch()
    assert torch.isfinite(objectives.loss_fn(b, b.model, x, y))


def test_a_saved_llada_model_fine_tunes_as_llada(tmp_path):
    src = build("llada")
    src.model.save_pretrained(tmp_path)
    b = build_model(ModelConfig(model=str(tmp_path)), vocab_size=VOCAB, seq_len=SEQ, toggles=Toggles(), dev=CPU)
    assert (b.objective, b.mask_id) == ("llada", src.mask_id)
    x, _ = batch(1)
    x2 = x.clone()
    x2[0, -1] = (x2[0, -1] + 1) % VOCAB
    with torch.no_grad():
        b.model.eval()
        assert not torch.allclose(b.model(input_ids=x).logits[0, 0], b.model(input_ids=x2).logits[0, 0])


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="--model"):
        build_model(ModelConfig(model="gpt5", size="tiny"), vocab_size=VOCAB, seq_len=SEQ, toggles=Toggles(), dev=CPU)


def test_docs_models_md_is_generated():
    """docs/models.md is `python -m trainer.models_guide` output; regenerate it when sizes change."""
    from pathlib import Path

    from trainer.models_guide import models_markdown

    path = Path(__file__).resolve().parent.parent / "docs" / "models.md"
    assert path.read_text() == models_markdown(), "run: python -m trainer.models_guide > docs/models.md"
