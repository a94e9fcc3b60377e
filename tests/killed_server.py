"""A `launch local` run with two rollout servers, one of them SIGKILLed mid-run and restarted by the launcher,
and what must hold after it: the run completes, every trained group and every log record is unique, each
server wrote only its own group ids, its two lives disjoint ones, and the staleness bound holds. The README's
own `launch local` command is the run (tests/test_readme_commands.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from areal_jax.data.rollout_log_reader import read_shard
from areal_jax.data.rollout_log_shards import list_shards
from areal_jax.jsonl import read_jsonl
from areal_jax.planning.calibration import read_calibration
from areal_jax.reporting.metric_keys import is_evaluation

VICTIM = 1  # the rollout server killed
KILL_AFTER_STEPS = 2


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "trained_groups.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_killing_a_server(
    argv: list[str], cwd: Path, env: dict[str, str], run_dir: Path
) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run `argv` (a `launch local --rollout 2` command), SIGKILL rollout server VICTIM once the trainer has
    logged KILL_AFTER_STEPS steps; (the finished launcher, the killed pid)."""
    status_file = run_dir / "control" / f"rollout-{VICTIM}.json"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        launcher = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 600
            while _steps_logged(run_dir) < KILL_AFTER_STEPS or not status_file.exists():
                assert launcher.poll() is None, "the launcher ended before the kill"
                assert time.monotonic() < deadline, "no steps logged in time"
                time.sleep(0.05)
            victim = json.loads(status_file.read_text())["pid"]
            os.kill(victim, signal.SIGKILL)
            launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, launcher.returncode, out.read(), err.read()), victim


def check_the_killed_server_run(run_dir: Path, victim: int, eta: int, groups_per_step: int, output: str) -> None:
    """What a `launch local --rollout 2` run whose server VICTIM was SIGKILLed once must show."""
    assert f"rollout{VICTIM} exited -9; restarting it" in output, output[-3000:]
    restarted = json.loads((run_dir / "control" / f"rollout-{VICTIM}.json").read_text())["pid"]
    assert restarted != victim

    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if not is_evaluation(m)]
    steps = len(metrics)
    assert [m["train/version"] for m in metrics] == list(range(1, steps + 1))
    # a group trains at most eta + 1 versions after the version it was admitted at, over any number of servers
    # and across a restart (docs/distributed.md, "The staleness bound")
    assert max(m["rollout/staleness_max"] for m in metrics) <= eta + 1
    assert metrics[-1]["weights/direct_loads"] > 0
    assert all(m["rollout/servers_reporting"] == 2 for m in metrics[KILL_AFTER_STEPS:])
    cores = len(os.sched_getaffinity(0))
    if cores >= 2:  # the roles on cores of their own: a split calibration of `areal-jax plan`
        calibration = read_calibration(run_dir)
        assert not calibration.colocated
        assert (calibration.train_units, calibration.gen_units) == (cores // 2, cores - cores // 2)
        assert calibration.gen_tokens_per_s > 0 and calibration.train_tokens_per_s > 0

    trained = [g for row in read_jsonl(run_dir / "trained_groups.jsonl") for g, _ in row["groups"]]
    assert len(trained) == steps * groups_per_step and len(set(trained)) == len(trained)  # none trained twice

    records: Counter[tuple[int, int]] = Counter()
    writers: dict[int, set[str]] = {}
    lives: set[str] = set()
    log_dir = run_dir / "rollout_log"
    for shard in list_shards(log_dir):
        entries, problems = read_shard(log_dir, shard)
        assert not problems
        for entry in entries:
            t = entry.trajectory
            records[(t.group_id, t.sample_index)] += 1
            writers.setdefault(t.group_id, set()).add(entry.writer_id.split("-")[0])
            lives.add(entry.writer_id)
    assert max(records.values()) == 1  # every record unique, the killed server's lost groups included
    assert all(writer == {f"rollout{g % 2}"} for g, writer in writers.items())  # each server its own ids
    # the restarted server goes on from where the killed one was: its two lives wrote disjoint groups
    assert len([w for w in lives if w.startswith(f"rollout{VICTIM}-")]) == 2
