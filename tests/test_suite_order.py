"""tests/conftest.py's order of the files under `pytest -n 2 --dist loadfile`: the solo file first, the measuring
files after part of the in-process ones, then the rest of those, then the files that start processes longest
first (tests/durations.json, tests/durations.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import conftest
import durations


class Item:
    def __init__(self, path: Path, *marks: str) -> None:
        self.path, self.marks = path, set(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def files_in_order(items: list[Item]) -> list[str]:
    return [p.name for p in dict.fromkeys(item.path for item in items)]


def test_process_files_go_longest_first_after_the_in_process_ones(tmp_path, monkeypatch):
    root = tmp_path
    f = {name: root / "tests" / f"test_{name}.py" for name in "a b c d e f g h i".split()}
    seconds = {"tests/test_b.py": 5.0, "tests/test_c.py": 60.0, "tests/test_d.py": 20.0, "tests/test_a.py": 1.0}
    (root / "durations.json").write_text(json.dumps(seconds))
    monkeypatch.setattr(conftest, "DURATIONS", root / "durations.json")
    monkeypatch.setattr(conftest, "IN_PROCESS_FIRST", 0.5)
    items = [
        Item(f["a"], "process"),
        Item(f["b"], "process"),
        Item(f["b"], "process"),
        Item(f["c"], "process"),
        Item(f["d"], "process"),
        Item(f["e"], "process"),  # not in durations.json: the median of the others (12.5 s)
        Item(f["f"]),
        Item(f["g"], "process", "measures"),
        Item(f["h"]),
        Item(f["i"], "process", "solo"),
    ]
    before = [id(item) for item in items if item.path == f["b"]]
    config = SimpleNamespace(workerinput={}, rootpath=root)
    conftest.pytest_collection_modifyitems(config, items)
    assert files_in_order(items) == [
        "test_i.py",  # solo
        "test_f.py",  # the first half of the in-process files
        "test_g.py",  # measures
        "test_h.py",  # the rest of the in-process files
        "test_c.py",  # 60 s
        "test_d.py",  # 20 s
        "test_e.py",  # unknown: 12.5 s
        "test_b.py",  # 5 s
        "test_a.py",  # 1 s
    ]
    assert [id(item) for item in items if item.path == f["b"]] == before  # a file's tests keep their order


def test_without_durations_the_process_files_keep_their_order(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "DURATIONS", tmp_path / "missing.json")
    f = [tmp_path / "tests" / f"test_{n}.py" for n in "xyz"]
    items = [Item(p, "process") for p in f]
    conftest.pytest_collection_modifyitems(SimpleNamespace(workerinput={}, rootpath=tmp_path), items)
    assert files_in_order(items) == ["test_x.py", "test_y.py", "test_z.py"]


def test_only_workers_reorder(tmp_path):
    items = [Item(tmp_path / "test_p.py", "process"), Item(tmp_path / "test_q.py", "solo")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(rootpath=tmp_path), items)  # no workerinput
    assert files_in_order(items) == ["test_p.py", "test_q.py"]


def test_durations_sums_a_junit_files_cases_per_test_file(tmp_path, monkeypatch):
    junit = tmp_path / "suite.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="one" time="1.25"/>'
        '<testcase classname="tests.test_a" name="two" time="2.5"/>'
        '<testcase classname="tests.test_b.TestGroup" name="three" time="4"/>'
        '<testcase classname="" name="collect error" time="0"/>'
        "</testsuite></testsuites>"
    )
    assert durations.file_seconds(junit) == {"tests/test_a.py": 3.8, "tests/test_b.py": 4.0}
    out = tmp_path / "durations.json"
    monkeypatch.setattr(durations, "OUT", out)
    assert durations.main([str(junit)]) == 0
    assert json.loads(out.read_text()) == {"tests/test_a.py": 3.8, "tests/test_b.py": 4.0}
    assert durations.main([]) == 2


def test_the_committed_durations_name_existing_test_files():
    known = json.loads(conftest.DURATIONS.read_text())
    root = Path(conftest.__file__).parent.parent
    assert known and all((root / name).is_file() for name in known), [n for n in known if not (root / n).is_file()]
