"""What of a trainer's (or a user's program's) output the log panel shows: its own lines, not the chatter libraries
print for their own developers. Hidden lines stay in the log files (trainer.log, trainer.stderr.log)."""

from __future__ import annotations

import re

# glog-style lines from libkineto (torch.profiler) on stderr, e.g.
# `USDT:2026-11-25 13:05:21 6702:6702 SyncActivityProfilerHandler.cpp:52] profiler_start`; torchrun may
# prefix a rank's lines with `[rank0]:`.
LIBRARY_CHATTER = re.compile(r"^(\[rank\d+\]:)?(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]")


def is_library_chatter(line: str) -> bool:
    """A line a library printed for its own developers: kept in the log file, not shown."""
    return LIBRARY_CHATTER.match(line) is not None


_RANK = r"(?:\[rank\d+\]:)?"
# torch._inductor.select_algorithm prints, per autotuned op, to stderr (tests/fixtures/inductor_autotune_stderr.txt,
# as torch 2.11 wrote it on an H100):
#   AUTOTUNE bmm(16x256x64, 16x64x256)            <- starts a table
#   strides: [...] / dtypes: ... / "  choice 0.0123 ms 100.0% ..." rows
#   SingleProcess AUTOTUNE benchmarking takes 1.2 seconds and 0.0 seconds precompiling for 20 choices  <- ends it
#   Autotune Choices Stats: / {"num_choices": ...}
# and logs each choice that fails to build (a harmless skip) glog-style, a traceback line by line:
#   E1126 16:11:07.515000 478 torch/_inductor/select_algorithm.py:3541] [0/0] Exception No valid triton configs...
AUTOTUNE_START = re.compile(_RANK + r"(?:AUTOTUNE \S+\(|Autotune Choices Stats:)")
AUTOTUNE_END = re.compile(_RANK + r"(?:SingleProcess|SubProcess) AUTOTUNE benchmarking takes ")
AUTOTUNE_ROW = re.compile(_RANK + r"(?:strides: |dtypes: |\s+\S|\{\"num_choices\")")
AUTOTUNE_LOG = re.compile(
    _RANK + r"[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/_inductor/"
    r"(?:select_algorithm|autotune_process)\.py:\d+\]"
)
# Python's warnings format: `/.../site-packages/x.py:12: FutureWarning: message`, then the source line, indented;
# a deprecation said in a UserWarning's words counts too (torch: "TypedStorage is deprecated")
LIBRARY_WARNING = re.compile(
    _RANK + r"\S*(?:site-packages|dist-packages|/lib/python3[.\d]*)/\S+:\d+: "
    r"(?:(?:DeprecationWarning|PendingDeprecationWarning|FutureWarning): |"
    r"\w*Warning: .*\bdeprecated\b)"
)
AUTOTUNE_NOTE = "torch.compile is autotuning kernels (its timing tables are in trainer.stderr.log)"


class LogFilter:
    """Which of one stream's lines the log panel shows (`__call__`: (line, stream) to show, or None): library
    chatter (`is_library_chatter`), inductor's autotune tables (the first one becomes `AUTOTUNE_NOTE`, once
    per process, as gptop's own line) and libraries' deprecation warnings with their source line stay in the
    file only."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._table = False  # inside an autotune table
        self._noted = False  # the note was shown for this process
        self._after_warning = False  # the next indented line is a hidden warning's source line

    def __call__(self, line: str) -> tuple[str, str] | None:
        after_warning, self._after_warning = self._after_warning, False
        if is_library_chatter(line):
            return None
        if AUTOTUNE_END.match(line):
            self._table = False
            return None
        start = AUTOTUNE_START.match(line) is not None
        if start or AUTOTUNE_LOG.match(line):
            self._table = start
            if self._noted:
                return None
            self._noted = True
            return AUTOTUNE_NOTE, "gptop"
        if self._table and AUTOTUNE_ROW.match(line):
            return None
        self._table = False
        if LIBRARY_WARNING.match(line):
            self._after_warning = True
            return None
        if after_warning and line[:1].isspace():
            return None
        return line, self.stream
