"""The heaviest test files of a pytest run, from its JUnit XML report: each file's summed test time and its
number of tests, heaviest first, and the run's summed test time (about 2x its wall time with 2 workers).
Per-test `--durations` shows single slow tests; this shows where a file's many small tests add up, which is
what a cut of the suite's time (issue 38) is chosen by.

    python scripts/suite_file_times.py REPORT.xml [TOP]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def file_times(report: str) -> tuple[Counter[str], Counter[str]]:
    seconds: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] or "?"  # tests.test_x (a module-level test) -> test_x
        if name[:1].isupper():  # tests.test_x.TestClass -> test_x
            name = case.get("classname", "").split(".")[-2]
        seconds[name] += float(case.get("time", 0.0))
        tests[name] += 1
    return seconds, tests


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    top = int(argv[1]) if len(argv) == 2 else 15
    seconds, tests = file_times(argv[0])
    print(f"summed test time: {sum(seconds.values()):.0f} s over {sum(tests.values())} tests; heaviest files:")
    for name, total in seconds.most_common(top):
        print(f"{total:8.1f} s {tests[name]:4d} tests  {name}.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
