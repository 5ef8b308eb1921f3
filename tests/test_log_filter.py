"""What of the trainer's output the log panel shows (gptop.log_filter.LogFilter): the trainer's own lines and
tracebacks, not the tables and warnings libraries print for their developers (those stay in the log files)."""

from pathlib import Path

from gptop.log_filter import AUTOTUNE_NOTE, LogFilter

FIXTURES = Path(__file__).parent / "fixtures"

# as torch._inductor.select_algorithm writes them during a max-autotune compile, twice, with a line of the
# trainer's own between and after
AUTOTUNE = """\
AUTOTUNE bmm(16x256x64, 16x64x256)
strides: [16384, 64, 1], [16384, 256, 1]
dtypes: torch.float32, torch.float32
  bmm 0.0310 ms 100.0%
  cpp_CppMicroGemmFP32Vec_0 0.0411 ms 75.4% cpp template
SingleProcess AUTOTUNE benchmarking takes 1.2345 seconds and 0.0000 seconds precompiling for 2 choices
step 3 compiled
[rank0]:AUTOTUNE mm(256x64, 64x192)
[rank0]:strides: [64, 1], [1, 64]
[rank0]:dtypes: torch.bfloat16, torch.bfloat16
[rank0]:  triton_mm_1 0.0102 ms 100.0% ACC_TYPE='tl.float32', BLOCK_K=32
[rank0]:SubProcess AUTOTUNE benchmarking takes 3.1 seconds and 1.2 seconds precompiling for 12 choices
Traceback (most recent call last):
  File "/work/train.py", line 3, in <module>
"""

WARNINGS = """\
/venv/lib/python3.12/site-packages/torch/_inductor/lowering.py:1917: FutureWarning: `torch._prims_common.check` is deprecated
  warnings.warn(
/usr/lib/python3/dist-packages/transformers/utils/generic.py:441: DeprecationWarning: _register_pytree_node is deprecated
  _torch_pytree._register_pytree_node(
/home/me/project/model.py:12: UserWarning: my own model warns
  warnings.warn("my own model warns")
/home/me/project/model.py:20: DeprecationWarning: my own API is deprecated
    indented line of the user's own output
"""


def shown(text: str, stream: str = "stderr") -> list[tuple[str, str]]:
    f = LogFilter(stream)
    return [out for out in (f(line) for line in text.splitlines()) if out is not None]


def test_autotune_tables_become_one_line_of_gptop_per_process():
    assert shown(AUTOTUNE) == [
        (AUTOTUNE_NOTE, "gptop"),
        ("step 3 compiled", "stderr"),
        ("Traceback (most recent call last):", "stderr"),
        ('  File "/work/train.py", line 3, in <module>', "stderr"),
    ]
    assert shown(AUTOTUNE)[0] == (AUTOTUNE_NOTE, "gptop")  # a new process (a new filter) says it again


def test_library_deprecation_warnings_stay_in_the_file_the_users_own_do_not():
    lines = [line for line, _ in shown(WARNINGS)]
    assert lines == [
        "/home/me/project/model.py:12: UserWarning: my own model warns",
        '  warnings.warn("my own model warns")',
        "/home/me/project/model.py:20: DeprecationWarning: my own API is deprecated",
        "    indented line of the user's own output",
    ]


def test_kineto_chatter_and_plain_lines():
    out = shown(
        "STAGE:2024-01-22 16:37:54 3419:3419 ActivityProfilerController.cpp:314] Completed Stage: Warm Up\n"
        "  indented output of the model\nAUTOTUNE is a word too\n",
        "stdout",
    )
    assert out == [("  indented output of the model", "stdout"), ("AUTOTUNE is a word too", "stdout")]


def test_a_real_max_autotune_compile_leaves_one_line_and_the_advice():
    """stderr of two `torch.compile(mode="max-autotune-no-cudagraphs")` calls as torch 2.11 wrote it on an H100
    (2026-11-26; failed-choice tracebacks trimmed): deprecation warnings, failed choices logged glog-style, two
    autotune tables and their stats. What is left: one line that the compile autotunes, and torch's TF32 advice."""
    text = (FIXTURES / "inductor_autotune_stderr.txt").read_text()
    assert "AUTOTUNE mm(512x512, 512x512)" in text and "E1126 " in text and "TypedStorage is deprecated" in text
    out = shown(text)
    assert out.count((AUTOTUNE_NOTE, "gptop")) == 1
    rest = [line for line, stream in out if stream == "stderr"]
    assert len(rest) == 2 and "UserWarning: TensorFloat32 tensor cores" in rest[0] and rest[1] == "  warnings.warn("
