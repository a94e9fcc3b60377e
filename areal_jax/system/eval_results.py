"""Held-out evaluations as files of the run directory, the one channel from the rollout side that evaluates
them to the trainer that records them, in one process or several.

Server 0 writes each evaluation into `eval/step-<version>/`: eval.json and eval.md, then `summary.json`
(its `eval/...` scalars, written atomically and last, so a summary is whole and its reports are there).
Process 0 of the trainer (`FinishedEvaluations`) picks up the summaries it has not recorded yet and writes
each into metrics.jsonl at the evaluated version's step, whenever it finishes. A resumed trainer knows what
it recorded from the metrics lines it kept, and removes the evaluations of versions after its checkpoint
(the lost part of the run trains those versions again).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from areal_jax import storage
from areal_jax.rollout.evaluation import EvalReport

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
APPLIED_DURING = "eval/versions_applied_during"
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir(directory: storage.Location, version: int) -> str:
    return storage.join(directory, f"step-{version}")


def write_evaluation(
    directory: storage.Location, report: EvalReport, version: int, *, applied_during: int, thread: str
) -> None:
    """The report of `version` into `<directory>/step-<version>/`, its summary last: the scalars, with the
    number of newer versions the generator took while it ran, and the thread that ran it."""
    target = step_dir(directory, version)
    report.write(target)
    scalars = {**report.scalars("eval"), APPLIED_DURING: float(applied_during)}
    summary = {"version": version, "scalars": scalars, "thread": thread}
    storage.write_json_atomic(storage.join(target, SUMMARY_FILE), summary)


def is_evaluated(directory: storage.Location, version: int) -> bool:
    """Whether the evaluation of `version` was finished (its summary written)."""
    return storage.exists(storage.join(step_dir(directory, version), SUMMARY_FILE))


def evaluated_versions(directory: storage.Location) -> list[int]:
    """The versions with a directory in `directory` (finished or not), in order."""
    found = (_STEP_DIR.fullmatch(name) for name in storage.names(directory))
    return sorted(int(match.group(1)) for match in found if match)


def drop_evaluations_after(directory: storage.Location, version: int) -> None:
    """Remove the evaluations of versions after `version` (a resumed run's lost future)."""
    for later in evaluated_versions(directory):
        if later > version:
            logger.warning("deleting the held-out evaluation of version %d: newer than the restored step", later)
            storage.remove_tree(step_dir(directory, later))


class FinishedEvaluations:
    """The summaries in `directory` not recorded yet (`recorded`: the versions metrics.jsonl has); owned by
    the thread that writes the metrics."""

    def __init__(self, directory: storage.Location, recorded: Iterable[int]):
        self.directory = directory
        self.recorded = set(recorded)

    def take(self) -> list[tuple[int, dict[str, float]]]:
        """(version, scalars) of each evaluation finished since the last call, in version order."""
        found = []
        for version in evaluated_versions(self.directory):
            if version in self.recorded:
                continue
            summary = storage.read_json(storage.join(step_dir(self.directory, version), SUMMARY_FILE))
            if summary is None:
                continue  # still running
            self.recorded.add(version)
            found.append((version, {key: float(value) for key, value in summary["scalars"].items()}))
        return found
