"""The one event schema shared by the trainer, gptop and the tuner.

Events are JSON objects, one per line. Every event has `v` (schema version),
`type`, `time` (unix seconds) and `rank`. The required fields per type are
listed in `REQUIRED`; producers may add more, consumers must ignore what they
do not know. Changing or removing a field is a schema version bump.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Iterator

SCHEMA_VERSION = 1

PHASES = ("data", "forward", "backward", "optimizer", "other")

REQUIRED: dict[str, tuple[str, ...]] = {
    "hello": ("config", "device", "model"),
    "step": ("step", "tokens", "loss", "lr", "grad_norm", "step_ms", "phases_ms", "tokens_per_s", "mfu",
             "mem_bytes"),
    "eval": ("step", "loss"),
    "checkpoint": ("step", "path", "seconds"),
    "log": ("message",),
    "warning": ("message",),
    "error": ("kind", "message"),
    "done": ("step", "tokens"),
    # Emitted by gptop, not the trainer:
    "device": ("devices",),
    "trial": ("number", "toggles", "status"),
    "apply": ("toggles",),
    "tuner": ("phase",),
    "status": ("status",),      # the session's status (starting, running, done, failed, ...)
}

ERROR_KINDS = ("oom", "nan", "config", "crash", "compile", "no_checkpoint", "corrupt_checkpoint")


class MalformedEvent(ValueError):
    pass


def make_event(type: str, rank: int = 0, **fields: Any) -> dict[str, Any]:
    event = {"v": SCHEMA_VERSION, "type": type, "time": time.time(), "rank": rank}
    event.update(fields)
    return event


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null, so every line parses everywhere."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(event: dict[str, Any]) -> str:
    return json.dumps(json_safe(event), separators=(",", ":"), allow_nan=False, default=str)


def parse(line: str | bytes) -> dict[str, Any]:
    """Parse and validate one line. Raises MalformedEvent; unknown types are allowed (newer producers)."""
    try:
        event = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedEvent(f"not JSON: {e}") from None
    if not isinstance(event, dict):
        raise MalformedEvent("not a JSON object")
    for key in ("v", "type", "time", "rank"):
        if key not in event:
            raise MalformedEvent(f"missing {key!r}")
    if not isinstance(event["v"], int) or event["v"] > SCHEMA_VERSION:
        raise MalformedEvent(f"unsupported schema version {event['v']!r}")
    missing = [k for k in REQUIRED.get(event["type"], ()) if k not in event]
    if missing:
        raise MalformedEvent(f"{event['type']} event missing {', '.join(missing)}")
    return event


def read_events(path, *, strict: bool = False) -> Iterator[dict[str, Any]]:
    """Events of a JSONL file, skipping malformed lines unless `strict`."""
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield parse(line)
            except MalformedEvent:
                if strict:
                    raise
