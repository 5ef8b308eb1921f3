"""Training data: text (trainer.corpus) -> tokenizer -> cached token memmap (the batches drawn from it:
trainer.batches).

Three promises the rest of gptop relies on:

* **Offline and quick.** `--data builtin` needs nothing but Python itself: the
  corpus is the standard library's own source (a few MB), and the tokenizer is a
  byte-level BPE trained on it once. Both the tokenizer and the tokens are cached
  (`$GPTOP_CACHE`, else `~/.cache/gptop`) under keys that fingerprint their
  inputs, so a second run starts in milliseconds and a changed input is never
  served stale.
* **Crash-safe cache.** Every cache file is written under a temporary name and
  renamed into place, and builders take a per-entry file lock, so N ranks
  starting together, or a run killed mid-tokenization, never leave or read a
  half-written cache.
* **What is learned does not depend on how it is computed.** The batches drawn
  from the tokens are a pure function of (seed, step): trainer.batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .contract.atomic import atomic_file, atomic_write
from .contract.config import ConfigError, DataConfig
from .contract.inputs import DATA_EXTENSIONS, TOKENIZER_FILES
from .corpus import builtin_files, corpus_files, read_builtin, read_files, stdlib_root

Log = Callable[[str], None]

FORMAT_VERSION = 1  # bump when the token file layout or the document reading changes
CACHE_ENV = "GPTOP_CACHE"
BUILTIN_VOCAB = 8192
EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)
EXTENSIONS = DATA_EXTENSIONS
MIN_TRAIN_SEQUENCES = 4  # a corpus must hold at least this many non-overlapping training sequences
PROGRESS_EVERY_S = 5.0  # tokenization logs progress at most this often

_BATCH_CHARS = 1 << 20  # text handed to one encode_batch call
_EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
_MASK_CANDIDATES = (MASK, "<|mdm_mask|>", "<mask>", "[MASK]")
_TOKENIZER_FILES = TOKENIZER_FILES


# --- the data a run trains on ---------------------------------------------------------------


@dataclass
class TokenData:
    """The tokenized corpus, split into train and held-out validation tokens (both memory-mapped)."""

    train: np.ndarray  # memmap
    val: np.ndarray  # memmap: the last `val_fraction` of the tokens
    vocab_size: int  # tokenizer's vocab size (unpadded; the model pads to a multiple of 64)
    eos_id: int
    mask_id: int | None  # <|mask|> for the builtin tokenizer; None if the tokenizer has none
    fingerprint: str  # identifies tokens + split: record it to check a resume sees the same data
    tokenizer_path: str  # tokenizer.json file or tokenizer directory, to record in the run config


@dataclass
class TokenizerInfo:
    """A loaded tokenizer and what the data pipeline needs to know about it."""

    tokenizer: Any  # tokenizers.Tokenizer or a transformers tokenizer
    path: str
    fingerprint: str
    vocab_size: int
    eos_id: int
    mask_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (EOS is added by the caller between documents)."""
        tok = self.tokenizer
        fast = _fast_backend(tok)
        if fast is not None:
            encode = getattr(fast, "encode_batch_fast", None) or fast.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return list(tok(texts, add_special_tokens=False)["input_ids"])


def default_cache_dir() -> Path:
    """`$GPTOP_CACHE` if set, else ~/.cache/gptop."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gptop"


def load_tokenizer(cfg: DataConfig, cache_dir: Path | str | None = None, log: Log = print) -> Any:
    """The tokenizer of `cfg`: `--tokenizer DIR` if given, else the builtin BPE (trained once and cached)."""
    return tokenizer_info(cfg, cache_dir, log).tokenizer


def tokenizer_info(
    cfg: DataConfig,
    cache_dir: Path | str | None = None,
    log: Log = print,
    phase: Callable[[str, float | None], None] | None = None,
) -> TokenizerInfo:
    """Like `load_tokenizer`, with the vocab size, special ids and fingerprint the cache keys need."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if cfg.tokenizer is None:
        return _builtin_tokenizer(cache, log, phase)
    return _user_tokenizer(Path(cfg.tokenizer).expanduser())


def load_data(
    cfg: DataConfig,
    *,
    cache_dir: Path | str | None = None,
    log: Log = print,
    phase: Callable[[str, float | None], None] | None = None,
) -> TokenData:
    """Tokenize `cfg.data` once (cached), memory-map the tokens and split off the validation tail.

    Raises ConfigError naming `--data`, `--tokenizer`, `--seq-len` or `--val-fraction` with what to do
    when the input cannot give a usable corpus. `phase(message, percent)` hears of the slow parts (training
    the builtin tokenizer, tokenizing), about once a second while they run.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tok = tokenizer_info(cfg, cache, log, phase)
    files, label, data_fp, docs = _source(cfg)
    key = _cache_key(data_fp, tok)
    bin_path = cache / "tokens" / f"{key}.bin"
    meta = _read_meta(bin_path)
    if meta is None:
        with _locked(bin_path, log):
            meta = _read_meta(bin_path)
            if meta is None:
                meta = _tokenize(tok, docs, sum(f.stat().st_size for f in files), bin_path, label, log, phase)
            else:
                log(f"data: using tokens {bin_path} built by another process ({meta['count']:,} tokens)")
    else:
        log(f"data: using cached tokens {bin_path} ({meta['count']:,} tokens of {label})")
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["count"],))
    return _split(tokens, cfg, tok, key, log)


def data_fingerprint(cfg: DataConfig, tok: TokenizerInfo) -> str:
    """`TokenData.fingerprint` of `load_data(cfg)` with tokenizer `tok`, without reading the text.

    A run records it in its hello event; comparing it later tells whether this environment
    still gives the tokenizer the run trained with (the builtin one is rebuilt from the stdlib)."""
    return _fingerprint(_cache_key(_source(cfg)[2], tok), cfg.val_fraction)


def _source(cfg: DataConfig) -> tuple[list[Path], str, str, Callable[[], Iterator[tuple[str, bool, int]]]]:
    """The corpus files of `cfg.data`, a label for messages, their fingerprint and a document reader."""
    if cfg.data == "builtin":
        files = builtin_files()
        root = stdlib_root()
        label = f"builtin corpus ({len(files)} Python stdlib files)"
        data_fp = _hash(["builtin", sys.version, [(f.relative_to(root).as_posix(), f.stat().st_size) for f in files]])
        return files, label, data_fp, lambda: read_builtin(files)
    files = corpus_files(cfg.data)
    label = f"{cfg.data} ({len(files)} file{'s' if len(files) != 1 else ''})"
    data_fp = _hash(["files", [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]])
    return files, label, data_fp, lambda: read_files(files)


def _cache_key(data_fp: str, tok: TokenizerInfo) -> str:
    return _hash([FORMAT_VERSION, data_fp, tok.fingerprint])[:24]


def _fingerprint(key: str, val_fraction: float) -> str:
    return _hash([key, repr(float(val_fraction))])[:16]


def _split(tokens: np.ndarray, cfg: DataConfig, tok: TokenizerInfo, key: str, log: Log) -> TokenData:
    n = len(tokens)
    n_val = int(n * cfg.val_fraction)
    n_train = n - n_val
    L = cfg.seq_len
    need = MIN_TRAIN_SEQUENCES * L + 1
    if n_train < need:
        raise ConfigError(
            "--data",
            f"corpus too small: {n:,} tokens ({n_train:,} for training), but --seq-len {L} "
            f"needs at least {need:,} training tokens ({MIN_TRAIN_SEQUENCES} sequences); "
            "give more text or lower --seq-len",
        )
    if cfg.val_fraction > 0 and n_val < L + 1:
        raise ConfigError(
            "--val-fraction",
            f"{cfg.val_fraction} of {n:,} tokens is {n_val:,} validation tokens, "
            f"less than one sequence of --seq-len {L} (+1); raise --val-fraction, give more text, "
            "or use --val-fraction 0 to train without validation",
        )
    log(f"data: {n_train:,} train / {n_val:,} validation tokens, vocab {tok.vocab_size}")
    return TokenData(
        train=tokens[:n_train],
        val=tokens[n_train:],
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        mask_id=tok.mask_id,
        fingerprint=_fingerprint(key, cfg.val_fraction),
        tokenizer_path=tok.path,
    )


# --- tokenizers ---------------------------------------------------------------------------------


def _builtin_tokenizer(
    cache: Path, log: Log, phase: Callable[[str, float | None], None] | None = None
) -> TokenizerInfo:
    """Byte-level BPE, vocab 8192, trained on the builtin corpus once and cached as tokenizer.json."""
    from tokenizers import Tokenizer

    files = builtin_files()
    root = stdlib_root()
    corpus_fp = _hash(
        [
            "bpe",
            BUILTIN_VOCAB,
            SPECIAL_TOKENS,
            sys.version,
            [(f.relative_to(root).as_posix(), f.stat().st_size) for f in files],
        ]
    )
    path = cache / "tokenizers" / f"builtin-{corpus_fp[:24]}.json"
    if not path.is_file():
        with _locked(path, log):
            if not path.is_file():
                if phase is not None:
                    phase("training the builtin tokenizer", None)
                _train_builtin(files, path, log)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ConfigError(
            "--tokenizer", f"cached builtin tokenizer {path} is unreadable ({e}); delete it and run again"
        ) from None
    return TokenizerInfo(
        tokenizer=tok,
        path=str(path),
        fingerprint=_hash(["file", path.read_bytes()]),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=tok.token_to_id(EOS),
        mask_id=tok.token_to_id(MASK),
    )


def _train_builtin(files: list[Path], path: Path, log: Log) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    size = sum(f.stat().st_size for f in files)
    log(
        f"data: training the builtin tokenizer (byte-level BPE, vocab {BUILTIN_VOCAB}) on {size / 1e6:.1f} MB "
        f"of Python stdlib source ({len(files)} files); done once, then cached"
    )
    t0 = time.monotonic()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BUILTIN_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        (f.read_text(encoding="utf-8", errors="replace") for f in files), trainer, length=len(files)
    )
    atomic_write(path, tok.to_str().encode("utf-8"))
    log(f"data: tokenizer trained in {time.monotonic() - t0:.1f} s, saved to {path}")


def _user_tokenizer(path: Path) -> TokenizerInfo:
    """A local Hugging Face tokenizer: tokenizer.json directly, else transformers' AutoTokenizer."""
    if not path.exists():
        raise ConfigError(
            "--tokenizer",
            f"{path} does not exist; give a local Hugging Face tokenizer directory "
            "(with tokenizer.json); nothing is downloaded",
        )
    directory = path if path.is_dir() else path.parent
    json_file = path if path.is_file() else path / "tokenizer.json"
    fingerprint = _hash(["dir", _tokenizer_files_fingerprint(directory, json_file)])
    settings = _special_token_settings(directory)
    if json_file.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(json_file))
        except Exception as e:
            raise ConfigError("--tokenizer", f"{json_file} is not a tokenizers file ({e})") from None
        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        eos = _find_token(tok.token_to_id, settings.get("eos_token"), _EOS_CANDIDATES)
        mask = _find_token(tok.token_to_id, settings.get("mask_token"), _MASK_CANDIDATES)
    elif path.is_dir():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise ConfigError(
                "--tokenizer",
                f"{path} has no tokenizer.json and transformers cannot load it "
                f"({type(e).__name__}: {e}); give a directory saved with save_pretrained()",
            ) from None
        vocab_size = len(tok)

        def to_id(token: str) -> int | None:
            ids = tok.convert_tokens_to_ids([token])
            return ids[0] if ids and ids[0] is not None and ids[0] != tok.unk_token_id else None

        eos = tok.eos_token_id if tok.eos_token_id is not None else _find_token(to_id, None, _EOS_CANDIDATES)
        mask = getattr(tok, "mask_token_id", None)
        if mask is None:
            mask = _find_token(to_id, None, _MASK_CANDIDATES)
    else:
        raise ConfigError("--tokenizer", f"{path} is a file but not tokenizer.json; give the tokenizer directory")
    if eos is None:
        raise ConfigError(
            "--tokenizer",
            f"{path}: no end-of-text token found (looked for eos_token in "
            f"tokenizer_config.json and {', '.join(_EOS_CANDIDATES)}); documents need one between them",
        )
    return TokenizerInfo(
        tokenizer=tok,
        path=str(path),
        fingerprint=fingerprint,
        vocab_size=int(vocab_size),
        eos_id=int(eos),
        mask_id=None if mask is None else int(mask),
    )


def _special_token_settings(directory: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            d = json.loads((directory / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key in ("eos_token", "mask_token"):
            value = d.get(key) if isinstance(d, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def _find_token(to_id: Callable[[str], int | None], preferred: str | None, candidates: Iterable[str]) -> int | None:
    for token in ([preferred] if preferred else []) + list(candidates):
        i = to_id(token)
        if i is not None:
            return i
    return None


def _tokenizer_files_fingerprint(directory: Path, json_file: Path) -> list:
    out = []
    for f in sorted(directory.iterdir()) if directory.is_dir() else []:
        if f.is_file() and (f.name in _TOKENIZER_FILES or f == json_file or f.suffix == ".tiktoken"):
            st = f.stat()
            out.append(
                [
                    f.name,
                    hashlib.sha256(f.read_bytes()).hexdigest()
                    if st.st_size < 64 << 20
                    else [st.st_size, st.st_mtime_ns],
                ]
            )
    return out


def _fast_backend(tok: Any) -> Any:
    from tokenizers import Tokenizer

    if isinstance(tok, Tokenizer):
        return tok
    return getattr(tok, "backend_tokenizer", None)


# --- tokenization into the cache ----------------------------------------------------------------


def _tokenize(
    tok: TokenizerInfo,
    docs: Callable[[], Iterator[tuple[str, bool, int]]],
    total_bytes: int,
    bin_path: Path,
    label: str,
    log: Log,
    phase: Callable[[str, float | None], None] | None = None,
) -> dict:
    """Encode all documents in batches (encode_batch uses every core) and stream the ids to the cache."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)  # ids are < vocab_size
    log(f"data: tokenizing {label}, {total_bytes / 1e6:.1f} MB; done once, then cached at {bin_path}")
    t0 = last = last_phase = time.monotonic()
    count = ndocs = done_bytes = 0
    if phase is not None:
        phase(f"tokenizing {label}", 0.0)
    with atomic_file(bin_path) as out:
        batch: list[str] = []
        ends: list[bool] = []
        chars = 0

        def flush() -> None:
            nonlocal count, ndocs
            encoded = tok.encode_batch(batch)
            seqs = [ids + [tok.eos_id] if end else ids for ids, end in zip(encoded, ends)]
            n = sum(len(s) for s in seqs)
            arr = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=n)
            if n and (arr.min() < 0 or arr.max() >= tok.vocab_size):
                raise ConfigError(
                    "--tokenizer",
                    f"{tok.path} produced token id {int(arr.max())} outside its vocabulary of {tok.vocab_size}",
                )
            arr.astype(dtype).tofile(out)
            count += n
            ndocs += sum(ends)
            batch.clear()
            ends.clear()

        for text, end, nbytes in docs():
            batch.append(text)
            ends.append(end)
            chars += len(text)
            done_bytes += nbytes
            if chars >= _BATCH_CHARS:
                flush()
                chars = 0
                now = time.monotonic()
                if phase is not None and now - last_phase >= 1.0:
                    last_phase = now
                    phase(f"tokenizing {label}", min(100.0, 100.0 * done_bytes / max(1, total_bytes)))
                if now - last >= PROGRESS_EVERY_S:
                    last = now
                    pct = min(100.0, 100.0 * done_bytes / max(1, total_bytes))
                    log(
                        f"data: tokenizing {pct:.0f}% ({done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB, "
                        f"{count / 1e6:.1f}M tokens, {done_bytes / 1e6 / (now - t0):.1f} MB/s)"
                    )
        if batch:
            flush()
        if count == 0:
            raise ConfigError("--data", f"{label}: the corpus is empty (no text found); give files with text")
    meta = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "count": count,
        "documents": ndocs,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": tok.path,
        "source": label,
    }
    atomic_write(bin_path.with_suffix(".json"), json.dumps(meta, indent=1).encode("utf-8"))
    log(f"data: {count:,} tokens from {ndocs:,} documents in {time.monotonic() - t0:.1f} s ({dtype.name}), cached")
    return meta


def _read_meta(bin_path: Path) -> dict | None:
    """The cache entry's metadata if the entry is complete (metadata written last, sizes match), else None."""
    try:
        meta = json.loads(bin_path.with_suffix(".json").read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT_VERSION:
            return None
        if bin_path.stat().st_size != meta["count"] * np.dtype(meta["dtype"]).itemsize or meta["count"] < 1:
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- atomic cache writes ------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path, log: Log) -> Iterator[None]:
    """Hold an exclusive lock for building the cache entry `path`, so concurrent runs build it once.

    An OS lock (filelock): the kernel drops it when a process dies, so a killed builder never blocks
    the next one. Under the lock, temporary files of this entry are leftovers of a killed builder and
    are removed.
    """
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.parent / f"{path.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"data: waiting for another process building {path.name}")
        lock.acquire()
    try:
        for stale in itertools.chain(
            path.parent.glob(f"{path.name}.*.tmp"), path.parent.glob(f"{path.with_suffix('.json').name}.*.tmp")
        ):
            with contextlib.suppress(OSError):
                stale.unlink()
        yield
    finally:
        lock.release()


def _hash(obj: Any) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return hashlib.sha256(o).hexdigest()
        raise TypeError(type(o))

    return hashlib.sha256(json.dumps(obj, default=default, sort_keys=True).encode("utf-8")).hexdigest()
