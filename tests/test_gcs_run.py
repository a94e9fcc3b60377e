"""A run whose directory is a gs:// bucket (a local GCS server, tests/gcs_emulator.py): `areal-jax launch
local` with a trainer and a rollout server that meet only through the bucket (control files, rollout log,
Orbax weight versions polled by the server, checkpoints), the trainer's records uploaded from its local
copy. The trainer is SIGKILLed after its first checkpoint; the run is resumed from another local copy (a
new host) and stopped there with SIGTERM (a checkpoint, the "resumable" exit code). The bucket's records
continue without a gap or a repeat, every group trains once, under the prompt an uninterrupted run gives its
id, within the staleness bound; then the run is evaluated from the bucket. (This is also the crash test of
the multi-process shape: tests/test_resume_prompts.py runs the one-process shape, resumed after its SIGTERM
to the end.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from areal_jax import storage
from areal_jax.config import load_experiment
from areal_jax.data.rollout_log_reader import read_shard
from areal_jax.data.rollout_log_shards import list_shards
from areal_jax.exit_codes import EXIT_RESUMABLE
from areal_jax.trainer.checkpoint import TrainCheckpointer
from tests.gcs_emulator import BUCKET, GcsEmulator
from tests.prompt_order import uninterrupted_prompts
from tests.short_runs import NO_EVAL, SHORT_TRAIN_CPU
from tests.xla_flags import xla_flags

STEPS = 12  # never reached: the SIGTERM lands by step 8, whichever checkpoint the kill found
ETA = 1
RUN = [
    "configs/train_cpu.yaml",
    "rollout.staleness.batch_prompts=4",
    f"rollout.staleness.max_head_offpolicyness={ETA}",
    "rollout.workflow.n_samples=4",
    *SHORT_TRAIN_CPU,
    *NO_EVAL,
    "train_checkpoint.every_steps=2",
    "cluster.status_every_s=0.2",
    "cluster.weights_poll_s=0.1",
    "cluster.weight_transfer=orbax",  # the server must see each new version in the bucket's listing
    "local_copy_upload_s=3600",  # records reach the bucket before each checkpoint and at the end only
    "name=run",
]


def _launch(tmp_path: Path, output_dir: str, local_copy: Path, steps: int, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "areal_jax.cli", "launch", "local", "--rollout", "1", *flags, *RUN]
    command += [
        f"train_steps={steps}",
        f"output_dir={output_dir}",
        f"local_copy_dir={local_copy}",
        "compilation_cache_dir=null",  # the test session's cache: programs other tests compiled load from it
    ]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one CPU device per process, as on a user's machine
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _server_version(run: str) -> int:
    """The newest weight version rollout server 0's status file reports loading (-1: none yet)."""
    try:
        status = json.loads(storage.read_text(storage.join(run, "control", "rollout-0.json")))
    except (OSError, ValueError):
        return -1
    return int(status.get("weights_version", -1))


def _metrics(location: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(location).splitlines() if line.strip()]


def test_a_run_on_a_bucket_survives_a_killed_trainer_resumes_elsewhere_and_keeps_its_records(
    gcs: GcsEmulator, tmp_path: Path
) -> None:
    output_dir = f"gs://{BUCKET}/{uuid.uuid4().hex}"
    run = storage.join(output_dir, "run")
    checkpoints = storage.join(run, "checkpoints")
    first_copy, second_copy = tmp_path / "host-a", tmp_path / "host-b"
    launcher = _launch(tmp_path, output_dir, first_copy, STEPS)
    try:
        deadline = time.monotonic() + 300
        # checkpoint 2, and the server has loaded a version from the bucket (on a loaded machine its poll can
        # trail the trainer's checkpoint)
        while (TrainCheckpointer.latest_in(checkpoints) or 0) < 2 or _server_version(run) < 1:
            assert launcher.poll() is None, launcher.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no checkpoint 2 and loaded version in time"
            time.sleep(0.1)
        trainer = json.loads(storage.read_text(storage.join(run, "control", "trainer.json")))["pid"]
        os.kill(trainer, signal.SIGKILL)  # no final checkpoint, no last upload of its records
        output = launcher.communicate(timeout=120)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, output[-3000:]
    killed_at = TrainCheckpointer.latest_in(checkpoints)
    assert killed_at is not None and 2 <= killed_at <= STEPS - 4  # room for the SIGTERM's two steps

    # the shared files are in the bucket, nothing of them on the local disk
    names = storage.names(run)
    for entry in (".areal-run", "config.yaml", "checkpoints", "weights", "rollout_log", "control", "metrics.jsonl"):
        assert entry in names, names
    local = load_experiment(None, [f"output_dir={output_dir}", "name=run", f"local_copy_dir={first_copy}"]).run_dir
    assert local.is_relative_to(first_copy) and (local / "metrics.jsonl").is_file()
    assert not any((local / entry).exists() for entry in ("checkpoints", "weights", "rollout_log", "control"))
    # every step up to the newest checkpoint has its record on the bucket: they were uploaded before it
    uploaded = [m["train/version"] for m in _metrics(storage.join(run, "metrics.jsonl"))]
    assert uploaded[:killed_at] == list(range(1, killed_at + 1)), uploaded
    # the server started on version 0 (nothing to train before its groups) and found later ones in the bucket
    status = json.loads(storage.read_text(storage.join(run, "control", "rollout-0.json")))
    assert status["weights_version"] >= 1 and status["weights_orbax_loads"] >= 1, status

    # resumed on "another host": its local copy starts empty and is filled from the bucket; stopped there with
    # SIGTERM once it has committed a checkpoint of its own (graceful: a checkpoint, no export, "resumable"). Its
    # local step count cannot tell: the bucket's records may run past the killed checkpoint (uploaded before a
    # checkpoint the kill interrupted), and the resumed run cuts them back only once it has started.
    resumed = _launch(tmp_path, output_dir, second_copy, STEPS, "--resume")
    try:
        deadline = time.monotonic() + 300
        while (TrainCheckpointer.latest_in(checkpoints) or 0) < killed_at + 2:
            assert resumed.poll() is None, resumed.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the resumed run made no checkpoint"
            time.sleep(0.1)
        resumed.send_signal(signal.SIGTERM)
        output = resumed.communicate(timeout=120)[0]
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert resumed.returncode == EXIT_RESUMABLE, output[-4000:]
    assert f"resumed from step {killed_at}" in output, output[-3000:]
    stopped_at = TrainCheckpointer.latest_in(checkpoints)
    assert stopped_at is not None and killed_at + 2 <= stopped_at < STEPS, (killed_at, stopped_at)
    metrics = _metrics(storage.join(run, "metrics.jsonl"))
    assert [m["train/version"] for m in metrics] == list(range(1, stopped_at + 1))
    assert not storage.exists(storage.join(run, "hf_final"))
    # eta bounds the version a group starts at; a batch fills in completion order, so one a version later
    assert max(m["rollout/staleness_max"] for m in metrics) <= ETA + 1

    log = storage.join(run, "rollout_log")
    entries = [e.trajectory for shard in list_shards(log) for e in read_shard(log, shard)[0]]
    records = [(t.group_id, t.sample_index) for t in entries]
    assert records and max(Counter(records).values()) == 1  # a group is written once, whatever the restarts
    trained = [
        json.loads(line)
        for line in storage.read_text(storage.join(run, "trained_groups.jsonl")).splitlines()
        if line.strip()
    ]
    groups = {g: p for line in trained for g, p in line["groups"]}
    assert [line["version"] for line in trained] == list(range(1, stopped_at + 1))
    assert sum(len(line["groups"]) for line in trained) == len(groups) == stopped_at * 4  # 4 a step, none twice
    cfg = load_experiment(RUN[0], [*RUN[1:], f"output_dir={output_dir}"])
    assert groups == uninterrupted_prompts(cfg, groups)  # each id trained the prompt it has in any run

    # evaluated straight from the bucket: its newest training checkpoint, the report written next to it
    command = [sys.executable, "-m", "areal_jax.cli", "eval", "--checkpoint", run, "dataset.heldout=4"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads(storage.read_text(storage.join(run, "eval", "eval.json")))
    assert f"training checkpoint {stopped_at}" in report["checkpoint"] and report["overall"]["prompts"] == 4
