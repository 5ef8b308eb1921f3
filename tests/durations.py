"""Each test file's seconds in one run of the suite, from that run's JUnit XML, written to tests/durations.json:
tests/conftest.py hands the files that start processes to the workers longest first from it.

    python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/suite.xml
    python tests/durations.py /tmp/suite.xml

The figures only order files, so a stale file costs some balance, never a result; a file not in it counts as
the median file's time.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("durations.json")


def file_seconds(junit: Path) -> dict[str, float]:
    """{tests/test_x.py: seconds} summed over the file's test cases (setup and teardown included, as junit has)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), None)
        if module is not None:
            seconds[f"tests/{module}.py"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(seconds.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/durations.py JUNIT.xml  (pytest's --junitxml of a whole run)", file=sys.stderr)
        return 2
    seconds = file_seconds(Path(argv[0]))
    if not seconds:
        print(f"{argv[0]}: no test cases of tests/test_*.py in it", file=sys.stderr)
        return 1
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
