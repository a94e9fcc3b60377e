"""The trainer over two processes (`jax.distributed` on localhost, gloo CPU collectives, 4 devices each)
against one process with 8 devices: the same params after 3 steps on the same batches, and a checkpoint
saved and restored by both processes together."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("distributed_trainer_worker.py")
ROOT = WORKER.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(out: Path, process_id: int, processes: int, port: int, checkpoints: Path, devices: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, str(WORKER), str(out), str(process_id), str(processes), str(port), str(checkpoints)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_trainer_processes_match_one_and_checkpoint_together(tmp_path: Path) -> None:
    port = _free_port()
    workers = [_worker(tmp_path / f"two-{i}.npz", i, 2, port, tmp_path / "ck2", devices=4) for i in range(2)]
    single = _worker(tmp_path / "one.npz", 0, 1, 0, tmp_path / "ck1", devices=8)
    for process in [*workers, single]:
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two-0.npz")
    assert not (tmp_path / "two-1.npz").exists()  # process 0 alone writes
    params = [k for k in one.files if k not in ("restored_equal", "restored_step")]
    assert len(params) > 5 and sorted(params) == sorted(k for k in two.files if k in params)
    for key in params:  # the collectives reduce in another order: equal up to float rounding
        np.testing.assert_allclose(two[key], one[key], rtol=0, atol=1e-5, err_msg=key)
    assert bool(two["restored_equal"]) and int(two["restored_step"]) == 3
    assert bool(one["restored_equal"])
    assert sorted(p.name for p in (tmp_path / "ck2").iterdir() if p.name.isdigit()) == ["3"]
