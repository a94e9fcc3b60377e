"""One engine over two processes (`jax.distributed` on localhost, gloo, 2 CPU devices each; slots split
across the processes, heads within each), driven by process 0's Generator through `MirroredEngine`,
against the same engine in one process over 4 devices: the same tokens, log-probs and versions for the
same requests, with a weight version restored from the store by each process and swapped in mid-stream
(interrupting), on the paged KV cache (its page tables travel with the commands; the rollout server test
below runs the dense one). Then process 1 is killed: process 0 notices and exits with the message that
says so."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber
from tests.engine_fixtures import tiny_model
from tests.mirrored_engine_worker import generate_with_update, make_engine
from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers(mode: str, store: Path, out: Path) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    port = str(_free_port())
    worker = str(ROOT / "tests" / "mirrored_engine_worker.py")
    return _start_two(lambda i: [sys.executable, worker, mode, str(store), str(out), str(i), port], env)


def _start_two(command: Callable[[int], list[str]], env: dict[str, str]) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a two-process program, their output merged and piped."""
    return [
        subprocess.Popen(command(i), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]


def _lines(process: subprocess.Popen) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str | None], text: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not seen or text not in seen[-1]:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert line is not None, f"ended before {text!r}:\n{''.join(seen)[-4000:]}"
        seen.append(line)
    return seen


def _two_process_rollout_server(run: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """`areal-jax rollout --server 0` of run `run` (config file, overrides) as 2 processes of 2 CPU devices."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "areal_jax.cli", "rollout", "--server", "0", *run, f"output_dir={tmp_path}"]
    command += ["name=run", "distributed.enabled=true", "distributed.num_processes=2"]
    command += [f"distributed.coordinator_address=127.0.0.1:{_free_port()}"]
    return _start_two(lambda i: [*command, f"distributed.process_id={i}"], env)


def _wait_for_servers(servers: list[subprocess.Popen], predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert all(s.poll() is None for s in servers), "a server process ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_engine_over_two_processes_matches_one_process_and_stops_on_a_lost_process(tmp_path: Path) -> None:
    store = tmp_path / "weights"
    publisher = OrbaxWeightPublisher(store, async_save=False)
    for version in (0, 1):
        publisher.publish(nnx.state(tiny_model(version)), version)
    publisher.close()
    out = tmp_path / "two.json"
    leader, follower = _workers("generate-paged", store, out)
    lines = _lines(leader)

    engine, target = make_engine(jax.devices()[:4], paged=True)
    reference = generate_with_update(engine, OrbaxWeightSubscriber(store), target)

    _wait_for(lines, "generated", timeout_s=240)
    os.kill(follower.pid, signal.SIGKILL)
    killed = time.monotonic()
    said = "".join(_wait_for(lines, "lost:", timeout_s=30))
    assert leader.wait(timeout=30) == 3
    assert time.monotonic() - killed < 30
    assert "process 1 of the rollout server is gone" in said
    follower.wait(timeout=30)

    two = json.loads(out.read_text())
    assert len(two) == len(reference) == 6
    for ours, theirs in zip(two, reference, strict=True):
        assert ours["output_ids"] == theirs["output_ids"]
        assert ours["output_versions"] == theirs["output_versions"]
        assert ours["num_interruptions"] == theirs["num_interruptions"]
        np.testing.assert_array_equal(ours["output_logprobs"], theirs["output_logprobs"])
    versions = [set(row["output_versions"]) for row in reference]
    assert {0, 1} in versions and any(row["num_interruptions"] == 1 for row in reference)  # swapped mid-stream


SERVER_RUN = [
    "configs/train_cpu.yaml",
    "rollout.engine.max_slots=8",
    "rollout.engine.max_prefill_batch=2",  # few engine programs to compile
    "rollout.staleness.batch_prompts=4",
    "rollout.staleness.max_head_offpolicyness=1",
    "rollout.workflow.n_samples=2",
    "dataset.heldout=0",
    "cluster.weights_poll_s=0.05",
    "cluster.status_every_s=0.2",
]


def test_rollout_server_over_two_processes_serves_reloads_and_stops_together(tmp_path: Path) -> None:
    from areal_jax.config import load_experiment
    from areal_jax.data.rollout_log_shards import list_shards
    from areal_jax.system.assembly import build_tokenizer, random_policy
    from areal_jax.system.cluster import ControlFiles

    cfg = load_experiment(SERVER_RUN[0], [*SERVER_RUN[1:], f"output_dir={tmp_path}", "name=run"])
    control = ControlFiles(cfg.run_dir, 1)
    control.clear()
    publisher = OrbaxWeightPublisher(cfg.run_dir / "weights", async_save=False)
    tokenizer = build_tokenizer(cfg)
    publisher.publish(nnx.state(random_policy(cfg, None, tokenizer)), 0)
    control.trainer_ready(0)  # the trainer stand-in: versions into the store, the control files

    servers = _two_process_rollout_server(SERVER_RUN, tmp_path)
    log = cfg.run_dir / "rollout_log"

    def written() -> int:
        return sum(shard.num_records for shard in list_shards(log)) if log.is_dir() else 0

    def wait_until(predicate, timeout_s: float) -> None:
        _wait_for_servers(servers, predicate, timeout_s)

    wait_until(lambda: written() >= 8 * 2, 240)  # the bound at v0: (1 + 0 + 1) x 4 groups of 2
    publisher.publish(nnx.state(random_policy(cfg.replace(seed=1), None, tokenizer)), 1)
    wait_until(lambda: written() >= 12 * 2, 120)  # admitted only once v1 is in use: (1 + 1 + 1) x 4
    control.request_stop("test")
    outputs = [server.communicate(timeout=60)[0] for server in servers]
    publisher.close()
    assert [server.returncode for server in servers] == [0, 0], outputs[1][-3000:] + outputs[0][-3000:]
    for output in outputs:
        assert '"ended_by": "stop"' in output
        assert "loaded weights version 1" in output  # each process restored v1 by itself
    assert json.loads(Path(control.status_path(0)).read_text())["pid"] == servers[0].pid
    assert {shard.writer_id.rsplit("-", 1)[1] for shard in list_shards(log)} == {str(servers[0].pid)}
    assert not list((cfg.run_dir / "control").glob("*.failed"))


def test_a_lora_rollout_server_over_two_processes_serves_adapter_versions_over_the_base(tmp_path: Path) -> None:
    """`model.lora` over two processes: each loads the run's base itself, restores adapter-only versions, and the
    served tokens' behaviour log-probs are those of base + the adapters of each token's version."""
    from areal_jax.config import load_experiment
    from areal_jax.data.rollout_log_reader import read_shard
    from areal_jax.data.rollout_log_shards import list_shards
    from areal_jax.models.lora import split_trainable
    from areal_jax.system.assembly import build_tokenizer, random_policy
    from areal_jax.system.cluster import ControlFiles
    from areal_jax.weights.base import tree_nbytes
    from tests.test_lora_model import with_random_adapters

    run = [*SERVER_RUN, "model.lora.rank=4", "model.lora.targets=[q,v,o,down]"]
    cfg = load_experiment(run[0], [*run[1:], f"output_dir={tmp_path}", "name=run"])
    control = ControlFiles(cfg.run_dir, 1)
    control.clear()
    base = random_policy(cfg, None, build_tokenizer(cfg))  # the run's seeded init: what the servers load
    states = {0: nnx.state(base), 1: with_random_adapters(base, seed=5, std=0.5)}
    adapters = {version: split_trainable(cfg.model, state)[0] for version, state in states.items()}
    adapter_bytes, base_bytes = tree_nbytes(adapters[0]), tree_nbytes(split_trainable(cfg.model, states[0])[1])
    publisher = OrbaxWeightPublisher(cfg.run_dir / "weights", async_save=False)
    publisher.publish(adapters[0], 0)
    control.trainer_ready(0)

    servers = _two_process_rollout_server(run, tmp_path)
    log = cfg.run_dir / "rollout_log"

    def written() -> int:
        return sum(shard.num_records for shard in list_shards(log)) if log.is_dir() else 0

    def wait_until(predicate, timeout_s: float) -> None:
        _wait_for_servers(servers, predicate, timeout_s)

    wait_until(lambda: written() >= 8 * 2, 240)
    publisher.publish(adapters[1], 1)
    wait_until(lambda: written() >= 12 * 2, 120)  # admitted only once v1 is in use
    control.request_stop("test")
    outputs = [server.communicate(timeout=60)[0] for server in servers]
    publisher.close()
    assert [server.returncode for server in servers] == [0, 0], outputs[1][-3000:] + outputs[0][-3000:]
    for output in outputs:  # each process restored the adapters alone
        assert f"loaded weights version 1: {adapter_bytes} bytes" in output
    version_dir = sum(f.stat().st_size for f in (cfg.run_dir / "weights" / "1").rglob("*") if f.is_file())
    assert adapter_bytes <= version_dir < adapter_bytes + 64 * 1024 < base_bytes

    width = cfg.rollout.engine.max_length
    graphdef = nnx.graphdef(base)

    @jax.jit
    def scores(state: nnx.State, ids_1xW: jax.Array, n: jax.Array) -> jax.Array:
        """log p(ids[t] | ids[:t]) at position t - 1, at the sampler's temperature."""
        segments = (jnp.arange(width) < n).astype(jnp.int32)[None]
        targets = jnp.roll(ids_1xW, -1, axis=1)
        model = nnx.merge(graphdef, state)
        temperature = cfg.rollout.workflow.sampling.temperature
        return model.token_logprobs(ids_1xW, targets, segments, jnp.arange(width)[None], temperature)[0][0]

    served, by_version, moved = [], [], []
    for shard in list_shards(log):
        for entry in read_shard(log, shard)[0]:
            t = entry.trajectory
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(t.token_ids)] = t.token_ids
            at = {v: np.asarray(scores(states[v], ids, len(t.token_ids))) for v in states}
            positions = np.flatnonzero(t.loss_mask)
            versions = t.versions[positions]
            served.append(t.behav_logprobs[positions])
            by_version.append(np.where(versions == 1, at[1][positions - 1], at[0][positions - 1]))
            moved.append(np.where(versions == 1, np.abs(at[1] - at[0])[positions - 1], 0.0))
    served, by_version, moved = (np.concatenate(x) for x in (served, by_version, moved))
    np.testing.assert_allclose(served, by_version, atol=2e-4)
    assert moved.max() > 0.05  # the tokens of version 1 were sampled by its adapters, not by the base's
