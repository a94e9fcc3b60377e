"""`areal-jax rollout`: one rollout server process of a run whose trainer is another process.

It waits for the trainer's first weight version in `<run>/weights`, loads it onto this host's devices and
runs its `RolloutSide` (`system/rollout_side.py`, server i of N: ids g % N == i, its share of the staleness
bound; where it goes on, its writer id, applying a version and the held-out evaluations are written there,
the same as in the one-process run). A follower thread polls the weight path (`weight_paths.py`: the
store, or the direct path's announcements beside it) and applies each new version. Its status file counts
the loads per path with the last one's load time and lag, which the trainer's metrics report. Its main loop
also exchanges admission floors with the other servers (`admission_floors.py`: what keeps the staleness
bound of one process over several servers), and a restarted server admits from the floor it published
before (`open_rollout_side(admits_from=...)`). The server ends when the trainer writes the stop marker,
when its prompts run out (`control/rollout-<i>.done`, its floor withdrawn first) or when its failure budget
is spent (`control/rollout-<i>.failed`, which stops the trainer too).

With `distributed.enabled` over several processes (hosts), the server is one program whose engine mesh
spans every process's devices: process 0 runs everything above on a `MirroredEngine`, the other processes
carry out its engine calls and weight loads (`mirrored_engine.py`) and write nothing; process 0's end ends
them, and process 0 exits (status 1) as soon as it loses one of them.

With `model.lora` a version carries the adapters alone: the engine first loads the run's base from its source
(`load_policy`: the HF checkpoint, warm start or seeded random init), every process of the server its own, and
serves each adapter version over it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine
from areal_jax.inference.serving_engine import ServingEngine
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.lora import adapter_state
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.rollout.rewards import Reward
from areal_jax.run_layout import EVAL_DIR
from areal_jax.sharding import make_mesh
from areal_jax.system import resources
from areal_jax.system.admission_floors import FloorExchange
from areal_jax.system.assembly import (
    abstract_policy,
    build_prompts,
    build_task_stream,
    build_tokenizer,
    build_workflow,
)
from areal_jax.system.cluster import (
    DIRECT_FALLBACKS,
    ControlFiles,
    initialize_distributed,
    weight_load_status,
)
from areal_jax.system.command_channel import CommandReceiver, CommandSender, PeerLost
from areal_jax.system.mirrored_engine import MirroredEngine, MirroredWeights, follow
from areal_jax.system.rollout_side import RolloutSide, open_rollout_side
from areal_jax.system.run_mirror import mirroring
from areal_jax.system.slowed_engine import slowed_for_benchmarks
from areal_jax.system.weight_paths import open_subscriber
from areal_jax.weights.base import WeightSubscriber, abstract_target

logger = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    """The server cannot start or go on (no weights appeared, its rollouts keep failing)."""


@dataclasses.dataclass
class RolloutServerSummary:
    server: int
    groups_written: int
    generation_tokens: int
    interruptions: int
    versions_loaded: int
    ended_by: str  # "stop", "done", "failed", "signal"


@dataclasses.dataclass(frozen=True)
class _Loaded:
    version: int
    source: str  # "orbax" or "direct"
    load_seconds: float
    lag_seconds: float | None  # from the version becoming loadable by that path to its use by the generator
    fell_back: bool  # a direct pull failed and the store delivered


def run_rollout_server(
    cfg: ExperimentConfig, server: int, stop_event: threading.Event | None = None
) -> RolloutServerSummary:
    """Serve rollouts for the trainer of `cfg.run_dir` until it stops (see the module docstring)."""
    servers = cfg.cluster.rollout_servers
    if not 0 <= server < servers:
        raise ConfigError("cluster.rollout_servers", f"value {servers} has no server {server} (0..{servers - 1})")
    initialize_distributed(cfg.distributed)
    stop_event = stop_event or threading.Event()
    tokenizer = build_tokenizer(cfg)
    mesh = make_mesh(cfg.mesh, jax.devices())  # with several processes: every process's devices
    policy = abstract_policy(cfg, tokenizer)
    engine = Engine(policy, cfg.rollout.engine, mesh)
    state, shardings = nnx.state(policy), engine.param_shardings
    if cfg.model.lora is not None:  # a LoRA version carries the adapters alone
        state, shardings = adapter_state(state), adapter_state(shardings)
    target = abstract_target(state, shardings)  # what each version is loaded onto
    base = _base_loader(cfg, mesh, tokenizer) if cfg.model.lora is not None else None
    if jax.process_count() == 1:
        with mirroring(cfg, only=frozenset({EVAL_DIR})):  # server 0's held-out evaluations, on a gs:// run
            return _serve(cfg, server, tokenizer, engine, target, stop_event, base)
    channel = _join_processes(cfg)
    if isinstance(channel, CommandReceiver):
        return _follow(cfg, server, engine, target, channel, stop_event, base)
    mirrored = MirroredEngine(engine, channel)
    ended_by = "failed"
    try:
        with mirroring(cfg, only=frozenset({EVAL_DIR})):
            summary = _serve(cfg, server, tokenizer, mirrored, target, stop_event, base)
        ended_by = summary.ended_by
        return summary
    finally:
        mirrored.stop(ended_by)  # every other process ends with process 0


def _serve(
    cfg: ExperimentConfig,
    server: int,
    tokenizer: Any,
    engine: ServingEngine,
    target: Any,
    stop_event: threading.Event,
    load_base: Callable[[], nnx.State] | None,
) -> RolloutServerSummary:
    """The server on `engine` (process 0's, when the server spans several processes); `load_base` loads a LoRA
    run's base, which the engine serves every adapter-only version over."""
    servers = cfg.cluster.rollout_servers
    control = ControlFiles(cfg.run_location, servers)
    subscriber = _wait_for_trainer(control, cfg.layout.weights, cfg, server, stop_event)
    if subscriber is None:
        return RolloutServerSummary(server, 0, 0, 0, 0, ended_by="signal")
    if isinstance(engine, MirroredEngine):
        subscriber = MirroredWeights(subscriber, engine)
    if load_base is not None:  # versions carry adapters alone: the base comes once from the run's source
        if isinstance(engine, MirroredEngine):
            engine.load_base(load_base)  # on every process of the server
        else:
            engine.load_params(load_base(), -1)
    resources.record(cfg.run_location, resources.rollout_role(server), jax.local_devices())
    try:
        with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
            train_prompts, heldout = build_prompts(cfg, workflow)
            stream = build_task_stream(cfg, train_prompts)
            with open_rollout_side(
                cfg,
                slowed_for_benchmarks(engine, server),
                *_newest(subscriber, target),
                workflow,
                stream,
                heldout,
                server=server,
                servers=servers,
                admits_from=control.floor(server) or 0,  # a restarted server keeps the floor it published
            ) as side:  # the newest version's params are a temporary: the engine's copy is the only one kept
                return _serve_side(cfg, server, control, subscriber, engine, side, target, stop_event)
    finally:
        subscriber.close()


def _serve_side(
    cfg: ExperimentConfig,
    server: int,
    control: ControlFiles,
    subscriber: WeightSubscriber,
    engine: ServingEngine,
    side: RolloutSide,
    target: Any,
    stop_event: threading.Event,
) -> RolloutServerSummary:
    loaded: queue.Queue[_Loaded] = queue.Queue()
    follower = _WeightFollower(subscriber, side, target, cfg, side.generator.version, loaded, stop_event)
    follower.start()
    floors = FloorExchange(control, server, side.staleness)
    serving = _Serving(cfg, server, control, side, loaded, floors)
    try:
        ended_by = serving.run(stop_event)
    finally:
        stop_event.set()
        follower.join()
        side.controller.stop()
        serving.write_status()
    if follower.error is not None:  # not the rollouts' fault: the launcher restarts the server
        raise RolloutServerError(f"loading new weights failed: {follower.error}") from follower.error
    if ended_by == "failed" and isinstance(engine, MirroredEngine) and engine.lost is not None:
        raise RolloutServerError(engine.lost)  # the failures were the lost process's, not the rollouts'
    if ended_by == "failed":
        control.mark_failed(server, str(side.failure))
        raise RolloutServerError(str(side.failure))
    if ended_by == "done":
        floors.withdraw()
        control.mark_done(server)
    return RolloutServerSummary(
        server=server,
        groups_written=side.groups_written,
        generation_tokens=side.generator.stats.emitted_tokens,
        interruptions=side.generator.stats.interruptions,
        versions_loaded=serving.versions_loaded,
        ended_by=ended_by,
    )


def _base_loader(cfg: ExperimentConfig, mesh: Mesh, tokenizer: Any) -> Callable[[], nnx.State]:
    """What loads a LoRA run's base onto the engine's `mesh`: the run's starting policy, as the trainer loads it."""
    return lambda: nnx.state(load_policy(cfg, mesh, tokenizer))


def _newest(subscriber: WeightSubscriber, target: Any) -> tuple[Any, int]:
    """The newest version's params, loaded as `target` says, and its number."""
    latest = subscriber.latest_version()
    assert latest is not None  # the trainer publishes a version before it says it is ready (`_wait_for_trainer`)
    weights = subscriber.load(latest, target)
    return weights.params, weights.version


def _join_processes(cfg: ExperimentConfig) -> CommandSender | CommandReceiver:
    """Connect the server's processes: process 0 listens, shares its address and the channel's secret (a
    collective: in memory, never on disk), the others connect (`command_channel.py`)."""
    processes = TrainerProcesses()
    timeout = cfg.distributed.peer_timeout_s
    if not processes.primary:
        address, secret = processes.share(None)
        try:
            return CommandReceiver(address, bytes.fromhex(secret), processes.index, timeout)
        except OSError as err:
            raise RolloutServerError(f"process {processes.index} cannot reach process 0 at {address}: {err}") from err
    sender = CommandSender(_reachable_host(cfg), processes.count - 1, timeout, _exit_on_lost)
    processes.share([sender.address, sender.secret.hex()])
    try:
        sender.accept(timeout)
    except PeerLost as err:
        raise RolloutServerError(str(err)) from err
    logger.info("rollout server over %d processes: the others follow process 0's commands", processes.count)
    return sender


def _reachable_host(cfg: ExperimentConfig) -> str:
    """Process 0's address as the other processes reach it: the coordinator's host (process 0 runs the
    coordinator), else the address of this host's name."""
    coordinator = cfg.distributed.coordinator_address
    if coordinator:
        return coordinator.rsplit(":", 1)[0].strip("[]")
    return socket.gethostbyname(socket.gethostname())


def _exit_on_lost(message: str) -> None:
    """Process 0 lost another process: every collective would now hang or fail, so the server ends at once
    (status 1); the launcher restarts it whole and it re-issues its groups in flight (`resume_point`)."""
    logger.error("rollout server lost a process: %s; exiting", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    print(f"areal-jax rollout: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def _follow(
    cfg: ExperimentConfig,
    server: int,
    engine: Engine,
    target: Any,
    receiver: CommandReceiver,
    stop_event: threading.Event,
    load_base: Callable[[], nnx.State] | None,
) -> RolloutServerSummary:
    """A process > 0 of the server: carries out process 0's engine commands until its stop (`load_base`: a LoRA
    run's base, loaded when process 0 loads its own); writes nothing but the record of its devices (for
    `areal-jax plan`)."""
    resources.record(cfg.run_location, resources.rollout_role(server), jax.local_devices())
    subscriber: WeightSubscriber | None = None
    versions = 0

    def restore(version: int) -> Any:
        nonlocal subscriber, versions
        subscriber = subscriber or open_subscriber(cfg, server)  # the store exists once process 0 names a version
        weights = subscriber.load(version, target)
        if weights.version != version:
            raise RolloutServerError(f"weights version {version} vanished before process {jax.process_index()} read it")
        versions += 1
        return weights.params

    try:
        ended_by = follow(engine, receiver, restore, stop_event.is_set, load_base)
    except PeerLost as err:
        raise RolloutServerError(str(err)) from err
    finally:
        receiver.close()
        if subscriber is not None:
            subscriber.close()
    logger.info("process %d of rollout server %d: process 0 ended (%s)", jax.process_index(), server, ended_by)
    return RolloutServerSummary(server, 0, 0, 0, versions, ended_by=ended_by)


def _wait_for_trainer(
    control: ControlFiles, directory: str, cfg: ExperimentConfig, server: int, stop_event: threading.Event
) -> WeightSubscriber | None:
    """The trainer's weight path once the trainer says it is ready (it creates or restores the run and
    publishes its version first); None when stopped first."""
    deadline = time.monotonic() + cfg.cluster.start_timeout_s
    while control.ready_trainer() is None or not storage.is_dir(directory):
        if stop_event.wait(cfg.cluster.weights_poll_s):
            return None
        if time.monotonic() > deadline:
            raise RolloutServerError(
                f"no weight version appeared in {directory} within cluster.start_timeout_s="
                f"{cfg.cluster.start_timeout_s} s: is the trainer (`areal-jax trainer`) running on this run?"
            )
    return open_subscriber(cfg, server)


class _WeightFollower(threading.Thread):
    """Polls the weight path and applies each new version to the rollout side."""

    def __init__(
        self,
        subscriber: WeightSubscriber,
        side: RolloutSide,
        target: Any,
        cfg: ExperimentConfig,
        version: int,
        loaded: queue.Queue[_Loaded],
        stop_event: threading.Event,
    ):
        super().__init__(name="areal-weights", daemon=True)
        self.subscriber, self.side, self.target, self.version = subscriber, side, target, version
        self.loaded, self.stop_event = loaded, stop_event
        self.poll = cfg.cluster.weights_poll_s
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                newest = self.subscriber.wait_for_version(self.version + 1, timeout_s=self.poll)
                if newest is None:
                    continue
                weights = self.subscriber.load(newest, self.target)
                self.side.apply(weights.params, weights.version)
                self.version = weights.version
                lag = time.time() - weights.published_at if weights.published_at is not None else None
                self.loaded.put(_Loaded(weights.version, weights.source, weights.seconds, lag, weights.fell_back))
                del weights  # the generator holds the version now
        except BaseException as err:  # reported by the server's loop, which stops the server
            logger.exception("loading new weights failed")
            self.error = err
            self.stop_event.set()


class _Serving:
    """The server's main loop: status files, the admission floors and the end of serving."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        server: int,
        control: ControlFiles,
        side: RolloutSide,
        loaded: queue.Queue[_Loaded],
        floors: FloorExchange,
    ):
        self.cfg, self.server, self.control, self.side, self.loaded = cfg, server, control, side, loaded
        self.floors = floors
        self.versions_loaded = 0
        self.loads_by_source: dict[str, int] = {}
        self.weights: dict[str, float] = {DIRECT_FALLBACKS: 0} if cfg.cluster.weight_transfer == "direct" else {}

    def run(self, stop_event: threading.Event) -> str:
        every = self.cfg.cluster.status_every_s
        next_status = 0.0
        while True:
            if self.side.failure is not None:
                return "failed"
            if self.control.stop_requested():
                return "stop"
            if self.side.exhausted.is_set():
                return "done"
            if stop_event.is_set():
                return "signal"
            self.floors.exchange()
            try:
                news = self.loaded.get(timeout=min(every, self.cfg.cluster.floors_poll_s))
            except queue.Empty:
                news = None
            if news is not None:
                self._count_load(news)
            if time.monotonic() >= next_status:
                self.write_status()
                next_status = time.monotonic() + every

    def _count_load(self, news: _Loaded) -> None:
        self.versions_loaded += 1
        loads = self.loads_by_source[news.source] = self.loads_by_source.get(news.source, 0) + 1
        self.weights.update(weight_load_status(news.source, loads, news.load_seconds, news.lag_seconds))
        self.weights["weights_version"] = news.version
        if news.fell_back:
            self.weights[DIRECT_FALLBACKS] = self.weights.get(DIRECT_FALLBACKS, 0) + 1

    def write_status(self) -> None:
        side = self.side
        self.control.write_status(
            self.server,
            {
                **dataclasses.asdict(side.generator.stats),
                **self.weights,
                "accepted": side.controller.stats.accepted,
                "failed": side.controller.stats.failed,
                "untrained": side.controller.stats.dropped,
                "next_group_id": side.next_group_id,
                "queue": side.generator.num_in_flight(),
                "pid": os.getpid(),
            },
        )
