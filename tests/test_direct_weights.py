"""The direct weight path (JAX's transfer server) beside the Orbax store: bit-identical delivery across
processes and layouts, the fall-back to the store, offers that expire, and its config and metrics."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.storage import write_json_atomic
from areal_jax.system.cluster import weight_load_status, weight_path_stats
from areal_jax.system_config import ClusterConfig
from areal_jax.weights import OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target
from areal_jax.weights.direct import DirectWeightPublisher, DirectWeightSubscriber, read_announcement
from areal_jax.weights.pieces import offered_pieces, plan_leaf
from tests import direct_trainer_worker
from tests.direct_weights_worker import as_bytes, source_params
from tests.test_weights import worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "direct_weights_worker.py")
TRAINER_WORKER = str(ROOT / "tests" / "direct_trainer_worker.py")


def _start_worker(run: Path, puller: int, devices: int, out: Path, plan: list[str]) -> subprocess.Popen:
    command = [sys.executable, WORKER, str(run), str(puller), str(out), *plan]
    return subprocess.Popen(command, env=worker_env(devices), stdout=subprocess.PIPE, text=True)


def _expect_line(worker: subprocess.Popen, line: str) -> None:
    got = worker.stdout.readline().strip()
    while got.startswith("[Gloo]"):  # gloo's own report of its connections (trainer processes)
        got = worker.stdout.readline().strip()
    assert got == line, f"worker said {got!r}, expected {line!r} (exit status {worker.poll()})"


@pytest.mark.multiprocess
def test_direct_and_orbax_deliver_bit_identical_weights_to_two_servers_on_other_layouts(tmp_path: Path) -> None:
    """The trainer (this process) holds params on a 2-device mesh; server 0 (1 device) loads every version
    whole on one device, server 1 (4 devices) loads version 1 cut another way (resharded on arrival) and
    version 2 cut as the trainer's (pieces land as its own shards). Each version is pulled directly by both
    servers and restored from the store by both: every byte agrees with what was published."""
    publisher = DirectWeightPublisher(
        tmp_path / "announcement.json", OrbaxWeightPublisher(tmp_path / "weights"), pullers=2, timeout_s=30
    )
    workers = [
        _start_worker(tmp_path, 0, 1, tmp_path / "server0.npz", ["1:one", "2:one"]),
        _start_worker(tmp_path, 1, 4, tmp_path / "server1.npz", ["1:four", "2:same"]),
    ]
    published = {}
    try:
        for worker in workers:
            _expect_line(worker, "ready")
        for version in (1, 2):
            published[version] = source_params(jax.devices()[:2], version)
            publisher.publish(published[version], version)
            for worker in workers:  # both take version 1 before version 2 replaces the announcement
                _expect_line(worker, f"loaded {version}")
        for worker in workers:
            assert worker.wait(timeout=60) == 0
    finally:
        for worker in workers:
            worker.kill()
        publisher.close()
    for out in ("server0.npz", "server1.npz"):
        loaded = dict(np.load(tmp_path / out))
        for version, params in published.items():
            assert str(loaded[f"source/{version}"]) == "direct", (out, version)
            for key, value in params.items():
                expected = as_bytes(value)
                np.testing.assert_array_equal(loaded[f"direct/{version}/{key}"], expected, err_msg=f"{out} {key}")
                np.testing.assert_array_equal(loaded[f"orbax/{version}/{key}"], expected, err_msg=f"{out} {key}")


@pytest.mark.multiprocess
def test_a_trainer_over_two_processes_serves_each_piece_once_from_both(tmp_path: Path) -> None:
    """Two trainer processes (`jax.distributed`, 2 devices each) publish 2 versions of leaves cut across
    both, within each, and replicated; this process pulls each from both processes onto another layout
    (version 1 on 2 devices cut another way, version 2 whole on one device): the bytes are the published
    values and the store's copy, each piece was offered once over both processes, replicas by process 0."""
    port = _free_port()
    command = [sys.executable, TRAINER_WORKER, str(tmp_path), f"127.0.0.1:{port}"]
    trainers = [
        subprocess.Popen(
            [*command, str(process), "2"], env=worker_env(2), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for process in range(2)
    ]
    announcement = tmp_path / "announcement.json"
    store = OrbaxWeightSubscriber(tmp_path / "weights")
    subscriber = DirectWeightSubscriber(announcement, store, puller=0, timeout_s=60, poll_s=0.01)
    leaves = direct_trainer_worker.LEAVES
    mesh = Mesh(np.array(jax.devices()[2:4]), ("x",))
    layouts = {
        1: {"embed": P(None, "x"), "kernel": P("x", None), "counts": P(None, "x"), "rows": P("x"), "norm": P("x")},
        2: dict.fromkeys(leaves, P()),
    }
    try:
        for trainer in trainers:
            _expect_line(trainer, "ready")
        for version, specs in layouts.items():
            for trainer in trainers:
                trainer.stdin.write(f"{version}\n")
                trainer.stdin.flush()
            for trainer in trainers:
                _expect_line(trainer, f"published {version}")
            announced = read_announcement(announcement)
            assert announced.version == version and len(announced.sources) == 2
            offered = [piece for source in announced.sources for piece in source.pieces]
            every = [(leaf, piece) for leaf, spec in enumerate(announced.leaves) for piece in range(len(spec.pieces))]
            assert sorted(offered) == every  # the sources partition every leaf's pieces
            names = [path.strip("[']") for path in announced.paths]
            for name, counts in direct_trainer_worker.OFFERED.items():
                by_source = [sum(names[leaf] == name for leaf, _ in source.pieces) for source in announced.sources]
                assert tuple(by_source) == counts, name

            devices = mesh if version == 1 else Mesh(np.array(jax.devices()[5:6]), ("x",))
            target = {
                name: jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=NamedSharding(devices, specs[name]))
                for name, (shape, dtype, _) in leaves.items()
            }
            assert subscriber.wait_for_version(version, timeout_s=30) == version
            pulled = subscriber.load(version, target)
            assert (pulled.version, pulled.source, pulled.fell_back) == (version, "direct", False)
            assert store.wait_for_version(version, timeout_s=30) == version
            stored = store.load(version, target)
            for name, value in direct_trainer_worker.known_values(version).items():
                assert pulled.params[name].sharding == target[name].sharding, name
                np.testing.assert_array_equal(as_bytes(pulled.params[name]), as_bytes(value), err_msg=name)
                np.testing.assert_array_equal(as_bytes(stored.params[name]), as_bytes(value), err_msg=name)
        for trainer in trainers:
            trainer.stdin.close()
        for trainer in trainers:
            assert trainer.wait(timeout=60) == 0
    finally:
        for trainer in trainers:
            trainer.kill()
        subscriber.close()
    assert not announcement.exists()  # process 0 removed it when it closed


def assert_same_bytes(got: dict[str, jax.Array], want: dict[str, jax.Array]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(as_bytes(got[key]), as_bytes(want[key]), err_msg=key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_direct_pull_falls_back_to_the_store_within_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Taken, incompatible (another transfer server shape, other leaves, pieces offered twice or by no
    source) and unreachable offers each cost at
    most the timeout, then the store delivers the same version; a subscriber opened after an announcement
    loads that version from the store (a restarted server); a version on neither path is an error, not a
    hang."""
    timeout = 1.0
    announcement = tmp_path / "announcement.json"
    publisher = DirectWeightPublisher(  # offers outlive the synchronous store save that follows them
        announcement, OrbaxWeightPublisher(tmp_path / "weights", async_save=False), pullers=1, timeout_s=60
    )
    subscribers = [  # the first one's pulls must succeed even on a loaded machine; the second one's fail fast
        DirectWeightSubscriber(announcement, OrbaxWeightSubscriber(tmp_path / "weights"), puller=0, timeout_s=t)
        for t in (60, timeout)
    ]
    first, second = subscribers
    params = {v: source_params(jax.devices()[:2], v) for v in (1, 2, 3)}
    target = abstract_target(params[1])
    try:
        publisher.publish(params[1], 1)
        assert first.latest_version() == 1
        pulled = first.load(1, target)
        assert (pulled.source, pulled.fell_back) == ("direct", False)
        assert_same_bytes(pulled.params, params[1])

        started = time.monotonic()  # puller 0's offer of version 1 is taken: wait out the timeout, then the store
        fallback = second.load(1, target)
        assert (fallback.version, fallback.source, fallback.fell_back) == (1, "orbax", True)
        assert timeout <= time.monotonic() - started < timeout + 5
        assert_same_bytes(fallback.params, params[1])

        publisher.publish(params[2], 2)
        forged = read_announcement(announcement).to_json()
        write_json_atomic(announcement, {**forged, "streams": forged["streams"] + 1})
        started = time.monotonic()  # a transfer server of another shape: refused before dialling it
        fallback = second.load(2, target)
        assert (fallback.version, fallback.source, fallback.fell_back) == (2, "orbax", True)
        assert time.monotonic() - started < timeout
        assert_same_bytes(fallback.params, params[2])
        renamed = ["['renamed']", *forged["paths"][1:]]
        write_json_atomic(announcement, {**forged, "paths": renamed})
        started = time.monotonic()  # leaves that do not match the target's by path: refused before pulling
        fallback = second.load(2, target)
        assert (fallback.version, fallback.source, fallback.fell_back) == (2, "orbax", True)
        assert time.monotonic() - started < timeout
        source = forged["sources"][0]
        for pieces in (source["pieces"][1:], [*source["pieces"], source["pieces"][0]]):
            write_json_atomic(announcement, {**forged, "sources": [{**source, "pieces": pieces}]})
            started = time.monotonic()  # a piece offered by no source, or twice: refused before pulling
            caplog.clear()
            fallback = first.load(2, target)  # (its offer of version 2 is still there)
            assert (fallback.version, fallback.source, fallback.fell_back) == (2, "orbax", True)
            assert time.monotonic() - started < timeout
            assert (
                f"must offer each of the {sum(len(leaf['pieces']) for leaf in forged['leaves'])} pieces" in caplog.text
            )

        publisher.publish(params[3], 3)
        forged = read_announcement(announcement).to_json()
        gone = [{**forged["sources"][0], "address": f"127.0.0.1:{_free_port()}"}]
        write_json_atomic(announcement, {**forged, "sources": gone})
        started = time.monotonic()  # the trainer is gone
        fallback = second.load(3, target)
        assert (fallback.version, fallback.source, fallback.fell_back) == (3, "orbax", True)
        assert timeout <= time.monotonic() - started < timeout + 5
        assert_same_bytes(fallback.params, params[3])

        late = DirectWeightSubscriber(announcement, OrbaxWeightSubscriber(tmp_path / "weights"), puller=0, timeout_s=1)
        subscribers.append(late)
        assert late.latest_version() == 3
        stored = late.load(3, target)
        assert (stored.source, stored.fell_back) == ("orbax", False)

        started = time.monotonic()
        with pytest.raises(RuntimeError, match="version 4 reached neither"):
            late.load(4, target)
        assert time.monotonic() - started < timeout + 5
    finally:
        for subscriber in subscribers:
            subscriber.close()
        publisher.close()
    assert not announcement.exists()


def _resident_bytes() -> int:
    """This process's resident memory, after handing the allocator's free pages back (so that noise from other
    threads' heap arenas does not read as held weights)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_the_store_gets_every_kth_version_and_a_later_server_catches_up_directly(tmp_path: Path) -> None:
    """With store_every = 3 the store gets the trainer's first version and then one every third; a server
    opened later starts from the newest stored version and takes the next offer directly."""
    announcement = tmp_path / "announcement.json"
    publisher = DirectWeightPublisher(
        announcement, OrbaxWeightPublisher(tmp_path / "weights"), pullers=1, timeout_s=30, store_every=3
    )
    params = {v: source_params(jax.devices()[:2], v) for v in range(2, 9)}
    target = abstract_target(params[2])
    late = None
    try:
        for version in range(2, 8):
            publisher.publish(params[version], version)
        publisher.wait()
        stored = OrbaxWeightSubscriber(tmp_path / "weights")
        assert stored._versions() == [2, 5]  # the first, then 3 versions on; 6 and 7 only offered
        late = DirectWeightSubscriber(announcement, stored, puller=0, timeout_s=30, poll_s=0.01)
        assert late.latest_version() == 5  # version 7 was announced before it opened
        first = late.load(5, target)
        assert (first.version, first.source) == (5, "orbax")
        publisher.publish(params[8], 8)  # 8 - 5 >= 3: stored too
        assert late.wait_for_version(6, timeout_s=30) == 8
        pulled = late.load(8, target)
        assert (pulled.version, pulled.source, pulled.fell_back) == (8, "direct", False)
        for name, leaf in params[8].items():
            np.testing.assert_array_equal(as_bytes(pulled.params[name]), as_bytes(leaf))
        publisher.wait()
        assert stored._versions()[-1] == 8
    finally:
        publisher.close()
        if late is not None:
            late.close()
    with pytest.raises(ConfigError) as info:
        load_experiment(None, ["cluster.direct_store_every=4"])  # the store is the only path under orbax
    assert info.value.key == "cluster.direct_store_every"
    direct = ["cluster.weight_transfer=direct", "rollout.staleness.max_head_offpolicyness=2"]
    assert load_experiment(None, [*direct, "cluster.direct_store_every=3"]).cluster.direct_store_every == 3
    with pytest.raises(ConfigError, match=r"exceeds rollout.staleness.max_head_offpolicyness \+ 1 = 3") as info:
        load_experiment(None, [*direct, "cluster.direct_store_every=4"])  # a restarted server could wait forever
    assert info.value.key == "cluster.direct_store_every"


def test_offers_nobody_pulls_are_freed_once_expired(tmp_path: Path) -> None:
    """Two pullers share one copy per version; versions offered and never pulled (superseded, or their
    server dead) hold their copy until the timeout, and are freed when the next version is offered."""
    # two serves well within the timeout even under load; copies large against the process's RSS noise (CI saw
    # 33 MB of it, at 64 MB copies)
    timeout, megabytes = 5.0, 256
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    rows = megabytes * 2**20 // 4 // 1024
    value = np.random.default_rng(0).random((rows, 1024), np.float32)  # (pages of equal values may be shared)
    params = {"w": jax.device_put(value, NamedSharding(mesh, P("x")))}
    publisher = DirectWeightPublisher(
        tmp_path / "announcement.json", OrbaxWeightPublisher(tmp_path / "weights"), pullers=2, timeout_s=timeout
    )
    try:
        publisher.serve(params, 1)
        before = _resident_bytes()
        publisher.serve(params, 2)  # version 1's offers have not expired: two copies are held
        held = _resident_bytes() - before
        assert 0.75 * megabytes * 2**20 < held < 1.5 * megabytes * 2**20
        time.sleep(timeout + 0.2)
        publisher.serve(params, 3)  # drops the expired offers of versions 1 and 2
        deadline = time.monotonic() + 5
        while _resident_bytes() - before > megabytes * 2**20 / 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _resident_bytes() - before < megabytes * 2**20 / 4
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("source", "target_mesh", "target", "direct"),
    [
        (P("x", None), (2, 4), P("x", None), True),  # the same cut (each half held by 4 replicas)
        (P("x", "y"), (2, 4), P("x", "y"), True),
        (P("x", None), (4, 2), P(None, "x"), False),
        (P(), (4, 2), P("x", None), False),
        (P("x", "y"), (4, 2), P("y", None), False),
        (P("x", "y"), (4, 2), P("x", "y"), False),  # each target shard cut from parts of two pieces
        (P(None, "y"), (4, 2), P("y", "x"), False),
        (P("x", "y"), (1, 1), P(), False),
    ],
)
def test_pieces_rebuild_each_leaf_on_the_target_sharding(
    source: P, target_mesh: tuple[int, int], target: P, direct: bool
) -> None:
    """Without a transfer: the distinct shards of a leaf, placed as the plan says, rebuild it exactly on the
    target sharding (other devices, other order); straight into the target's own shards when the cuts agree."""
    devices = np.array(jax.devices()[:8])
    leaf = jax.device_put(
        np.arange(8 * 12, dtype=np.float32).reshape(8, 12),
        NamedSharding(Mesh(devices.reshape(2, 4), ("x", "y")), source),
    )
    size = target_mesh[0] * target_mesh[1]
    target_sharding = NamedSharding(Mesh(devices[::-1][:size].reshape(target_mesh), ("x", "y")), target)
    spec, shards = offered_pieces(leaf)
    assert len(spec.pieces) == len({str(s.index) for s in leaf.addressable_shards})  # each distinct index once
    assert [number for number, _ in shards] == list(range(len(spec.pieces)))  # one process: it offers them all
    plan = plan_leaf(spec, target_sharding)
    assert plan.direct == direct
    pulled = [jax.device_put(piece, device) for (_, piece), device in zip(shards, plan.devices, strict=True)]
    rebuilt = plan.build(pulled)
    assert rebuilt.sharding == target_sharding
    np.testing.assert_array_equal(np.asarray(rebuilt), np.asarray(leaf))


def test_weight_transfer_is_a_validated_option() -> None:
    assert ClusterConfig().weight_transfer == "orbax"
    with pytest.raises(ConfigError, match=r"weight_transfer.*'orbax', 'direct'"):
        ClusterConfig(weight_transfer="grpc")
    with pytest.raises(ConfigError) as info:
        load_experiment(None, ["cluster.weight_transfer=grpc"])
    assert info.value.key == "cluster.weight_transfer"
    with pytest.raises(ConfigError) as info:
        load_experiment(None, ["cluster.direct_timeout_s=0"])
    assert info.value.key == "cluster.direct_timeout_s"
    cfg = load_experiment(ROOT / "configs" / "train_cpu.yaml", ["cluster.weight_transfer=direct"])
    assert cfg.cluster.weight_transfer == "direct"


def test_the_trainer_reports_each_weight_path_over_all_servers() -> None:
    statuses = [
        {**weight_load_status("direct", 3, 0.2, 0.25), **weight_load_status("orbax", 1, 0.9, None)},
        {**weight_load_status("direct", 2, 0.4, 0.5), "weights_direct_fallbacks": 1},
        {"accepted": 4},  # a server that has loaded nothing new yet
    ]
    assert weight_path_stats(statuses) == {
        "weights/direct_loads": 5.0,
        "weights/direct_load_seconds_max": 0.4,
        "weights/direct_lag_seconds_max": 0.5,
        "weights/orbax_loads": 1.0,
        "weights/orbax_load_seconds_max": 0.9,
        "weights/direct_fallbacks": 1.0,
    }
    assert weight_path_stats([{"accepted": 1}]) == {}
