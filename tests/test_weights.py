"""Weight channel: Orbax across processes and mesh shapes, crash safety, version handling; the in-process publisher."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.init import create_decoder
from areal_jax.rollout.staleness import StalenessConfig, StalenessManager
from areal_jax.rollout.weight_versions import apply_version
from areal_jax.sharding import MeshConfig, make_mesh, split_devices, state_shardings
from areal_jax.weights import InProcessPublisher, OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target
from tests.conftest import CompileCounter
from tests.weights_worker import TINY, big_params, flat
from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "weights_worker.py")


def _in_process(generator: Generator, staleness: StalenessManager) -> InProcessPublisher:
    """The one-process run's publisher, applying each version as its rollout side does (`RolloutSide.apply`)."""
    return InProcessPublisher(lambda params, v: apply_version(generator, staleness, params, v, interrupt=True))


def worker_env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture(scope="module")
def params_2x4() -> nnx.State:
    """Real decoder params with their logical shardings on a 2x4 (fsdp x tensor) mesh, created once."""
    return nnx.state(create_decoder(TINY, 0, make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))), nnx.Param)


def on_mesh(params: nnx.State, mesh: jax.sharding.Mesh, offset: float = 0.0) -> nnx.State:
    """A copy of `params` placed by the logical rules on `mesh`, plus `offset` (a new 'version')."""
    moved = jax.device_put(params, state_shardings(params, mesh), may_alias=False)
    return jax.tree.map(lambda x: x + offset, moved) if offset else moved


def assert_trees_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.multiprocess
def test_publish_on_2x4_mesh_load_on_4x1_mesh_in_another_process(tmp_path: Path, params_2x4: nnx.State) -> None:
    params = params_2x4
    assert any(len(leaf.sharding.device_set) == 8 for leaf in jax.tree.leaves(params))
    publisher = OrbaxWeightPublisher(tmp_path / "weights")
    publisher.publish(params, 1)
    publisher.close()

    out = tmp_path / "loaded.npz"
    subprocess.run([sys.executable, WORKER, "load", str(tmp_path / "weights"), str(out)], env=worker_env(4), check=True)
    loaded = dict(np.load(out))
    assert int(loaded.pop("version")) == 1
    expected = flat(params)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)


def bytes_under(directory: Path) -> int:
    """Bytes of the files below `directory`; files that vanish meanwhile count 0."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


@pytest.mark.multiprocess
def test_publisher_killed_mid_save_never_exposes_that_version(tmp_path: Path) -> None:
    directory = tmp_path / "weights"
    megabytes = 128
    proc = subprocess.Popen(
        [sys.executable, WORKER, "publish-big", str(directory), str(megabytes)],
        env=worker_env(1),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "committed 1"

    seen: set[int | None] = set()
    stop = threading.Event()
    reader = OrbaxWeightSubscriber(directory)

    def poll() -> None:
        while not stop.wait(0.005):
            seen.add(reader.latest_version())

    poller = threading.Thread(target=poll)
    poller.start()
    tmp_dir, first_seen = None, None
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        # kill once version 2 has data on disk (or has been in the works for 0.1 s): before its commit
        found = [directory / n for n in os.listdir(directory) if n.startswith("2.orbax-checkpoint-tmp")]
        if found:
            first_seen = first_seen or time.monotonic()
            written = bytes_under(found[0])
            if written > 2**20 or time.monotonic() - first_seen > 0.1:
                tmp_dir = found[0]
                break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    stop.set()
    poller.join()
    assert tmp_dir is not None, "version 2 never started writing"
    assert tmp_dir.exists() and not (directory / "2").exists(), "the kill should land before the commit"
    assert seen == {1}

    fresh = OrbaxWeightSubscriber(directory)  # a reader that starts after the crash
    assert fresh.latest_version() == 1
    expected = big_params(megabytes, 1)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device) for k, v in expected.items()}
    loaded = fresh.load(1, target)
    assert loaded.version == 1
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[key]).view(np.uint32), value.view(np.uint32))

    publisher = OrbaxWeightPublisher(directory)  # the next publisher clears the leftover and goes on
    publisher.publish({k: jax.device_put(v[:10]) for k, v in big_params(1, 2).items()}, 2)
    publisher.close()
    assert not tmp_dir.exists()
    assert fresh.latest_version() == 2
    reader.close()
    fresh.close()


def test_published_arrays_can_be_donated_right_after_publish(tmp_path: Path, caplog, params_2x4: nnx.State) -> None:
    caplog.set_level(logging.INFO, logger="areal_jax.weights")
    params = on_mesh(params_2x4, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    expected = flat(params)
    target = abstract_target(params)
    publisher = OrbaxWeightPublisher(tmp_path)
    publisher.publish(params, 3)
    for leaf in jax.tree.leaves(params):
        leaf.delete()  # what donation to the next train step does
    publisher.close()
    loaded = OrbaxWeightSubscriber(tmp_path).load(3, target)
    assert flat(loaded.params).keys() == expected.keys()
    for key, value in flat(loaded.params).items():
        np.testing.assert_array_equal(value, expected[key])
    nbytes = sum(v.nbytes for v in expected.values())
    assert f"wrote weights version 3: {nbytes} bytes" in caplog.text
    assert f"loaded weights version 3: {nbytes} bytes" in caplog.text


def test_versions_polling_retention_and_a_vanished_version(tmp_path: Path, params_2x4: nnx.State) -> None:
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    subscriber = OrbaxWeightSubscriber(tmp_path / "w", poll_initial_s=0.01, poll_max_s=0.05)
    assert subscriber.latest_version() is None
    assert subscriber.wait_for_version(1, timeout_s=0.1) is None

    publisher = OrbaxWeightPublisher(tmp_path / "w", max_to_keep=2)
    states = {v: on_mesh(params_2x4, mesh, offset=v) for v in (1, 2, 3)}
    target = abstract_target(states[1])
    publisher.publish(states[1], 1)
    assert subscriber.wait_for_version(1, timeout_s=30) == 1
    with pytest.raises(ValueError, match="version 1 is not newer"):
        publisher.publish(states[1], 1)
    publisher.publish(states[2], 2)
    publisher.publish(states[3], 3)
    publisher.close()  # waits for the commit and for the background deletion of version 1
    assert subscriber.latest_version() == 3
    assert sorted(int(p.name) for p in (tmp_path / "w").iterdir() if p.name.isdigit()) == [2, 3]

    loaded = subscriber.load(1, target)  # version 1 was deleted after the reader chose it: the newest loads
    assert loaded.version == 3
    assert_trees_equal(loaded.params, states[3])
    with pytest.raises(Exception, match="4"):
        subscriber.load(4, target)
    with pytest.raises(ValueError, match="carries no sharding"):
        subscriber.load(3, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), states[3]))
    subscriber.close()


def test_polling_an_unchanged_local_store_does_not_ask_orbax_again(
    tmp_path: Path, params_2x4: nnx.State, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Orbax's listing reads every version's metadata; a reader polling a store where nothing changed (a
    rollout server waiting for the next version) must not pay it at every poll."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    publisher = OrbaxWeightPublisher(tmp_path / "w", max_to_keep=2)
    publisher.publish(on_mesh(params_2x4, mesh, offset=1), 1)
    publisher.wait()
    subscriber = OrbaxWeightSubscriber(tmp_path / "w", poll_initial_s=0.005, poll_max_s=0.005)
    reloads = []
    reload = subscriber._manager.reload

    def counted_reload() -> None:
        reloads.append(1)
        if len(reloads) == 1:  # what Orbax raises when a version directory vanishes while it is listed
            raise NotADirectoryError("Path is not a directory: .../weights/0")
        reload()

    monkeypatch.setattr(subscriber._manager, "reload", counted_reload)
    assert subscriber.latest_version() == 1  # listed again after the vanished version
    assert subscriber.wait_for_version(2, timeout_s=0.1) is None  # ~20 polls
    assert len(reloads) == 2
    publisher.publish(on_mesh(params_2x4, mesh, offset=2), 2)
    assert subscriber.wait_for_version(2, timeout_s=30) == 2  # the commit (a rename) is seen
    publisher.close()
    assert subscriber.latest_version() == 2
    subscriber.close()


@pytest.mark.parametrize("meshes", ["disjoint", "shared"])
def test_in_process_publisher_swaps_weights_then_admits(params_2x4: nnx.State, meshes: str) -> None:
    """The trainer's params reach the generator on its own shardings, stay valid after the trainer donates
    them, are used by the next request, and only then does the staleness manager hear the new version."""
    inference_devices, trainer_devices = split_devices(jax.devices(), 1, 1)
    if meshes == "shared":
        inference_devices = trainer_devices = jax.devices()
    trainer_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), trainer_devices)
    inference_mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), inference_devices)
    model = create_decoder(TINY, 0, inference_mesh)
    engine = Engine(model, EngineConfig(max_slots=2, max_length=32), inference_mesh)
    generator_version_at_admission: list[int] = []

    class Staleness(StalenessManager):
        def set_version(self, version: int) -> None:
            generator_version_at_admission.append(generator.version)
            super().set_version(version)

    staleness = Staleness(StalenessConfig(max_head_offpolicyness=0, batch_prompts=1))
    new = on_mesh(params_2x4, trainer_mesh, offset=1.0)
    expected = flat(new)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as generator:
        _in_process(generator, staleness).publish(new, 1)
        for leaf in jax.tree.leaves(new):
            leaf.delete()  # what donation to the next train step does
        assert generator_version_at_admission == [1] and staleness.snapshot().version == 1
        params = generator.params.state
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(engine.param_shardings), strict=True):
            assert got.sharding == want
        assert flat(params).keys() == expected.keys()
        for key, value in flat(params).items():
            np.testing.assert_array_equal(value, expected[key])
        (result,) = generator.submit([1, 2, 3], SamplingParams(max_new_tokens=3, seed=0)).result(timeout=120)
    assert result.output_versions == (1, 1, 1)


def test_in_process_publication_compiles_nothing_across_five_publishes(params_2x4: nnx.State) -> None:
    """Trainer and generator on the same devices (the case that needs a copy program): the engine's copy
    program, built by its first load, serves all five publishes; each still hands over its own values."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    engine = Engine(create_decoder(TINY, 0, mesh), EngineConfig(max_slots=2, max_length=32), mesh)
    staleness = StalenessManager(StalenessConfig(max_head_offpolicyness=0, batch_prompts=1))
    versions = {v: on_mesh(params_2x4, mesh, offset=float(v)) for v in range(1, 6)}
    expected = {v: flat(params) for v, params in versions.items()}
    compiles_after = []
    with Generator(engine, engine.load_params(params_2x4, 0)) as generator:
        publish = _in_process(generator, staleness).publish
        with CompileCounter() as compiles:
            for version, params in versions.items():
                publish(params, version)
                for leaf in jax.tree.leaves(params):
                    leaf.delete()  # what donation to the next train step does
                compiles_after.append(compiles.count)
                got = flat(generator.params.state)
                for key, value in expected[version].items():
                    np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert compiles_after == [0] * 5
