"""One inference engine over the devices of several processes, driven by process 0 (JetStream's multi-host
engine design): process 0 runs the generator and all rollout logic on a `MirroredEngine`; every other
process runs `follow`, which makes each of process 0's engine calls on its own `Engine` (same mesh, same
programs), so that every jitted program is entered by every process, in the same order, with the same
arguments.

Before each device call `MirroredEngine` sends the call's host-side arguments (prompts, slots, sampling
settings, key words, the decode step's cache bound) through the command channel (`command_channel.py`),
under one lock, so the order of the commands is the order in which process 0 enters the programs whatever
thread calls (the generator's loop, the weight loader). Device objects (params, prefix batches, decode
states) never travel: each gets a handle, the same number on every process; when process 0 drops one
(garbage-collected), its handle is released on the followers with the next command.

On CPU devices every call is completed before the next one starts, on every process: XLA:CPU's
cross-process collectives (gloo) hung here with tens of programs in flight (2 processes x 2 devices,
found with decode steps dispatched ahead of their reads); TPU and GPU runtimes order them on their streams.

Weights: each process restores a version from the store by itself (`OrbaxWeightSubscriber` with
`process_local`: its own shards, no collective). Process 0 decides which version: `MirroredWeights.load`
first tells the followers to start restoring it (in their own thread, while they keep following), and the
engine's `load_params` then makes every process place its restored copy. A LoRA run's versions carry adapters
alone: `load_base` first makes every process load the run's base from its source and place it (`follow`'s
`load_base`), as a one-process server's engine does, so each adapter version is served over it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import msgpack
import numpy as np
from flax import nnx

from areal_jax.inference.engine import (
    DecodeState,
    Engine,
    EngineConfig,
    PrefixBatch,
    ResultTokens,
    VersionedParams,
)
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.serving_engine import warm_up
from areal_jax.system.command_channel import CommandReceiver, CommandSender
from areal_jax.weights.base import LoadedWeights, WeightSubscriber

logger = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # a follower asked to stop (a signal) waits this long for process 0's stop first


class MirroredEngine:
    """Process 0's `Engine`: the calls the generator makes, each mirrored on every other process."""

    def __init__(self, engine: Engine, sender: CommandSender):
        self.engine = engine
        self._sender = sender
        self._lock = threading.Lock()
        self._next_handle = itertools.count()
        self._handles: dict[int, int] = {}  # id of a live device object -> its handle (under the lock only)
        # (id, handle) of collected objects: appended by finalizers on any thread, drained under the lock
        self._released: collections.deque[tuple[int, int]] = collections.deque()
        self._complete = completes_each_call(engine)
        self.commands = 0
        self.command_seconds = 0.0  # time spent encoding and sending commands

    # -- host-side attributes of the engine ---------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.engine.buckets

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        return self.engine.prefill_rows

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    def pad_tokens(self, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, int]:
        return self.engine.pad_tokens(tokens)

    @property
    def lost(self) -> str | None:
        """What was seen of a follower that is gone (None while all are there)."""
        return self._sender.lost

    # -- device calls: each one a command first ------------------------------------------------------

    def init_decode_state(self) -> DecodeState:
        with self._lock:
            handle = self._send("init")
            return self._register(self._done(self.engine.init_decode_state()), handle)

    def prepare_weights(self, version: int) -> None:
        """Tell the followers to start restoring `version` from the store (for a `load_params` soon)."""
        with self._lock:
            self._send("prepare", version)

    def load_params(self, state: nnx.State, version: int) -> VersionedParams:
        """Place `state` (version `version`, announced with `prepare_weights`): the followers place theirs."""
        with self._lock:
            handle = self._send("load", version)
            return self._register(self._done(self.engine.load_params(state, version)), handle)

    def load_base(self, load: Callable[[], nnx.State]) -> VersionedParams:
        """Place the full state `load()` returns (a LoRA run's base, version -1) as the engine's base: every
        follower loads its own (`follow`'s `load_base`) at the same time, since loading one onto a mesh over
        every process's devices takes every process."""
        with self._lock:
            handle = self._send("base")
            return self._register(self._done(self.engine.load_params(load(), -1)), handle)

    def prefill_batch(self, params: VersionedParams, prompts: Sequence[Sequence[int]]) -> PrefixBatch:
        with self._lock:
            handle = self._send("prefill", self._handle(params), [[int(t) for t in p] for p in prompts])
            return self._register(self._done(self.engine.prefill_batch(params, prompts)), handle)

    def insert_batch(
        self,
        prefixes: PrefixBatch,
        decode_state: DecodeState,
        slots: Sequence[int | None],
        samplings: Sequence[SamplingParams],
        key_data: np.ndarray,
        pages: Sequence[Sequence[int]] | None = None,
    ) -> DecodeState:
        key_data = np.asarray(key_data, np.uint32)
        with self._lock:
            handle = self._send(
                "insert",
                self._handle(prefixes),
                self._handle(decode_state),
                list(slots),
                [[s.temperature, s.top_k, s.top_p] for s in samplings],
                list(key_data.shape),
                key_data.tobytes(),
                None if pages is None else [[int(page) for page in row] for row in pages],
            )
            result = self.engine.insert_batch(prefixes, decode_state, slots, samplings, key_data, pages)
            return self._register(self._done(result), handle)

    def generate(
        self,
        params: VersionedParams,
        decode_state: DecodeState,
        max_position: int | None = None,
        page_updates: np.ndarray | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        updates = None if page_updates is None else np.ascontiguousarray(page_updates, np.int32)
        wire = None if updates is None else [list(updates.shape), updates.tobytes()]
        with self._lock:
            handle = self._send("generate", self._handle(params), self._handle(decode_state), max_position, wire)
            new_state, emitted = self._done(self.engine.generate(params, decode_state, max_position, updates))
            return self._register(new_state, handle), emitted

    def warmup(self, params: VersionedParams) -> None:
        """`Engine.warmup` (the generator's programs), each call mirrored."""
        warm_up(self, params)

    def stop(self, reason: str) -> None:
        """End every follower (the last command) and close the channel."""
        with self._lock:
            self._sender.close(self._encode("stop", None, (reason,)))

    def _done(self, result: Any) -> Any:
        return jax.block_until_ready(result) if self._complete else result

    # -- handles -----------------------------------------------------------------------------------

    def _send(self, op: str, *args: Any) -> int:
        handle = next(self._next_handle)
        started = time.perf_counter()
        self._sender.send(self._encode(op, handle, args))
        self.commands += 1
        self.command_seconds += time.perf_counter() - started
        return handle

    def _encode(self, op: str, handle: int | None, args: Sequence[Any]) -> bytes:
        released = []
        while self._released:
            key, old = self._released.popleft()
            if self._handles.get(key) == old:  # not yet taken by a newer object with the same id
                del self._handles[key]
            released.append(old)
        return msgpack.packb([op, handle, list(args), released], use_bin_type=True)

    def _register(self, value: Any, handle: int) -> Any:
        key = id(value)
        self._handles[key] = handle
        weakref.finalize(value, self._release, key, handle)
        return value

    def _release(self, key: int, handle: int) -> None:
        # Runs when `value` is collected, on any thread (maybe inside a command, holding the lock): it only
        # queues the release; `_encode`, under the lock, drops the entry and tells the followers.
        self._released.append((key, handle))

    def _handle(self, value: Any) -> int:
        try:
            return self._handles[id(value)]
        except KeyError:
            raise ValueError(f"{type(value).__name__} was not made by this MirroredEngine") from None


class MirroredWeights:
    """Process 0's weight subscriber: each version it loads, the followers restore too (see module doc)."""

    def __init__(self, subscriber: WeightSubscriber, engine: MirroredEngine):
        self.subscriber, self.engine = subscriber, engine

    def latest_version(self) -> int | None:
        return self.subscriber.latest_version()

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int | None:
        return self.subscriber.wait_for_version(min_version, timeout_s)

    def load(self, version: int, target: Any) -> LoadedWeights:
        self.engine.prepare_weights(version)
        weights = self.subscriber.load(version, target)
        if weights.version != version:  # it vanished while read: the newest came instead
            self.engine.prepare_weights(weights.version)
        return weights

    def close(self) -> None:
        self.subscriber.close()


def follow(
    engine: Engine,
    receiver: CommandReceiver,
    restore: Callable[[int], nnx.State],
    stop_requested: Callable[[], bool] = lambda: False,
    load_base: Callable[[], nnx.State] | None = None,
) -> str:
    """Make process 0's engine calls on `engine` until its stop command (returns its reason). `restore`
    loads a weight version from the store onto `engine.param_shardings` (run in a helper thread); `load_base`
    loads a LoRA run's base (`MirroredEngine.load_base`). A stop request here (a signal) ends following after
    `STOP_GRACE_S` without process 0's stop ('signal')."""
    objects: dict[int, Any] = {}
    restores: dict[int, concurrent.futures.Future[nnx.State]] = {}
    stop_since: float | None = None
    complete = completes_each_call(engine)
    with concurrent.futures.ThreadPoolExecutor(1, "areal-restore") as pool:
        while True:
            frame = receiver.receive(timeout_s=0.5)
            if frame is None:
                if stop_requested():
                    stop_since = stop_since or time.monotonic()
                    if time.monotonic() - stop_since > STOP_GRACE_S:
                        logger.warning("stopping without process 0's stop (%.0f s after a signal)", STOP_GRACE_S)
                        return "signal"
                continue
            op, handle, args, released = msgpack.unpackb(frame, raw=False)
            for old in released:
                objects.pop(old, None)
            match op:
                case "init":
                    objects[handle] = engine.init_decode_state()
                case "prepare":
                    (version,) = args
                    restores[version] = pool.submit(restore, version)
                case "load":
                    (version,) = args
                    state = restores.pop(version).result()
                    for older in [v for v in restores if v < version]:
                        restores.pop(older)
                    objects[handle] = engine.load_params(state, version)
                case "base":
                    if load_base is None:
                        raise ValueError("process 0 loads a LoRA base but this process was given none to load")
                    objects[handle] = engine.load_params(load_base(), -1)
                case "prefill":
                    params, prompts = args
                    objects[handle] = engine.prefill_batch(objects[params], prompts)
                case "insert":
                    prefixes, state, slots, samplings, shape, key_bytes, pages = args
                    key_data = np.frombuffer(key_bytes, np.uint32).reshape(shape)
                    settings = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in samplings]
                    objects[handle] = engine.insert_batch(
                        objects[prefixes], objects.pop(state), slots, settings, key_data, pages
                    )
                case "generate":
                    params, state, max_position, wire = args
                    updates = None if wire is None else np.frombuffer(wire[1], np.int32).reshape(wire[0])
                    objects[handle], _ = engine.generate(objects[params], objects.pop(state), max_position, updates)
                case "stop":
                    return args[0]
                case _:
                    raise ValueError(f"unknown command {op!r} from process 0")
            if complete and handle in objects:
                jax.block_until_ready(objects[handle])
            receiver.done += 1


def completes_each_call(engine: Engine) -> bool:
    """Whether calls must complete one by one (an engine on CPU devices: see the module docstring)."""
    devices = [engine.device] if engine.mesh is None else engine.mesh.devices.flat
    return next(iter(devices)).platform == "cpu"
