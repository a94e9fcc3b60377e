"""The markdown table of a device check (scripts/device_check.sh) for docs/benchmarks.md.

Reads the check's directory: `runs.tsv` (one `label<TAB>status<TAB>seconds<TAB>command` line per benchmark
run, in run order; status is an exit code, `timeout` or `skipped`) and `<label>.log` (the run's output:
`name: value unit` lines, the headline last as `ratio NAME: X.XX`). One row per run: its status, the
headline ratio, and the key absolute numbers — the rates (units ending in `/s`), or the durations in `s`
when a benchmark prints no rate, at most four. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf"
_VALUE_LINE = re.compile(rf"^([A-Za-z][\w./-]*): ({_NUMBER})(?: (.+))?$")
_RATIO_LINE = re.compile(rf"^ratio ([\w./-]+): ({_NUMBER})$")
MAX_KEY_NUMBERS = 4


@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    value: str
    unit: str


@dataclasses.dataclass(frozen=True)
class BenchmarkOutput:
    values: list[Value]
    ratios: list[tuple[str, str]]
    last_line: str

    @property
    def headline(self) -> tuple[str, str] | None:
        return self.ratios[-1] if self.ratios else None


def parse_output(text: str) -> BenchmarkOutput:
    """The `name: value unit` and `ratio NAME: X` lines of a benchmark's output, in order."""
    values, ratios = [], []
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if ratio := _RATIO_LINE.match(line):
            ratios.append((ratio[1], ratio[2]))
        elif value := _VALUE_LINE.match(line):
            values.append(Value(value[1], value[2], value[3] or ""))
    return BenchmarkOutput(values, ratios, lines[-1] if lines else "")


def key_numbers(values: list[Value]) -> list[Value]:
    """The rates, or failing those the durations in seconds; at most MAX_KEY_NUMBERS, in printed order."""
    rates = [v for v in values if v.unit.endswith("/s")]
    return (rates or [v for v in values if v.unit == "s"])[:MAX_KEY_NUMBERS]


def describe_status(status: str, seconds: str, output: BenchmarkOutput) -> str:
    if status == "0":
        return f"ok ({seconds} s)"
    if status == "timeout":
        return f"timed out after {seconds} s"
    if status == "skipped":
        return "skipped (time budget spent)"
    return f"failed (exit {status}): {output.last_line[:100]}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def build_table(check_dir: Path, device: str, date: str) -> str:
    """The markdown table of every run listed in check_dir/runs.tsv."""
    rows = [
        "| date | device | benchmark | status | headline ratio | key absolute numbers |",
        "|---|---|---|---|---|---|",
    ]
    for line in (check_dir / "runs.tsv").read_text().splitlines():
        label, status, seconds, command = line.split("\t")
        log = check_dir / f"{label}.log"
        output = parse_output(log.read_text(errors="replace") if log.exists() else "")
        headline = f"{output.headline[0]} {output.headline[1]}" if output.headline and status == "0" else "—"
        numbers = "; ".join(f"{v.name} {v.value} {v.unit}" for v in key_numbers(output.values)) or "—"
        cells = [date, device, f"`{command}`", describe_status(status, seconds, output), headline, numbers]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check_dir", type=Path, help="the directory device_check.sh wrote (runs.tsv, <label>.log)")
    parser.add_argument("--device", required=True, help="the device column, e.g. 'NVIDIA H200 x1 (gpu)'")
    parser.add_argument("--date", required=True, help="the date column, e.g. 2026-11-30")
    args = parser.parse_args()
    print(build_table(args.check_dir, args.device, args.date))


if __name__ == "__main__":
    main()
