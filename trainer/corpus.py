"""A corpus's documents: which files `--data` names (or the builtin corpus, the standard library's own source)
and reading them as pieces to encode, with the document ends where EOS goes."""

from __future__ import annotations

import functools
import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from .contract.config import ConfigError
from .contract.inputs import data_files

BUILTIN_BYTES_ENV = "GPTOP_BUILTIN_BYTES"  # caps the builtin corpus (tests use a small one)
BUILTIN_MAX_BYTES = 6_000_000  # ~6 MB of stdlib source: tokenizer training + tokenization take seconds
# Standard-library folders left out of the builtin corpus: installed packages (they differ between
# machines), tests (deliberately odd or badly encoded files) and generated codec tables.
BUILTIN_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
PIECE_CHARS = 1 << 16  # long documents are cut into pieces of about this size to encode in parallel


def stdlib_root() -> Path:
    """Where this Python's standard library is: the builtin corpus's root."""
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_files(max_bytes: int | None = None) -> list[Path]:
    """The builtin corpus: stdlib `*.py` sorted by relative path, taken in order while they fit `max_bytes`.

    The cap (default BUILTIN_MAX_BYTES, or $GPTOP_BUILTIN_BYTES) keeps first-time tokenizer training
    and tokenization to seconds.
    """
    if max_bytes is None:
        env = os.environ.get(BUILTIN_BYTES_ENV)
        max_bytes = int(env) if env else BUILTIN_MAX_BYTES
    root = stdlib_root()
    files, total = [], 0
    for path, size in _stdlib_sources(str(root)):
        if total + size <= max_bytes:
            files.append(Path(path))
            total += size
    if not files:
        raise ConfigError(
            "--data", f"no Python source found under {root} for the builtin corpus; give --data PATH with your own text"
        )
    return files


@functools.lru_cache(maxsize=4)
def _stdlib_sources(root: str) -> tuple[tuple[str, int], ...]:
    """Every `*.py` under `root` outside BUILTIN_SKIP_DIRS as (path, size), sorted by relative path.

    Cached: a run asks for the corpus more than once (its tokenizer's fingerprint, its data), and the
    walk stats every file of the standard library.
    """
    found: list[tuple[str, str, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in BUILTIN_SKIP_DIRS and not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                found.append((rel, path, os.stat(path).st_size))
    found.sort()
    return tuple((path, size) for _, path, size in found)


def corpus_files(spec: str) -> list[Path]:
    """The data files `--data` names; a parquet file without a text column is refused before any is read."""
    files = data_files(spec)  # which files are data: one rule, shared with gptop's input checks
    for f in files:
        if f.suffix.lower() == ".parquet":
            _parquet_text_column(f)  # fail now, not after tokenizing the files before it
    return files


# Readers yield (text, ends_document, source_bytes): documents are cut into pieces for parallel
# encoding; EOS follows the last piece of each document.


def read_builtin(files: list[Path]) -> Iterator[tuple[str, bool, int]]:
    """The builtin corpus's documents, one per file."""
    for f in files:
        yield from pieces(f.read_text(encoding="utf-8", errors="replace"), f.stat().st_size)


def read_files(files: list[Path]) -> Iterator[tuple[str, bool, int]]:
    """The documents of `--data` files, each read by its format (.txt, .jsonl, .parquet)."""
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
    for f in files:
        yield from readers[f.suffix.lower()](f)


def _read_txt(path: Path) -> Iterator[tuple[str, bool, int]]:
    """A .txt file is one document, read in pieces so a huge file never sits in memory whole."""
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        carry, any_text = "", False
        while chunk := fh.read(PIECE_CHARS):
            any_text = True
            text = carry + chunk
            cut = _cut_point(text)
            if cut == 0:
                if len(text) < 4 * PIECE_CHARS:
                    carry = text
                    continue
                cut = len(text)
            yield text[:cut], False, len(text[:cut].encode("utf-8", "replace"))
            carry = text[cut:]
        if any_text:  # an empty file is no document (no EOS for it)
            yield carry, True, len(carry.encode("utf-8", "replace"))


def _read_jsonl(path: Path) -> Iterator[tuple[str, bool, int]]:
    example = 'each line must be a JSON object like {"text": "..."}'
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise ConfigError("--data", f"{path}:{lineno}: not valid JSON ({e}); {example}") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise ConfigError("--data", f'{path}:{lineno}: no "text" field; {example}')
            text = obj["text"]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ConfigError(
                    "--data", f'{path}:{lineno}: "text" is a {type(text).__name__}, not a string; {example}'
                )
            yield from pieces(text, len(raw))


def _parquet_text_column(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise ConfigError("--data", f"{path}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise ConfigError(
            "--data",
            f"{path}: no 'text' column (columns: {', '.join(schema.names)}); "
            "rename the column holding the documents to 'text'",
        )
    kind = schema.field("text").type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or getattr(pa.types, "is_string_view", lambda t: False)(kind)
    ):
        raise ConfigError("--data", f"{path}: column 'text' has type {kind}, not string")
    return pf


def _read_parquet(path: Path) -> Iterator[tuple[str, bool, int]]:
    pf = _parquet_text_column(path)
    per_row = path.stat().st_size / max(1, pf.metadata.num_rows)
    for batch in pf.iter_batches(batch_size=1024, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text:
                yield from pieces(text, int(per_row))


def pieces(text: str, nbytes: int) -> Iterator[tuple[str, bool, int]]:
    """One document as pieces of about PIECE_CHARS, cut where BPE pre-tokenization would cut anyway."""
    if not text:
        return
    start, n = 0, len(text)
    while n - start > PIECE_CHARS:
        window = text[start : start + PIECE_CHARS]
        cut = _cut_point(window) or len(window)
        yield window[:cut], False, nbytes * cut // n
        start += cut
    yield text[start:], True, nbytes * (n - start) // n


def _cut_point(text: str) -> int:
    """Index of the last newline that follows a non-space character (cut before it), or 0.

    GPT-2 style byte-level pre-tokenizers (the builtin one) end a token there and start the whitespace
    run at the newline, so cutting a document at that point gives the same tokens as encoding it whole.
    Other tokenizers may differ at the cuts, which are rare (one per ~64K characters) and deterministic.
    """
    i = len(text)
    while (i := text.rfind("\n", 0, i)) > 0:
        if not text[i - 1].isspace():
            return i
    return 0
