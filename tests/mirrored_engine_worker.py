"""One process of an engine over 2 processes x 2 CPU devices (`jax.distributed` on localhost, gloo); the
caller sets XLA_FLAGS. Also imported by the test for its one-process reference run.

python tests/mirrored_engine_worker.py generate|generate-paged STORE OUT.json PROCESS PORT
    process 0 drives a Generator on a MirroredEngine (dense or paged KV cache) through `REQUESTS` (weights
    v0, then v1 from the store after the `UPDATE_AFTER`-th decode step, interrupting), writes the results
    to OUT.json and prints "generated"; it then keeps generating until it loses process 1, which just follows.
python tests/mirrored_engine_worker.py measure STORE OUT.json PROCESS PORT
    the cost of the command channel: `STEPS` decode steps over full slots with each process making the
    calls itself (plain SPMD), then driven by process 0 (mirrored); process 0 prints `name: value unit`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.weights.base import abstract_target
from areal_jax.weights.orbax_store import OrbaxWeightSubscriber
from tests.engine_fixtures import all_at_once, tiny_model

ENGINE = EngineConfig(max_slots=4, max_length=32, max_prefill_batch=2)
MESH = MeshConfig(data=2, fsdp=1, tensor=2)  # slots over data (across the processes), heads over tensor
# (prompt, samples, max_new_tokens, seed): more samples than slots, so finished slots are refilled
REQUESTS = [([3, 1, 4, 1, 5], 2, 14, 11), ([9, 2, 6], 1, 20, 12), ([5, 3, 5, 8, 9, 7], 2, 9, 13), ([2, 7], 1, 16, 14)]
UPDATE_AFTER = 6  # decode steps on v0 before v1 is swapped in (interrupting the samples in flight)
STEPS = 200


def make_engine(devices: list[jax.Device], paged: bool = False) -> tuple[Engine, Any]:
    """The engine over `devices` (4), its KV cache paged or dense, and the target its weights load onto."""
    model = tiny_model(0)
    config = ENGINE.replace(kv_cache="paged", page_size=8) if paged else ENGINE
    engine = Engine(model, config, make_mesh(MESH, devices))
    return engine, abstract_target(nnx.state(model), engine.param_shardings)


class _UpdateAfter:
    """An engine that, after its `steps`-th decode step, swaps the store's version 1 into `generator`: the
    update lands at the same step on every run, whatever the threads' timing."""

    def __init__(self, engine: Any, store: Any, target: Any, steps: int):
        self.engine, self.store, self.target, self.steps = engine, store, target, steps
        self.generator: Generator | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, *args: Any) -> Any:
        result = self.engine.generate(*args)
        self.steps -= 1
        if self.steps == 0:
            assert self.generator is not None
            weights = self.store.load(1, self.target)
            self.generator.update_params(weights.params, weights.version, interrupt=True)
        return result


def generate_with_update(engine: Any, store: Any, target: Any) -> list[dict[str, Any]]:
    """`REQUESTS` through a Generator on `engine` (v0, then v1 after `UPDATE_AFTER` steps), as JSON rows."""
    stepping = _UpdateAfter(engine, store, target, UPDATE_AFTER)
    first = store.load(0, target)
    with Generator(stepping, engine.load_params(first.params, first.version), seed=0) as generator:
        stepping.generator = generator
        with all_at_once(generator):  # every request queued before the first admission: the same schedule every run
            futures = [
                generator.submit(prompt, SamplingParams(temperature=0.9, max_new_tokens=new, seed=seed), n=n)
                for prompt, n, new, seed in REQUESTS
            ]
        results = [r for future in futures for r in future.result(timeout=120)]
    return [_row(r) for r in results]


def _row(result: GenerationResult) -> dict[str, Any]:
    return {
        "output_ids": list(result.output_ids),
        "output_logprobs": list(result.output_logprobs),
        "output_versions": list(result.output_versions),
        "num_interruptions": result.num_interruptions,
    }


def _measure(engine: Any, params: Any) -> float:
    """Seconds per decode step over full slots, each step completed before the next (as on CPU it must
    be: `mirrored_engine.py`) and its tokens read (as the generator does)."""
    state = jax.block_until_ready(engine.init_decode_state())
    batch = engine.prefill_batch(params, [[1, 2, 3]] * 2)
    for row in range(2):
        state = engine.insert_batch(batch, state, [2 * row, 2 * row + 1], [SamplingParams()] * 2, np.ones((2, 2)))
        jax.block_until_ready(state)
    started = time.perf_counter()
    for _ in range(STEPS):
        state, emitted = engine.generate(params, state, 20)
        np.asarray(emitted.tokens.addressable_shards[0].data)
    return (time.perf_counter() - started) / STEPS


def main(mode: str, store_dir: Path, out: Path, process: int, port: int) -> None:
    from areal_jax.multiprocess import TrainerProcesses
    from areal_jax.system.command_channel import CommandReceiver, CommandSender
    from areal_jax.system.mirrored_engine import MirroredEngine, MirroredWeights, follow

    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
    engine, target = make_engine(jax.devices(), paged=mode == "generate-paged")
    store = OrbaxWeightSubscriber(store_dir, process_local=True)
    processes = TrainerProcesses()
    plain = None
    if mode == "measure":  # the baseline first: both processes make every call themselves
        params = engine.load_params(store.load(0, target).params, 0)
        _measure(engine, params)  # compiles
        plain = _measure(engine, params)
    if process > 0:
        address, secret = processes.share(None)
        receiver = CommandReceiver(address, bytes.fromhex(secret), process, timeout_s=30)
        follow(engine, receiver, lambda version: store.load(version, target).params)
        return
    sender = CommandSender("127.0.0.1", 1, timeout_s=10, on_lost=_exit_lost)
    processes.share([sender.address, sender.secret.hex()])
    sender.accept(30)
    mirrored = MirroredEngine(engine, sender)
    weights = MirroredWeights(store, mirrored)
    if mode == "measure":
        params = mirrored.load_params(weights.load(0, target).params, 0)
        seconds = _measure(mirrored, params)
        commands = mirrored.commands
        print(f"plain_spmd_step: {plain * 1e3:.3f} ms")
        print(f"mirrored_step: {seconds * 1e3:.3f} ms")
        print(f"command_send: {mirrored.command_seconds / commands * 1e6:.1f} us")
        print(f"mirrored_overhead_per_step: {(seconds - plain) * 1e3:.3f} ms")
        mirrored.stop("done")
        return
    out.write_text(json.dumps(generate_with_update(mirrored, weights, target)))
    print("generated", flush=True)
    first = weights.load(0, target)
    with Generator(mirrored, mirrored.load_params(first.params, 0), seed=0) as generator:
        while True:  # until process 1 is killed: `_exit_lost` ends this process
            generator.submit([1, 2, 3], SamplingParams(max_new_tokens=20)).result(timeout=60)


def _exit_lost(message: str) -> None:
    import os

    print(f"lost: {message}", flush=True)
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
