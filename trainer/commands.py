"""Commands at step boundaries, one path for any number of ranks.

Commands (stop, checkpoint now, profile, log every N steps) and signals can reach the ranks at different moments, so at
every step boundary each rank contributes what it has pending to one element-wise MAX agreement of a
few integers, and every rank acts on the result: the same command takes effect on the same step
everywhere. With one rank the agreement is the identity: no collective is made.

The vector is [stop code, newest checkpoint request, newest profile request, its steps, newest log-interval
request]; a log-interval request is its number times LOG_SHIFT plus the interval, so MAX keeps the newest
request with its own interval (the tuner asks for every step while it measures, then the user's again). Requests are
numbered by the sender (the supervisor's send time in ms), so one that reaches two ranks on different
steps is acted on once; a command without a number counts on rank 0 only when it came over the socket
(every rank got the same one), and on its own rank when it came from a signal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .channel import Channel

# Stop reasons in the agreement vector (MAX wins: a rank's own reason is kept for its own log).
STOP_REQUESTED, STOP_SIGNAL, STOP_LAUNCHER_GONE, STOP_FAULT = 1, 2, 3, 4
STOP_TEXT = {
    STOP_REQUESTED: "stop requested",
    STOP_SIGNAL: "stop signal",
    STOP_LAUNCHER_GONE: "launcher went away",
    STOP_FAULT: "stop (--fault)",
}

Agree = Callable[[list[int]], list[int]]
LOG_SHIFT = 1 << 20  # log intervals above this many steps are clamped (the request number fits in int64)


@dataclass
class Decision:
    """What every rank does at this step boundary."""

    stop: str | None = None  # the reason, when the run stops here
    checkpoint: bool = False
    profile_steps: int | None = None  # profile this many steps from here
    log_every: int | None = None  # log a step event every this many steps from here


class Commands:
    def __init__(self, channel: Channel, rank: int = 0, agree: Agree | None = None):
        self.channel, self.rank = channel, rank
        self.agree: Agree = agree if agree is not None else (lambda values: values)
        self._done = {"checkpoint": 0, "profile": 0, "log_every": 0}  # request numbers already acted on

    def poll(self, stop_fault: bool = False, checkpoint_fault: bool = False) -> Decision:
        stop_code, stop_reason = (STOP_FAULT, STOP_TEXT[STOP_FAULT]) if stop_fault else (0, None)
        said = None  # the launcher's words for its stop (gptop also signals; the words say why)
        want, profile_steps, log_req = {"checkpoint": 0, "profile": 0}, 0, 0
        if checkpoint_fault:  # (trainer/faults.py) agreed like a command: every rank saves
            want["checkpoint"] = time.time_ns() // 1_000_000
        for cmd in self.channel.pending_commands():
            name, source, seq = cmd.get("cmd"), cmd.get("source", "socket"), cmd.get("seq")
            if name == "stop":
                code = {"signal": STOP_SIGNAL, "eof": STOP_LAUNCHER_GONE}.get(source, STOP_REQUESTED)
                if code > stop_code:
                    stop_code, stop_reason = code, cmd.get("reason", STOP_TEXT[code])
                if source == "socket" and isinstance(cmd.get("reason"), str):
                    said = cmd["reason"]
                continue
            if not isinstance(seq, int):
                if source == "socket" and self.rank != 0:
                    continue
                seq = time.time_ns() // 1_000_000
            if name in want:
                want[name] = max(want[name], seq)
                if name == "profile":
                    profile_steps = max(profile_steps, int(cmd.get("steps", 3)))
            elif name == "log_every" and isinstance(cmd.get("steps"), int) and cmd["steps"] >= 1:
                log_req = max(log_req, seq * LOG_SHIFT + min(cmd["steps"], LOG_SHIFT - 1))
            elif self.rank == 0:
                self.channel.emit("warning", message=f"unknown command {name!r} ignored")
        stop_code, ckpt_seq, prof_seq, prof_steps, log_req = self.agree(
            [stop_code, want["checkpoint"], want["profile"], profile_steps, log_req]
        )
        decision = Decision()
        if ckpt_seq > self._done["checkpoint"]:
            self._done["checkpoint"] = ckpt_seq
            decision.checkpoint = True
        if prof_seq > self._done["profile"]:
            self._done["profile"] = prof_seq
            decision.profile_steps = max(1, prof_steps)
        if log_req // LOG_SHIFT > self._done["log_every"]:
            self._done["log_every"] = log_req // LOG_SHIFT
            decision.log_every = log_req % LOG_SHIFT
        if stop_code:
            decision.stop = said or stop_reason or f"{STOP_TEXT.get(stop_code, 'stop')} (another rank)"
        return decision
