"""An agent in another process trains the policy, as a user would run it: `areal-jax train` with
`rollout.workflow.kind: external` on the arithmetic job, then `examples/outside_agent/agent.py` started by itself
against the proxy's port (two episodes at once, its own rewards). The agent is SIGKILLed mid-episode and started
again: the run goes on, the groups the dead agent held are released after `agent.episode_timeout_s` and handed
out again under their own ids. Then the run itself is SIGKILLed and resumed while the agent goes on: the tasks
that were out and not written are handed out again. Every group trains exactly once, under the prompt an
uninterrupted run gives its id, with the reward its client posted."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from areal_jax.config import load_experiment
from areal_jax.data.rollout_log_reader import logged_groups, read_shard
from areal_jax.data.rollout_log_shards import list_shards
from areal_jax.jsonl import read_jsonl
from areal_jax.trainer.checkpoint import TrainCheckpointer
from tests.prompt_order import uninterrupted_prompts
from tests.short_runs import NO_EVAL, SHORT_TRAIN_CPU
from tests.xla_flags import xla_flags

PROMPTS = 20
BATCH = 2
TIMEOUT_S = 3  # agent.episode_timeout_s: how long the run waits for the killed agent's episodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_args(port: int) -> list[str]:
    return [
        "configs/train_cpu.yaml",
        "train_steps=100",  # more than the data: the run ends when the single epoch is used up
        "dataset.epochs=1",
        f"dataset.arithmetic_problems={PROMPTS}",
        f"rollout.staleness.batch_prompts={BATCH}",
        "rollout.staleness.max_head_offpolicyness=1",
        "rollout.workflow.kind=external",
        "rollout.workflow.n_samples=2",
        f"rollout.workflow.agent.port={port}",
        f"rollout.workflow.agent.episode_timeout_s={TIMEOUT_S}",
        "train_checkpoint.every_steps=2",
        *SHORT_TRAIN_CPU,
        *NO_EVAL,
    ]


def _start(command: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as sink:  # a file: a pipe nobody reads fills up and blocks
        env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _agent(port: int, events: Path, output: Path) -> subprocess.Popen:
    command = [sys.executable, "examples/outside_agent/agent.py", f"--url=http://127.0.0.1:{port}"]
    command += ["--concurrency=2", "--work-s=0.4", "--give-up-s=600", f"--log={events}"]  # the test ends it
    return _start(command, output)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, process: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress: " + log.read_text()[-3000:]
        time.sleep(0.05)


def _steps(run_dir: Path) -> int:
    path = run_dir / "trained_groups.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _in_flight(events: list[dict]) -> set[tuple[int, int, str]]:
    """(group, sample, session) of the episodes claimed and not ended."""
    claimed = {(e["group_id"], e["sample_index"], e["session_id"]) for e in events if e["event"] == "claimed"}
    closed = {(e["group_id"], e["sample_index"], e["session_id"]) for e in events if e["event"] != "claimed"}
    return claimed - closed


def _ended_groups(events: list[dict]) -> set[int]:
    """The groups whose both episodes (n_samples 2) an agent ended."""
    ended = {(e["group_id"], e["sample_index"]) for e in events if e["event"] == "ended"}
    return {g for g, i in ended if i == 0 and (g, 1) in ended}


def test_an_outside_agent_trains_the_run_and_killed_episodes_and_a_crashed_run_hand_their_tasks_out_again(tmp_path):
    port = _free_port()
    args = _run_args(port)
    train_log = tmp_path / "train-output.log"
    command = [sys.executable, "-m", "areal_jax.cli", "train", *args, f"output_dir={tmp_path}"]
    train = _start(command, train_log)
    run_dir = tmp_path / "async-arithmetic"
    first_events, second_events = tmp_path / "agent-1.jsonl", tmp_path / "agent-2.jsonl"
    agent = _agent(port, first_events, tmp_path / "agent-1.log")
    processes = [train, agent]
    try:
        # 1. the run trains on the outside agent's episodes; the agent is killed with two episodes in flight
        _wait(lambda: _steps(run_dir) >= 1, train, train_log)
        _wait(lambda: len(_in_flight(_events(first_events))) == 2, train, train_log)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        lost = {group for group, _, _ in _in_flight(_events(first_events))}
        processes.append(agent := _agent(port, second_events, tmp_path / "agent-2.log"))
        _wait(lambda: lost <= _ended_groups(_events(second_events)), train, train_log)  # released, run again
        # 2. the run itself is killed after a checkpoint, with the new agent's episodes in flight, and resumed
        steps, checkpoints = _steps(run_dir), run_dir / "checkpoints"
        _wait(lambda: _steps(run_dir) > steps and TrainCheckpointer.latest_in(checkpoints), train, train_log)
        _wait(lambda: len(_in_flight(_events(second_events))) == 2, train, train_log)
        os.killpg(train.pid, signal.SIGKILL)
        train.wait()
        crashed_at = time.time()
        written = set(logged_groups(cfg_log := run_dir / "rollout_log"))
        out_at_crash = {group for group, _, _ in _in_flight(_events(second_events))} - written
        processes.append(train := _start([*command, "--resume"], tmp_path / "resumed-output.log"))
        assert train.wait(timeout=300) == 0, (tmp_path / "resumed-output.log").read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    cfg = load_experiment(args[0], [*args[1:], f"output_dir={tmp_path}"])
    rows = [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    trained = {g: p for row in rows for g, p in row["groups"]}
    assert sorted(g for row in rows for g, _ in row["groups"]) == list(range(PROMPTS)), "a group lost or trained twice"
    assert trained == uninterrupted_prompts(cfg, range(PROMPTS))  # the prompt an uninterrupted run gives each id
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [int(m["train/version"]) for m in metrics] == list(range(1, PROMPTS // BATCH + 1))  # each step once

    assert lost, "the first agent was killed between episodes"
    second = _events(second_events)
    run_log = (run_dir / "train.log").read_text()  # both processes' lines
    for group in lost:  # released after the timeout, counted as a failure, handed out again and ended
        assert re.search(rf"group {group} \(task '[^']+'\) is handed out again", run_log), group
        again = {(e["sample_index"], e["event"]) for e in second if e["group_id"] == group}
        assert {(0, "ended"), (1, "ended")} <= again, (group, again)
    assert out_at_crash, "the run was killed with no task out"
    for group in out_at_crash:  # out but not written when the run died: the resumed run hands it out again
        after = {(e["sample_index"], e["event"]) for e in second if e["group_id"] == group and e["time"] > crashed_at}
        assert {(0, "ended"), (1, "ended")} <= after, (group, after)
    # each trained sample carries the reward its client posted last for it (the re-run's, for a lost one); a cut-off
    # reply is penalized (truncation: penalize), the posted reward kept as its raw reward
    posted = {}
    for event in sorted([*_events(first_events), *second], key=lambda e: e["time"]):
        if event["event"] == "ended":
            posted[(event["group_id"], event["sample_index"])] = event["reward"]
    logged = {
        (t.group_id, t.sample_index): t.metadata.get("raw_reward", t.reward)
        for shard in list_shards(cfg_log)
        for t in (entry.trajectory for entry in read_shard(cfg_log, shard)[0])
    }
    assert logged == posted
