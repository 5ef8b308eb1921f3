"""Data pipeline: corpora, tokenizer and token cache, deterministic batches, prefetching."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import batches as B
from trainer import corpus
from trainer import data as D
from trainer import prefetch as P
from trainer.contract.config import ConfigError, DataConfig
from trainer.batches import BatchSampler, val_batches
from trainer.data import TokenData, load_data, load_tokenizer
from trainer.prefetch import CpuCopier, CudaCopier, Prefetcher

# on real time (the prefetch threads' hand-offs and the corpus read): tests/conftest.py's order
pytestmark = pytest.mark.waits


SMALL_BUILTIN = "300000"  # bytes of stdlib source: the tokenizer trains in a fraction of a second


class Logs(list):
    """A `log` callable that keeps the messages."""

    def __call__(self, msg: str) -> None:
        self.append(msg)

    def has(self, text: str) -> bool:
        return any(text in m for m in self)


@pytest.fixture(autouse=True)
def small_builtin(monkeypatch):
    monkeypatch.setenv(corpus.BUILTIN_BYTES_ENV, SMALL_BUILTIN)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache shared by the tests of this module, so the small builtin tokenizer is trained once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tok(cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(corpus.BUILTIN_BYTES_ENV, SMALL_BUILTIN)
        return D.tokenizer_info(DataConfig(), cache, log=Logs())


def encode_docs(tok, docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += tok.tokenizer.encode(d, add_special_tokens=False).ids + [tok.eos_id]
    return out


def all_tokens(td: TokenData) -> np.ndarray:
    return np.concatenate([np.asarray(td.train), np.asarray(td.val)])


DOCS = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog.\n" * (5 + i) for i in range(4)]


# --- builtin corpus and the cache -----------------------------------------------------------------


def test_builtin_trains_once_then_uses_the_cache(tmp_path):
    logs1, logs2 = Logs(), Logs()
    td = load_data(DataConfig(seq_len=32), cache_dir=tmp_path, log=logs1)
    assert logs1.has("training the builtin tokenizer") and logs1.has("tokenizing")
    bins = list((tmp_path / "tokens").glob("*.bin"))
    assert len(bins) == 1
    mtime = bins[0].stat().st_mtime_ns
    td2 = load_data(DataConfig(seq_len=32), cache_dir=tmp_path, log=logs2)
    assert logs2.has("using cached tokens")
    assert not logs2.has("training") and not logs2.has("tokenizing")
    assert bins[0].stat().st_mtime_ns == mtime
    assert td2.fingerprint == td.fingerprint
    assert np.array_equal(all_tokens(td), all_tokens(td2))

    assert isinstance(td.train, np.memmap) and isinstance(td.val, np.memmap)
    assert td.train.dtype == np.uint16
    assert td.vocab_size == 8192
    tok = load_tokenizer(DataConfig(), tmp_path, log=Logs())
    assert (td.eos_id, td.mask_id) == (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|mask|>"))
    assert tok.token_to_id("<|pad|>") is not None
    assert Path(td.tokenizer_path).is_file()
    assert 0 < int(all_tokens(td).max()) < td.vocab_size
    # The stream starts with the first file of the corpus, and documents are joined with EOS.
    first = corpus.builtin_files()[0].read_text()
    n = len(tok.encode(first).ids)
    assert tok.decode(all_tokens(td)[:n].tolist()) == first
    assert all_tokens(td)[n] == td.eos_id


def test_builtin_tokens_equal_whole_document_encoding(cache, tok):
    td = load_data(DataConfig(seq_len=32), cache_dir=cache, log=Logs())
    docs = [t for f in corpus.builtin_files() if (t := f.read_text(encoding="utf-8", errors="replace"))]
    assert all_tokens(td).tolist() == encode_docs(tok, docs)


def test_builtin_corpus_is_sorted_capped_stdlib_source():
    files = corpus.builtin_files()
    root = corpus.stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert not any(part in corpus.BUILTIN_SKIP_DIRS for r in rel for part in r.split("/"))
    assert sum(f.stat().st_size for f in files) <= int(SMALL_BUILTIN)
    everything = corpus.builtin_files(10**12)
    assert set(files) < set(everything) and [f for f in everything if f in set(files)] == files


@pytest.mark.slow
def test_real_default_builtin(tmp_path, monkeypatch):
    """The default corpus (~6 MB): tokenizer training and tokenization take seconds on 2 cores."""
    monkeypatch.delenv(corpus.BUILTIN_BYTES_ENV)
    t0 = time.monotonic()
    td = load_data(DataConfig(), cache_dir=tmp_path, log=Logs())
    assert time.monotonic() - t0 < 60
    n = len(td.train) + len(td.val)
    assert n > 1_000_000 and td.vocab_size == 8192
    assert len(td.val) == int(n * 0.01)
    logs = Logs()
    load_data(DataConfig(), cache_dir=tmp_path, log=logs)
    assert logs.has("using cached tokens")


def test_default_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path / "c"))
    assert D.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(D.CACHE_ENV)
    assert D.default_cache_dir() == Path.home() / ".cache" / "gptop"


def test_long_documents_are_cut_without_changing_tokens(tok, monkeypatch):
    monkeypatch.setattr(corpus, "PIECE_CHARS", 200)
    text = corpus.builtin_files()[0].read_text() * 3
    pieces = list(corpus.pieces(text, len(text)))
    assert len(pieces) > 10 and "".join(p for p, _, _ in pieces) == text
    assert [end for _, end, _ in pieces] == [False] * (len(pieces) - 1) + [True]
    assert sum(tok.encode_batch([p for p, _, _ in pieces]), []) == tok.encode_batch([text])[0]


# --- user files -----------------------------------------------------------------------------------


def write_jsonl(path: Path, docs: list, extra_lines: tuple[str, ...] = ()) -> None:
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")


def write_parquet(path: Path, docs: list, column: str = "text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path)


CFG = dict(seq_len=8, val_fraction=0.0)


def test_txt_file_is_one_document(tmp_path, cache, tok):
    (tmp_path / "a.txt").write_text(DOCS[0] + DOCS[1])
    td = load_data(DataConfig(data=str(tmp_path / "a.txt"), **CFG), cache_dir=cache, log=Logs())
    assert all_tokens(td).tolist() == encode_docs(tok, [DOCS[0] + DOCS[1]])
    assert td.tokenizer_path.endswith(".json")


def test_large_txt_is_read_in_pieces(tmp_path, cache, tok, monkeypatch):
    monkeypatch.setattr(corpus, "PIECE_CHARS", 100)
    monkeypatch.setattr(D, "_BATCH_CHARS", 300)
    text = "".join(DOCS) * 3
    (tmp_path / "big.txt").write_text(text)
    td = load_data(DataConfig(data=str(tmp_path / "big.txt"), **CFG), cache_dir=cache, log=Logs())
    assert all_tokens(td).tolist() == encode_docs(tok, [text])


def test_jsonl_documents(tmp_path, cache, tok):
    write_jsonl(tmp_path / "d.jsonl", DOCS, extra_lines=("", json.dumps({"text": None})))
    td = load_data(DataConfig(data=str(tmp_path / "d.jsonl"), **CFG), cache_dir=cache, log=Logs())
    assert all_tokens(td).tolist() == encode_docs(tok, DOCS)


def test_parquet_documents(tmp_path, cache, tok):
    write_parquet(tmp_path / "d.parquet", DOCS + [None, ""])
    td = load_data(DataConfig(data=str(tmp_path / "d.parquet"), **CFG), cache_dir=cache, log=Logs())
    assert all_tokens(td).tolist() == encode_docs(tok, DOCS)


def test_folder_is_read_recursively_in_sorted_order(tmp_path, cache, tok):
    root = tmp_path / "corpus"
    (root / "b" / "c").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "z.txt").write_text(DOCS[3])
    (root / "a.jsonl").write_text(json.dumps({"text": DOCS[0]}) + "\n")
    write_parquet(root / "b" / "c" / "x.parquet", [DOCS[2]])
    (root / "b" / "a.txt").write_text(DOCS[1])
    (root / "README.md").write_text("not data")
    (root / ".hidden" / "skip.txt").write_text("not data")
    (root / "b" / "empty.txt").write_text("")
    td = load_data(DataConfig(data=str(root), **CFG), cache_dir=cache, log=Logs())
    # a.jsonl, b/a.txt, b/c/x.parquet, b/empty.txt (no document), z.txt
    assert all_tokens(td).tolist() == encode_docs(tok, [DOCS[0], DOCS[1], DOCS[2], DOCS[3]])


def test_changed_file_is_retokenized(tmp_path, cache, tok):
    f = tmp_path / "a.txt"
    f.write_text(DOCS[0])
    load_data(DataConfig(data=str(f), **CFG), cache_dir=cache, log=Logs())
    f.write_text(DOCS[0] + DOCS[1])
    logs = Logs()
    td = load_data(DataConfig(data=str(f), **CFG), cache_dir=cache, log=logs)
    assert logs.has("tokenizing")
    assert all_tokens(td).tolist() == encode_docs(tok, [DOCS[0] + DOCS[1]])


def test_progress_is_logged(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(D, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(D, "_BATCH_CHARS", 200)
    write_jsonl(tmp_path / "d.jsonl", DOCS * 5)
    logs = Logs()
    load_data(DataConfig(data=str(tmp_path / "d.jsonl"), **CFG), cache_dir=cache, log=logs)
    assert sum("%" in m for m in logs) >= 3


# --- tokenizers -----------------------------------------------------------------------------------


def test_tokenizer_directory_with_tokenizer_json(tmp_path, cache, tok):
    d = tmp_path / "tok"
    d.mkdir()
    tok.tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    (tmp_path / "a.txt").write_text(DOCS[0])
    td = load_data(DataConfig(data=str(tmp_path / "a.txt"), tokenizer=str(d), **CFG), cache_dir=cache, log=Logs())
    assert td.tokenizer_path == str(d)
    assert (td.vocab_size, td.eos_id, td.mask_id) == (8192, tok.eos_id, tok.mask_id)
    assert all_tokens(td).tolist() == encode_docs(tok, [DOCS[0]])


def test_tokenizer_directory_loaded_with_transformers(tmp_path, cache, tok):
    d = tmp_path / "tok"
    d.mkdir()
    tok.tokenizer.model.save(str(d))  # vocab.json + merges.txt, no tokenizer.json
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
    )
    info = D.tokenizer_info(DataConfig(tokenizer=str(d)))
    assert not type(info.tokenizer).__module__.startswith("tokenizers")
    assert info.eos_id == tok.eos_id and info.vocab_size == 8192
    assert info.encode_batch(DOCS) == tok.encode_batch(DOCS)


def test_large_vocabulary_is_stored_as_uint32(tmp_path, cache):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    vocab = {w: i for i, w in enumerate(words)}
    vocab["[UNK]"] = 70_000
    vocab["</s>"] = 70_001
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = tmp_path / "tok"
    d.mkdir()
    t.save(str(d / "tokenizer.json"))
    ids = [69_999, 5, 65_536, 123, 40_000] * 10
    (tmp_path / "a.txt").write_text(" ".join(words[i] for i in ids))
    td = load_data(DataConfig(data=str(tmp_path / "a.txt"), tokenizer=str(d), **CFG), cache_dir=cache, log=Logs())
    assert td.train.dtype == np.uint32
    assert (td.vocab_size, td.eos_id, td.mask_id) == (70_002, 70_001, None)
    assert all_tokens(td).tolist() == ids + [70_001]


# --- clear errors ---------------------------------------------------------------------------------


def _expect(option: str, *words: str):
    def check(err: ConfigError) -> None:
        assert err.option == option, err
        for w in words:
            assert w in str(err), (w, str(err))

    return check


def _setup_error_case(case: str, tmp: Path) -> tuple[DataConfig, object]:
    if case == "missing":
        return DataConfig(data=str(tmp / "nope.txt")), _expect("--data", "does not exist")
    if case == "extension":
        (tmp / "a.csv").write_text("x")
        return DataConfig(data=str(tmp / "a.csv")), _expect("--data", "unsupported", ".csv", ".jsonl")
    if case == "empty-folder":
        (tmp / "d").mkdir()
        (tmp / "d" / "notes.md").write_text("x")
        return DataConfig(data=str(tmp / "d")), _expect("--data", "no .txt")
    if case == "empty-corpus":
        (tmp / "a.txt").write_text("")
        return DataConfig(data=str(tmp / "a.txt")), _expect("--data", "empty")
    if case == "jsonl-no-text":
        (tmp / "a.jsonl").write_text('{"text": "hello"}\n{"body": "x"}\n')
        return DataConfig(data=str(tmp / "a.jsonl")), _expect("--data", "a.jsonl:2", '"text"')
    if case == "jsonl-bad-json":
        (tmp / "a.jsonl").write_text('{"text": "hello"}\n\n{"text": oops}\n')
        return DataConfig(data=str(tmp / "a.jsonl")), _expect("--data", "a.jsonl:3", "not valid JSON")
    if case == "jsonl-text-not-string":
        (tmp / "a.jsonl").write_text('{"text": 5}\n')
        return DataConfig(data=str(tmp / "a.jsonl")), _expect("--data", "a.jsonl:1", "not a string")
    if case == "parquet-no-text":
        write_parquet(tmp / "a.parquet", DOCS, column="content")
        return DataConfig(data=str(tmp / "a.parquet")), _expect("--data", "no 'text' column", "content")
    if case == "parquet-bad-file":
        (tmp / "a.parquet").write_text("not parquet")
        return DataConfig(data=str(tmp / "a.parquet")), _expect("--data", "not a readable parquet")
    if case == "too-small":
        (tmp / "a.txt").write_text("tiny text")
        return DataConfig(data=str(tmp / "a.txt"), seq_len=64), _expect("--data", "too small", "--seq-len 64")
    if case == "val-too-small":
        (tmp / "a.txt").write_text("".join(DOCS))
        return (
            DataConfig(data=str(tmp / "a.txt"), seq_len=16, val_fraction=0.01),
            _expect("--val-fraction", "validation tokens"),
        )
    if case == "tokenizer-missing":
        return (
            DataConfig(tokenizer=str(tmp / "nope")),
            _expect("--tokenizer", "does not exist", "nothing is downloaded"),
        )
    if case == "tokenizer-bad-json":
        (tmp / "t").mkdir()
        (tmp / "t" / "tokenizer.json").write_text("{broken")
        return DataConfig(tokenizer=str(tmp / "t")), _expect("--tokenizer", "tokenizer.json")
    if case == "tokenizer-empty-dir":
        (tmp / "t").mkdir()
        return DataConfig(tokenizer=str(tmp / "t")), _expect("--tokenizer", "transformers cannot load it")
    raise AssertionError(case)


ERROR_CASES = [
    "missing",
    "extension",
    "empty-folder",
    "empty-corpus",
    "jsonl-no-text",
    "jsonl-bad-json",
    "jsonl-text-not-string",
    "parquet-no-text",
    "parquet-bad-file",
    "too-small",
    "val-too-small",
    "tokenizer-missing",
    "tokenizer-bad-json",
    "tokenizer-empty-dir",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_clear_errors(case, tmp_path, cache, tok):
    cfg, check = _setup_error_case(case, tmp_path)
    with pytest.raises(ConfigError) as e:
        load_data(cfg, cache_dir=cache, log=Logs())
    check(e.value)


def test_tokenizer_without_eos_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    d = tmp_path / "t"
    d.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    with pytest.raises(ConfigError, match="no end-of-text token"):
        D.tokenizer_info(DataConfig(tokenizer=str(d)))


# --- atomic cache -----------------------------------------------------------------------------------


def _entry(cache: Path, cfg: DataConfig) -> tuple[Path, Path]:
    load_data(cfg, cache_dir=cache, log=Logs())
    bins = sorted((cache / "tokens").glob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
    return bins[-1], bins[-1].with_suffix(".json")


def test_killed_tokenization_leaves_no_cache_entry(tmp_path, cache, tok, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    cfg = DataConfig(data=str(tmp_path / "d.jsonl"), **CFG)
    own = tmp_path / "cache"
    own.mkdir()
    (own / "tokenizers").mkdir()
    for f in (cache / "tokenizers").glob("*.json"):
        (own / "tokenizers" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(D, "_BATCH_CHARS", 200)
    calls = {"n": 0}
    real = D.TokenizerInfo.encode_batch

    def dies_midway(self, texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, texts)

    monkeypatch.setattr(D.TokenizerInfo, "encode_batch", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        load_data(cfg, cache_dir=own, log=Logs())
    leftovers = [p.name for p in (own / "tokens").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []
    monkeypatch.setattr(D.TokenizerInfo, "encode_batch", real)
    td = load_data(cfg, cache_dir=own, log=Logs())
    assert all_tokens(td).tolist() == encode_docs(tok, DOCS * 4)


@pytest.mark.parametrize("damage", ["truncated-bin", "no-meta", "bad-meta"])
def test_incomplete_cache_entry_is_rebuilt(damage, tmp_path, cache, tok):
    (tmp_path / "a.txt").write_text(DOCS[2])
    cfg = DataConfig(data=str(tmp_path / "a.txt"), **CFG)
    bin_path, meta_path = _entry(cache, cfg)
    if damage == "truncated-bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    elif damage == "no-meta":
        meta_path.unlink()
    else:
        meta_path.write_text("{half")
    stale = bin_path.parent / f"{bin_path.name}.abc123.tmp"
    stale.write_bytes(b"left by a killed run")
    logs = Logs()
    td = load_data(cfg, cache_dir=cache, log=logs)
    assert logs.has("tokenizing")
    assert all_tokens(td).tolist() == encode_docs(tok, [DOCS[2]])
    assert not stale.exists()


def test_concurrent_loads_build_the_cache_once(tmp_path):
    """Ranks starting together: one builds (tokenizer and tokens), the others wait and reuse it."""
    write_jsonl(tmp_path / "d.jsonl", DOCS * 20)
    cfg = DataConfig(data=str(tmp_path / "d.jsonl"), **CFG)
    logs = Logs()
    results: list = [None] * 4
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = load_data(cfg, cache_dir=tmp_path / "cache", log=logs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    assert sum("training the builtin tokenizer" in m for m in logs) == 1
    assert sum(m.startswith("data: tokenizing") for m in logs) == 1
    for r in results[1:]:
        assert np.array_equal(all_tokens(r), all_tokens(results[0])) and r.fingerprint == results[0].fingerprint


# --- batches ------------------------------------------------------------------------------------------

TOKENS = np.arange(10_000, dtype=np.uint32)  # token value == position: x[:, 0] are the offsets


def test_batches_are_a_function_of_seed_and_batch_index():
    a = BatchSampler(TOKENS, 16, 8, seed=7)
    b = BatchSampler(TOKENS, 16, 8, seed=7)
    for i in (5, 0, 3, 5):  # any order of calls
        xa, ya = a.micro_batch(i, 1, 4)
        xb, yb = b.micro_batch(i, 1, 4)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not np.array_equal(a.offsets(0), a.offsets(1))
    assert not np.array_equal(a.offsets(0), BatchSampler(TOKENS, 16, 8, seed=8).offsets(0))


def test_batch_offsets_are_stable_across_versions():
    """Golden values: changing them breaks exact resume of existing runs (change FORMAT only on purpose)."""
    s = BatchSampler(TOKENS, 16, 8, seed=1234)
    assert s.offsets(0).tolist() == GOLDEN_0
    assert s.offsets(41).tolist() == GOLDEN_41
    assert BatchSampler(TOKENS, 16, 4, seed=-1).offsets(2).tolist() == GOLDEN_NEG


GOLDEN_0 = [3393, 3320, 4765, 8033, 6210, 930, 6804, 8613]
GOLDEN_41 = [2667, 8129, 1263, 8638, 3427, 8725, 6238, 3626]
GOLDEN_NEG = [7079, 844, 1637, 1983]


def test_batch_offsets_match_the_documented_hash():
    """A plain-Python splitmix64 reference of BatchSampler.offsets, the spec other code can port."""
    MASK = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
        return x ^ (x >> 31)

    def offsets(seed, b, count, n_starts):
        key = mix(mix((seed % (1 << 64)) ^ B._TRAIN_STREAM) ^ b)
        return [mix((key + i * 0x9E3779B97F4A7C15) & MASK) % n_starts for i in range(1, count + 1)]

    assert offsets(1234, 0, 8, len(TOKENS) - 16) == GOLDEN_0
    assert offsets(1234, 41, 8, len(TOKENS) - 16) == GOLDEN_41
    assert offsets(-1, 2, 4, len(TOKENS) - 16) == GOLDEN_NEG


def test_x_and_y_are_shifted_windows():
    s = BatchSampler(TOKENS, 16, 8, seed=1)
    x, y = s.micro_batch(3, 0, 8)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    offs = s.offsets(3)
    for row, o in enumerate(offs):
        assert x[row].tolist() == list(range(o, o + 16))
        assert y[row].tolist() == list(range(o + 1, o + 17))
    assert x.is_contiguous() and y.is_contiguous()


def test_offsets_cover_the_range_and_stay_in_bounds():
    tokens = np.arange(50, dtype=np.uint16)
    s = BatchSampler(tokens, 10, 64, seed=3)
    offs = np.concatenate([s.offsets(b) for b in range(50)])
    assert offs.min() == 0 and offs.max() == len(tokens) - 10 - 1
    x, y = s.micro_batch(0, 0, 64)
    assert int(y.max()) <= 49


def test_micro_batch_size_never_changes_a_step():
    s = BatchSampler(TOKENS, 16, 8, seed=11)
    for step in (0, 9):
        ref_x, ref_y = s.micro_batch(step, 0, 8)
        for m in (1, 2, 4):
            parts = [s.micro_batch(step, k, m) for k in range(s.accumulation_steps(m))]
            assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)


def test_ranks_take_disjoint_contiguous_shares_of_the_global_batch():
    G, W = 16, 4
    whole = BatchSampler(TOKENS, 16, G, seed=5)
    ranks = [BatchSampler(TOKENS, 16, G, seed=5, rank=r, world_size=W) for r in range(W)]
    for step in (0, 1, 7):
        xs = []
        for r in ranks:
            assert r.accumulation_steps(2) == 2
            xs += [r.micro_batch(step, k, 2)[0] for k in range(2)]
        assert torch.equal(torch.cat(xs), whole.micro_batch(step, 0, G)[0])
        shares = [r.local_offsets(step).tolist() for r in ranks]
        assert sum(shares, []) == whole.offsets(step).tolist()


def test_indivisible_micro_batch_names_the_numbers():
    s = BatchSampler(TOKENS, 16, 24, seed=0, rank=1, world_size=2)
    with pytest.raises(ConfigError) as e:
        s.accumulation_steps(5)
    assert e.value.option == "--micro-batch"
    assert all(w in e.value.message for w in ("24", "2", "5", "10", "12"))
    with pytest.raises(ConfigError) as e:
        BatchSampler(TOKENS, 16, 9, seed=0, world_size=2)
    assert e.value.option == "--global-batch"
    with pytest.raises(IndexError):
        s.micro_batch(0, 3, 4)


# --- validation split -----------------------------------------------------------------------------------


def test_val_split_is_the_tail_and_disjoint(cache):
    cfg = DataConfig(seq_len=32, val_fraction=0.05)
    td = load_data(cfg, cache_dir=cache, log=Logs())
    size = 2 * (len(td.train) + len(td.val))
    bin_path = next(p for p in (cache / "tokens").glob("*.bin") if p.stat().st_size == size)
    full = np.fromfile(bin_path, dtype=np.uint16)
    assert len(td.val) == int(len(full) * 0.05)
    assert np.array_equal(td.train, full[: len(td.train)]) and np.array_equal(td.val, full[len(td.train) :])
    assert not np.shares_memory(np.asarray(td.train), np.asarray(td.val))
    assert td.fingerprint != load_data(DataConfig(seq_len=32), cache_dir=cache, log=Logs()).fingerprint


def synthetic(n_train: int = 1000, n_val: int = 500) -> TokenData:
    tokens = np.arange(n_train + n_val, dtype=np.uint16)
    return TokenData(
        train=tokens[:n_train],
        val=tokens[n_train:],
        vocab_size=n_train + n_val,
        eos_id=0,
        mask_id=None,
        fingerprint="x",
        tokenizer_path="x",
    )


def test_val_batches_are_fixed_and_inside_the_val_split():
    td = synthetic()
    a = val_batches(td, 16, 4, 3, seed=1)
    b = val_batches(td, 16, 4, 3, seed=1)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == ya.shape == (4, 16) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert int(xa.min()) >= 1000 and int(ya.max()) < 1500
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    starts = torch.cat([x[:, 0] for x, _ in a]).tolist()
    assert len(set(starts)) == 12 and all((s - 1000) % 16 == 0 for s in starts)  # non-overlapping windows
    assert starts != torch.cat([x[:, 0] for x, _ in val_batches(td, 16, 4, 3, seed=2)]).tolist()


def test_val_batches_small_or_empty_split():
    assert val_batches(synthetic(n_val=0), 16, 4, 3, seed=1) == []
    few = val_batches(synthetic(n_val=40), 16, 2, 3, seed=1)  # 2 windows, 6 sequences: repeats
    assert len(few) == 3 and {int(v) for x, _ in few for v in x[:, 0]} == {1000, 1016}


# --- prefetcher -----------------------------------------------------------------------------------------


def expected(sampler: BatchSampler, start: int, m: int, n: int) -> list:
    out = []
    b = start
    while len(out) < n:
        for k in range(sampler.accumulation_steps(m)):
            out.append((b, k, *sampler.micro_batch(b, k, m)))
        b += 1
    return out[:n]


@pytest.mark.parametrize("depth,workers", [(0, 0), (2, 0), (2, 2), (1, 3)])
def test_prefetcher_delivers_the_samplers_batches_in_order(depth, workers):
    s = BatchSampler(TOKENS, 16, 8, seed=2)
    with Prefetcher(s, 2, 3, torch.device("cpu"), depth=depth, workers=workers) as p:
        got = [p.get() for _ in range(14)]
    for (b, k, x, y), (eb, ek, ex, ey) in zip(got, expected(s, 3, 2, 14)):
        assert (b, k) == (eb, ek)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert [g[:2] for g in got[:5]] == [(3, 0), (3, 1), (3, 2), (3, 3), (4, 0)]


def test_prefetcher_close_is_prompt_and_idempotent():
    s = BatchSampler(TOKENS, 16, 8, seed=2)
    for workers in (0, 2):
        p = Prefetcher(s, 1, 0, "cpu", depth=1, workers=workers)
        time.sleep(0.2)  # the queue is full and the producer blocks on it
        assert p._queue.qsize() == 1 * p.accum == 8  # depth counts optimizer steps
        t0 = time.monotonic()
        p.close()
        p.close()
        assert time.monotonic() - t0 < 2.0  # prompt (not the producer's blocking put), slack for CI
        assert not p._thread.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            p.get()


def test_prefetcher_raises_the_producers_error():
    class Broken(BatchSampler):
        def micro_batch(self, batch_index, micro_index, micro_batch):
            if batch_index == 2:
                raise ValueError("bad batch 2")
            return super().micro_batch(batch_index, micro_index, micro_batch)

    for depth, workers in ((0, 0), (2, 0), (2, 2)):
        p = Prefetcher(Broken(TOKENS, 16, 4, seed=2), 2, 1, "cpu", depth=depth, workers=workers)
        assert [p.get()[:2] for _ in range(2)] == [(1, 0), (1, 1)]
        with pytest.raises(ValueError, match="bad batch 2"):
            p.get()
        p.close()


def test_prefetcher_validates_its_arguments():
    s = BatchSampler(TOKENS, 16, 8, seed=2)
    with pytest.raises(ConfigError) as e:
        Prefetcher(s, 3, 0, "cpu", depth=1)
    assert e.value.option == "--micro-batch"
    with pytest.raises(ConfigError):
        Prefetcher(s, 2, 0, "cpu", depth=-1)


def test_copier_is_chosen_from_the_device():
    assert isinstance(P.choose_copier("cpu"), CpuCopier)


class FakeCuda:
    """Stands in for CudaOps: records the order of the CUDA calls CudaCopier makes."""

    def __init__(self):
        self.log: list = []
        self.current = "compute"
        self.devices = threading.local()  # each thread's current device: 0 until set_device
        self.used: list = []  # (call, thread, device it ran on)
        fake = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_event(self, event):
                fake.log.append(("wait_event", self.name, event.id))

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.id = Event.count
                self.recorded_on = None

            def record(self, stream):
                self.recorded_on = stream.name
                fake.log.append(("record_event", stream.name, self.id))

        self.Stream, self.Event = Stream, Event
        self.compute = Stream("compute")

    def on(self, call):
        self.used.append((call, threading.current_thread().name, getattr(self.devices, "index", 0)))

    def set_device(self, device):
        self.devices.index = torch.device(device).index or 0

    def new_stream(self):
        return self.Stream("side")

    def pin(self, t):
        self.on("pin")
        self.log.append(("pin", self.current))
        return t.clone()

    def use_stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.on("stream")
            before, self.current = self.current, stream.name
            self.log.append(("enter", stream.name))
            yield
            self.log.append(("exit", stream.name))
            self.current = before

        return ctx()

    def copy(self, t):
        self.on("copy")
        self.log.append(("copy", self.current))
        return t.clone()

    def new_event(self):
        self.on("event")
        return self.Event()

    def current_stream(self):
        return self.compute

    def record_stream(self, t, stream):
        self.log.append(("record_stream", stream.name))


def test_cuda_copier_pins_copies_on_side_stream_then_orders_the_consumer():
    fake = FakeCuda()
    c = CudaCopier(torch.device("cuda"), ops=fake)
    x, y = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    prepared = c.prepare(x, y)
    assert fake.log == [
        ("pin", "compute"),
        ("pin", "compute"),
        ("enter", "side"),
        ("copy", "side"),
        ("copy", "side"),
        ("record_event", "side", prepared.done.id),
        ("exit", "side"),
    ]
    fake.log.clear()
    xd, yd = c.finish(prepared)
    assert fake.log == [
        ("wait_event", "compute", prepared.done.id),
        ("record_stream", "compute"),
        ("record_stream", "compute"),
    ]
    assert torch.equal(xd, x) and torch.equal(yd, y)


def test_prefetcher_with_cuda_copier_finishes_each_batch_in_the_consumer():
    fake = FakeCuda()
    s = BatchSampler(TOKENS, 16, 4, seed=9)
    copier = CudaCopier("cuda", ops=fake)
    with Prefetcher(s, 2, 0, torch.device("cuda"), depth=2, workers=2, copier=copier) as p:
        got = [p.get() for _ in range(6)]
        waits = [e for e in fake.log if e[0] == "wait_event"]
    assert len(waits) == 6 and len({w[2] for w in waits}) == 6  # one event per micro-batch, each waited on
    for (b, k, x, y), (eb, ek, ex, ey) in zip(got, expected(s, 0, 2, 6)):
        assert (b, k) == (eb, ek) and torch.equal(x, ex) and torch.equal(y, ey)


@pytest.mark.parametrize("depth, workers", [(0, 0), (2, 0), (2, 2)])
def test_producer_threads_use_the_runs_gpu_not_gpu_0(depth, workers):
    """A new thread's current CUDA device is 0: the prefetch thread and the workers set the run's device
    before they pin, enter the copy stream or make an event, or every rank >= 1 and every --device cuda:N
    would create a CUDA context (about 0.5 GiB) on GPU 0."""
    fake = FakeCuda()
    fake.set_device("cuda:3")  # the training thread's device (trainer.train sets it)
    s = BatchSampler(TOKENS, 16, 4, seed=9)
    with Prefetcher(
        s, 2, 0, torch.device("cuda:3"), depth=depth, workers=workers, copier=CudaCopier("cuda:3", ops=fake)
    ) as p:
        for _ in range(6):
            p.get()
    threads = {t for _, t, _ in fake.used}
    assert fake.used and all(d == 3 for _, _, d in fake.used), [u for u in fake.used if u[2] != 3]
    assert (threads == {"MainThread"}) == (depth == 0)  # with depth > 0 only producer threads copy
