"""JSON-lines records of a run (metrics.jsonl, trained_groups.jsonl): read them, and cut them back to a step
when a resumed run is about to write the later steps again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a local JSON-lines file (blank lines skipped)."""
    return parse_jsonl(Path(path).read_text(encoding="utf-8"))


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def keep_upto(path: Path, step: int, key: str) -> list[dict[str, Any]]:
    """The records of `path` whose `key` is at most `step` (a record without it counts as its line number,
    from 1); later ones are removed from the file. Nothing when the file does not exist."""
    if not path.exists():
        return []
    records = read_jsonl(path)
    kept = [record for line, record in enumerate(records, 1) if int(record.get(key, line)) <= step]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
    return kept
