"""The `areal-jax trainer` role over two processes (`jax.distributed` on localhost, gloo CPU collectives, 4
devices each) against the same role in one process with 8 devices, on the same rollout log.

The test writes the log as a rollout server would: into each run directory once its trainer has published
and written its ready marker. The two-process run trains 2 steps, checkpoints and ends, then is resumed
(`--resume`, both processes restore the checkpoint together) for step 3 on groups written after its ready
marker; the one-process run trains 3 steps straight. Both processes train the same batches in the same
order (each logs a digest of what it trained), the final params (the HF export) equal the one-process
run's, and process 0 alone wrote the metrics, the trained groups and the train log. The two-process run
publishes on the direct weight path (`cluster.weight_transfer: direct`): both processes offer their pieces.
Its run directory is a bucket (a local GCS server, tests/gcs_emulator.py): collective Orbax saves to gs://,
the control files and log there, process 0's records uploaded from the local copy both processes share.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from areal_jax import storage
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.jsonl import read_jsonl
from areal_jax.storage import read_json
from tests.gcs_emulator import BUCKET, GcsEmulator
from tests.rollout_log_worker import make_trajectory
from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
GROUPS, SAMPLES, VOCAB = 4, 2, 27  # per step; the char tokenizer's vocabulary (configs/train_cpu.yaml)
RUN = [
    "configs/train_cpu.yaml",
    f"rollout.staleness.batch_prompts={GROUPS}",
    f"rollout.workflow.n_samples={SAMPLES}",
    "trainer.packing.token_budget=512",
    "trainer.packing.rows=8",  # one row per device of the fsdp=8 mesh
    "train_checkpoint.every_steps=100",  # the last step's checkpoint only
    "dataset.heldout=0",
    "eval.every_steps=0",
    "report.plots=false",
    "report.live=never",
]
DIGEST = re.compile(r"batch of step (\d+) on process (\d+): .* digest ([0-9a-f]{8})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(tmp_path: Path, output_dir: str, name: str, devices: int, *args: str) -> subprocess.Popen:
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "PYTHONFAULTHANDLER": "1",  # a process ended by JAX's coordination service prints where it was
    }
    flags = [a for a in args if a.startswith("--")]  # before the config: argparse ends `rest` at a flag
    command = [sys.executable, "-m", "areal_jax.cli", "trainer", *flags, *RUN]
    command += [f"output_dir={output_dir}", f"name={name}", f"compilation_cache_dir={cache}"]
    command += [f"local_copy_dir={tmp_path / 'local-copy'}"]
    command += [a for a in args if not a.startswith("--")]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _two_processes(tmp_path: Path, output_dir: str, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    return [
        _trainer(
            tmp_path,
            output_dir,
            "two",
            4,
            *args,
            "distributed.enabled=true",
            "cluster.weight_transfer=direct",  # both processes offer their pieces (nobody pulls them here)
            f"distributed.coordinator_address=127.0.0.1:{port}",
            "distributed.num_processes=2",
            f"distributed.process_id={i}",
        )
        for i in range(2)
    ]


def _write_groups_when_ready(run_dir: str, trainer: subprocess.Popen, groups: range, writer: str) -> None:
    """Once `trainer` (process 0) is ready, append `groups` to the run's log as a rollout server does."""
    ready = storage.join(run_dir, "control", "trainer.json")
    deadline = time.monotonic() + 300
    # an earlier trainer's file may be there and vanish as this one starts (`trainer_starting`): read it as the
    # servers do, missing = not ready
    while (read_json(ready) or {}).get("pid") != trainer.pid:
        if trainer.poll() is not None:
            raise AssertionError(f"the trainer ended before it was ready:\n{trainer.communicate()[0][-4000:]}")
        assert time.monotonic() < deadline, "the trainer was not ready in time"
        time.sleep(0.1)
    with RolloutLogWriter(storage.join(run_dir, "rollout_log"), writer) as log:
        for group in groups:
            for sample in range(SAMPLES):
                length = 16 if sample == 0 else 10 + group % 6  # every step packs to one shape: one compilation
                t = make_trajectory(group, sample, length=length, seed=1)
                log.append(t.__class__(**{**t.__dict__, "token_ids": t.token_ids % VOCAB}))
                if log.buffered == 3:  # shards of 3 records
                    log.flush()


def _finish(processes: list[subprocess.Popen]) -> list[str]:
    """Every process's output once all have ended; on a failure, every process's tail (the first one to
    fail is often not the one that reports it)."""
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    codes = [process.returncode for process in processes]
    if any(codes):
        tails = (
            f"--- process {i} (exit {code}):\n{out[-6000:]}"
            for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
        )
        raise AssertionError("\n".join(tails))
    return outputs


def _digests(outputs: list[str]) -> dict[int, list[tuple[int, str]]]:
    by_process: dict[int, list[tuple[int, str]]] = {}
    for output in outputs:
        for step, process, digest in DIGEST.findall(output):
            by_process.setdefault(int(process), []).append((int(step), digest))
    return by_process


def test_trainer_role_over_two_processes_matches_one_and_resumes(tmp_path: Path, gcs: GcsEmulator) -> None:
    bucket = f"gs://{BUCKET}/{tmp_path.name}"
    two, one = storage.join(bucket, "two"), tmp_path / "one"
    first = _two_processes(tmp_path, bucket, "train_steps=2")
    single = _trainer(tmp_path, str(tmp_path), "one", 8, "train_steps=3")
    _write_groups_when_ready(two, first[0], range(2 * GROUPS), "w0")
    _write_groups_when_ready(str(one), single, range(3 * GROUPS), "w0")
    first_outputs = _finish(first)
    resumed = _two_processes(tmp_path, bucket, "train_steps=3", "--resume")
    _write_groups_when_ready(two, resumed[0], range(2 * GROUPS, 3 * GROUPS), "w1")  # after the restore
    resumed_outputs = _finish(resumed)
    _finish([single])

    assert "resumed from step 2" in resumed_outputs[0]
    for output in (*first_outputs, *resumed_outputs):  # every version offered from both processes' pieces
        assert re.search(r"offering weights version \d+ to 1 pullers from 2 processes", output), output[-4000:]
    digests = _digests([*first_outputs, *resumed_outputs])
    assert [step for step, _ in digests[0]] == [1, 2, 3]
    assert digests[1] == digests[0]  # both processes trained the same records in the same order

    trained = [json.loads(line) for line in storage.read_text(storage.join(two, "trained_groups.jsonl")).splitlines()]
    assert trained == [json.loads(line) for line in (one / "trained_groups.jsonl").read_text().splitlines()]
    assert [sorted(g for g, _ in row["groups"]) for row in trained] == [
        list(range(s * GROUPS, (s + 1) * GROUPS)) for s in range(3)
    ]
    records = tmp_path / "two-records"  # what the bucket holds of process 0's records
    storage.download_tree(two, records)
    metrics = read_jsonl(records / "metrics.jsonl")
    assert [m["train/version"] for m in metrics] == [1, 2, 3]  # process 0's lines only
    assert all(m["train/skipped_updates"] == 0 and m["train/grad_norm"] > 0 for m in metrics)  # params moved
    assert "on process 1" not in (records / "train.log").read_text()
    assert sorted(p.name for p in (records / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]

    ours = load_file(records / "hf_final" / "model.safetensors")
    reference = load_file(one / "hf_final" / "model.safetensors")
    assert len(ours) > 5 and sorted(ours) == sorted(reference)
    for key, value in reference.items():  # the collectives reduce in another order: equal up to float rounding
        np.testing.assert_allclose(ours[key], value, rtol=0, atol=1e-5, err_msg=key)
