"""Training checkpoints: decoder params + AdamW state onto another mesh shape, metadata, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.models.decoder import Decoder
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.sharding import MeshConfig, make_mesh, state_shardings
from areal_jax.system.stop_control import RunFailed, StopControl
from areal_jax.trainer.checkpoint import CheckpointConfig, TrainCheckpointer
from areal_jax.weights import abstract_target
from tests.weights_worker import TINY
from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def decoder_params(mesh: jax.sharding.Mesh) -> nnx.State:
    """The tiny decoder's parameter state placed by its logical shardings on `mesh` (random normal values;
    NumPy draws them, which is much faster on CPU than compiling the decoder's initialisers)."""
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(TINY, nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s),
        abstract,
        state_shardings(abstract, mesh),
    )


@jax.jit
def adamw_step(params: nnx.State, opt_state: optax.OptState) -> tuple[nnx.State, optax.OptState]:
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    updates, opt_state = optax.adamw(1e-3).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def test_restore_params_and_adamw_state_onto_another_mesh_shape(tmp_path: Path) -> None:
    params = decoder_params(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    tx = optax.adamw(1e-3)
    params, opt_state = adamw_step(params, tx.init(params))  # one real step: mu, nu and count non-trivial
    state = {"params": params, "opt_state": opt_state}
    data_state = {"next_shard": {"w0": 3}, "shard": "w0_00000003_000000000024_8.arrayrecord", "record": 5}
    metadata = {"policy_version": 7, "data": data_state, "staleness": {"0": 12, "1": 3}}

    checkpointer = TrainCheckpointer(tmp_path, CheckpointConfig(every_steps=10))
    assert not checkpointer.maybe_save(5, state, metadata)  # not due
    assert checkpointer.latest_step() is None
    assert checkpointer.maybe_save(10, state, lambda: metadata)  # due: saved
    checkpointer.save(10, state, metadata)  # the same step again is skipped
    checkpointer.close()

    mesh_b = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    params_b = jax.tree.map(jnp.zeros_like, jax.device_put(params, state_shardings(params, mesh_b)))
    target = abstract_target({"params": params_b, "opt_state": tx.init(params_b)})
    restored = TrainCheckpointer(tmp_path).restore(target)
    assert restored.step == 10 and restored.verified and restored.rejected == ()
    assert restored.metadata == json.loads(json.dumps({**metadata, "step": 10}))
    assert_trees_equal(restored.state, state)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target), strict=True):
        assert got.sharding == want.sharding
    assert any(len(leaf.sharding.device_set) == 8 for leaf in jax.tree.leaves(restored.state["params"]))


def test_metadata_must_be_json(tmp_path: Path) -> None:
    before: list[list[str]] = []  # what the checkpoint directory held each time before_save ran
    checkpointer = TrainCheckpointer(
        tmp_path, CheckpointConfig(async_save=False), before_save=lambda: before.append(sorted(os.listdir(tmp_path)))
    )
    with pytest.raises(TypeError, match="step 1 is not JSON-serialisable"):
        checkpointer.save(1, {"x": jnp.ones(2)}, {"bad": object()})
    target = {
        "x": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    }
    with pytest.raises(FileNotFoundError, match="no training checkpoint"):
        checkpointer.restore(target)
    checkpointer.save(5, {"x": jnp.ones(2)}, {})
    with pytest.raises(ValueError, match="step 3 is older than the newest checkpoint 5"):
        checkpointer.save(3, {"x": jnp.ones(2)}, {})
    checkpointer.save(5, {"x": jnp.ones(2)}, {})  # exists: not written, nothing to run before it
    checkpointer.close()
    assert len(before) == 1 and "5" not in before[0]  # once, before checkpoint 5 was written


def test_sigint_requests_a_stop_and_a_second_one_interrupts() -> None:
    stops = StopControl(TrainerProcesses(), train_steps=10, max_skipped_steps=3, updates_per_step=1)
    # the handler a process starts with (what the test's own process has may have been changed by others)
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with stops.watching_signals([signal.SIGINT]):
            assert stops.go_on(1) and not stops.requested()
            # raise_signal: to this (the main) thread, so the handler has run when it returns; os.kill may land
            # on another thread of the process (JAX's, gcsfs's), and the main thread runs the handler later
            signal.raise_signal(signal.SIGINT)
            assert stops.requested() and not stops.go_on(1) and stops.stopped_by_request
            assert stops.describe() == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, original)


def test_stop_control_ends_at_the_steps_and_on_every_update_skipped() -> None:
    stops = StopControl(TrainerProcesses(), train_steps=3, max_skipped_steps=2, updates_per_step=2)
    assert stops.go_on(2) and not stops.go_on(3)
    stops.count_skipped(2)
    stops.count_skipped(1)  # one update applied: the count starts again
    stops.count_skipped(2)
    with pytest.raises(RunFailed, match="every update of the last 2 steps was skipped"):
        stops.count_skipped(2)
    assert not stops.requested()
    stops.failed = lambda: True
    assert stops.requested() and not stops.stopped_by_request  # a failed rollout side stops the waits


@pytest.mark.multiprocess
def test_sigterm_saves_exits_cleanly_and_the_checkpoint_restores(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "train_checkpoint_worker.py"), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.strip() == "step 3":
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("saved ")
    step = int(last.split()[1])
    assert step >= 3

    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))  # 8 devices here, 2 in the worker
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))}
    restored = TrainCheckpointer(tmp_path).restore(target)
    assert restored.step == step and restored.verified  # the manifest was written before the worker exited
    assert restored.metadata == {"policy_version": step, "step": step}
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full((8, 4), float(step)))


def test_checkpoints_and_weight_versions_keep_their_orbax_barriers_apart(tmp_path: Path) -> None:
    """Orbax names cross-process barriers by fixed strings; a trainer over several processes saves weight
    versions and checkpoints at once, and with one namespace their barriers met and deadlocked (seen in
    test_distributed_trainer: 'Barrier ThreadSaveMultiHostValueHolder:set_value_start is already ongoing')."""
    from areal_jax.weights import OrbaxWeightPublisher

    checkpointer = TrainCheckpointer(tmp_path / "checkpoints", CheckpointConfig(async_save=False))
    publisher = OrbaxWeightPublisher(tmp_path / "weights", async_save=False)
    try:
        prefixes = {
            manager._options.multiprocessing_options.barrier_sync_key_prefix
            for manager in (checkpointer._manager, publisher._manager)
        }
        assert len(prefixes) == 2 and None not in prefixes
    finally:
        checkpointer.close()
        publisher.close()


def test_latest_in_reads_a_live_run_whose_old_steps_are_being_removed(tmp_path: Path) -> None:
    """A reader (`eval` on a live run, a resuming launcher) lists the steps while the writer deletes the oldest
    ones (max_to_keep): a step that vanishes between the listing and its stat is not an error."""
    import threading

    directory = tmp_path / "checkpoints"
    checkpointer = TrainCheckpointer(directory, CheckpointConfig(max_to_keep=1, async_save=False))
    state = {"w": jnp.arange(4.0)}
    checkpointer.save(1, state, {"policy_version": 1})
    last = 40
    failures: list[BaseException] = []

    def write() -> None:
        try:
            for step in range(2, last + 1):
                checkpointer.save(step, state, {"policy_version": step})
        except BaseException as error:  # reported by the assertion below
            failures.append(error)

    writer = threading.Thread(target=write)
    writer.start()
    seen = []
    try:
        while writer.is_alive():
            seen.append(TrainCheckpointer.latest_in(directory))
    finally:
        writer.join()
        checkpointer.close()
    assert not failures, failures
    assert seen and all(step is not None and 1 <= step <= last for step in seen) and seen == sorted(seen), seen
    assert TrainCheckpointer.latest_in(directory) == last
