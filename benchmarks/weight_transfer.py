"""Per-version weight latency between two processes: the direct path (JAX's transfer server) against the
Orbax store, for the model of `configs/train_cpu.yaml` and the ~100M-parameter decoder.

This process is the trainer: params on a 2x4 (fsdp x tensor) mesh of 8 virtual CPU devices. A second
process is a rollout server with 4 devices that loads each version onto a 4x1 mesh (so every path
reshards). Versions take turns between the paths; each round starts when the previous one is loaded and
every background write is done. Latency = wall clock from the trainer's `publish` call to the params
being ready on the reader's devices, including the reader's polling (every 0.05 s, the default
`cluster.weights_poll_s`):

- direct: `DirectWeightPublisher.publish` (copy, offer, announce; then the Orbax save it keeps, written in
  the background while the reader pulls: `cluster.weight_transfer: direct` as it runs) -> the reader sees
  the announcement, pulls and reshards;
- direct_only: the same offer and pull with no store write behind it (what the transfer itself costs);
- orbax: `OrbaxWeightPublisher.publish` (host copy, background write, commit by rename) -> the reader sees
  the committed version and restores it onto its shardings.

The first round of each path warms it up (connection, compilation) and is dropped; the medians of the
rest are printed. Prints `name: value unit` lines; the last is `ratio direct_vs_orbax: X.XX`, the Orbax
latency over the direct latency for the 100M model.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
from common import MODEL_100M
from flax import nnx
from weights import fresh_copy, random_params

from areal_jax.config import load_experiment
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, make_mesh, state_shardings
from areal_jax.weights import OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target, tree_nbytes
from areal_jax.weights.direct import DirectWeightPublisher, DirectWeightSubscriber

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05
TIMEOUT_S = 120.0


def model_config(name: str) -> ModelConfig:
    if name == "100m":
        return MODEL_100M
    return load_experiment(ROOT / "configs" / "train_cpu.yaml").model


PATHS = ("direct", "direct_only", "orbax")


def path_of(version: int) -> str:
    return PATHS[(version - 1) % len(PATHS)]


def reader(run: Path, model: str, versions: int) -> None:
    """The rollout server's end: load versions 1..`versions` as they come, each by its path."""
    cfg = model_config(model)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    target = abstract_target(abstract, state_shardings(abstract, mesh))
    subscribers = {
        path: DirectWeightSubscriber(
            run / f"{path}.json",
            OrbaxWeightSubscriber(run / f"{path}_store", poll_initial_s=POLL_S, poll_max_s=POLL_S),
            puller=0,
            timeout_s=TIMEOUT_S,
            poll_s=POLL_S,
        )
        for path in ("direct", "direct_only")
    }
    subscribers["orbax"] = OrbaxWeightSubscriber(run / "orbax_store", poll_initial_s=POLL_S, poll_max_s=POLL_S)
    print("ready", flush=True)
    for version in range(1, versions + 1):
        path = path_of(version)
        subscriber = subscribers[path]
        if subscriber.wait_for_version(version, timeout_s=TIMEOUT_S) != version:
            raise SystemExit(f"version {version} did not appear")
        loaded = subscriber.load(version, target)
        jax.block_until_ready(loaded.params)
        if loaded.source != ("orbax" if path == "orbax" else "direct"):
            raise SystemExit(f"version {version} ({path}) came from {loaded.source}")
        print(f"done {version} {time.time()} {loaded.seconds} {path}", flush=True)
    for subscriber in subscribers.values():
        subscriber.close()


def measure(model: str, rounds: int) -> dict[str, list[float]]:
    """Seconds per version and path: latency, the trainer's blocking part and the reader's load."""
    cfg = model_config(model)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4), jax.devices()[:8])
    params = random_params(cfg, mesh)
    print(f"{model}_parameters: {cfg.num_params() / 1e6:.2f} M")
    print(f"{model}_weights_bytes: {tree_nbytes(params) / 1e6:.2f} MB")
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="weight-transfer-bench-") as scratch:
        run = Path(scratch)
        publishers = {
            path: DirectWeightPublisher(
                run / f"{path}.json", OrbaxWeightPublisher(run / f"{path}_store"), pullers=1, timeout_s=TIMEOUT_S
            )
            for path in ("direct", "direct_only")
        }
        publishers["orbax"] = OrbaxWeightPublisher(run / "orbax_store")
        publish = {path: publisher.publish for path, publisher in publishers.items()}
        publish["direct_only"] = publishers["direct_only"].serve
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        versions = len(PATHS) * rounds
        command = [sys.executable, __file__, "--reader", str(run), "--model", model, "--versions", str(versions)]
        worker = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        try:
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit("the reader did not start")
            for version in range(1, versions + 1):
                path = path_of(version)
                copy = fresh_copy(params)
                started = time.time()
                publish[path](copy, version)
                blocking = time.time() - started
                line = worker.stdout.readline().split()
                if not line or line[0] != "done" or int(line[1]) != version or line[4] != path:
                    raise SystemExit(f"the reader said {line} for version {version} ({path})")
                if version > len(PATHS):  # the first round of each path warms it up
                    times.setdefault(f"{path}_latency", []).append(float(line[2]) - started)
                    times.setdefault(f"{path}_publish_blocking", []).append(blocking)
                    times.setdefault(f"{path}_reader_load", []).append(float(line[3]))
                publishers[path].wait()  # the next round starts with no write in the background
            if worker.wait(timeout=TIMEOUT_S) != 0:
                raise SystemExit("the reader failed")
        finally:
            worker.kill()
            for publisher in publishers.values():
                publisher.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="5 timed rounds per path instead of --rounds")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per path (after a warm-up round)")
    parser.add_argument("--reader", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="100m", help=argparse.SUPPRESS)
    parser.add_argument("--versions", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.reader is not None:
        reader(args.reader, args.model, args.versions)
        return
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices for the trainer's 2x4 mesh; found {jax.device_count()}")
    rounds = (5 if args.quick else args.rounds) + 1
    print(f"backend: {jax.default_backend()} (trainer 2x4 mesh -> reader 4x1 mesh, two processes)")
    print(f"timed_rounds: {rounds - 1} per path")
    ratios = {}
    for model in ("train_cpu", "100m"):
        medians = {name: statistics.median(values) for name, values in measure(model, rounds).items()}
        for name, value in medians.items():
            print(f"{model}_{name}: {value:.4f} s")
        ratios[model] = medians["orbax_latency"] / medians["direct_latency"]
        print(f"{model}_direct_only_vs_orbax: {medians['orbax_latency'] / medians['direct_only_latency']:.2f} x")
        print(f"{model}_direct_vs_orbax: {ratios[model]:.2f} x")
    print(f"ratio direct_vs_orbax: {ratios['100m']:.2f}")


if __name__ == "__main__":
    main()
