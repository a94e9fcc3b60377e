"""The direct weight path: each version pulled from the trainer's memory by JAX's transfer server
(`jax.experimental.transfer`), beside the durable Orbax store.

The trainer's `DirectWeightPublisher` copies every new version (the trainer donates its params right after
`publish`), cuts it into single-device pieces (`pieces.py`), offers them once to each of the `pullers`
rollout servers under its own uuid, and announces the version in a small JSON file (address, uuids, the
pieces of every leaf) written to a temporary name and renamed. Then it saves the same version into the
Orbax store as before. A rollout server's `DirectWeightSubscriber` reads the announcement, pulls its uuid
onto its own devices (resharding on arrival where its layout cuts the leaves differently) and falls back to
the store when the pull fails. How JAX's transfer server behaves, as measured on jax 0.10.2 (CPU):

- one `await_pull` serves exactly one pull of its uuid; another pull of that uuid waits for the next
  `await_pull` of it, so each puller has its own uuid per version;
- a pull lands shard by shard into a destination with the same shard sizes (no resharding), but a
  single-device piece may land on any device;
- the offered buffers stay alive until pulled or expired even when Python drops them, but a deleted
  (donated) buffer fails the pull: hence the copy;
- timeouts act lazily: an expired offer (or waiting pull) is dropped only when the server's table next sees
  activity (the next version's offers); a waiting pull never times out on the reader by itself, so the
  subscriber enforces its own deadline and then abandons the pull;
- both ends must bind the same number of transport addresses (`TRANSPORT_STREAMS`): a mismatch aborts the
  process, so the announcement carries the number and a subscriber refuses a different one.

So a version nobody pulls (superseded, or its server dead) holds its copy until `timeout_s` after it was
offered and the next version is published; a server that asks for a taken, expired or unreachable offer
gives up after `timeout_s` and loads the version from the store. A (re)started server loads from the store
every version announced before it opened: an earlier incarnation of it may have taken that offer.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import transfer

from areal_jax.sharding import copy_to
from areal_jax.system.cluster import read_json, write_json_atomic
from areal_jax.weights.base import LoadedWeights, poll_for_version, target_shardings, tree_nbytes
from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber
from areal_jax.weights.pieces import LeafPlan, LeafSpec, distinct_shards, plan_leaf

logger = logging.getLogger(__name__)

TRANSPORT_STREAMS = 4  # parallel sockets per transfer; every process must use the same number (see above)
_READY_POLL_S = 0.002


class DirectTransferError(RuntimeError):
    """A direct pull that could not deliver (the caller loads the version from the store instead)."""


def start_transfer_server(host: str | None) -> transfer.TransferServer:
    """This process's transfer server on `host` (None: this host's address), on free ports."""
    host = host or socket.gethostbyname(socket.gethostname())
    bind = f"[{host}]:0" if ":" in host else f"{host}:0"
    return transfer.start_transfer_server(jax.devices()[0].client, bind, [bind] * TRANSPORT_STREAMS)


@dataclasses.dataclass(frozen=True)
class Announcement:
    """A version on offer: where to pull it, under which uuid per puller, and how its leaves are cut."""

    version: int
    address: str
    uuids: tuple[int, ...]  # puller i pulls uuids[i]
    streams: int
    paths: tuple[str, ...]  # every leaf's path in the published pytree (`jax.tree_util.keystr`)
    leaves: tuple[LeafSpec, ...]  # how each leaf is cut, in the same order (the order of the offered pieces)
    time: float  # wall clock when the offers were made

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "address": self.address,
            "uuids": list(self.uuids),
            "streams": self.streams,
            "paths": list(self.paths),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "time": self.time,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Announcement:
        return cls(
            version=int(value["version"]),
            address=str(value["address"]),
            uuids=tuple(int(u) for u in value["uuids"]),
            streams=int(value["streams"]),
            paths=tuple(str(path) for path in value["paths"]),
            leaves=tuple(LeafSpec.from_json(leaf) for leaf in value["leaves"]),
            time=float(value["time"]),
        )


def read_announcement(path: Path) -> Announcement | None:
    value = read_json(path)
    return None if value is None else Announcement.from_json(value)


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


class DirectWeightPublisher:
    """Offers each version to `pullers` readers over the transfer server, then saves it into `durable`."""

    def __init__(
        self,
        announcement: Path,
        durable: OrbaxWeightPublisher,
        *,
        pullers: int,
        timeout_s: float,
        host: str | None = None,
    ):
        if pullers < 1 or timeout_s <= 0:
            raise ValueError(f"need pullers >= 1 and timeout_s > 0, got {pullers} and {timeout_s}")
        self.announcement, self.durable = announcement, durable
        self.pullers, self.timeout_s = pullers, timeout_s
        self._server = start_transfer_server(host)
        self._next_uuid = 1
        self._version: int | None = None
        announcement.unlink(missing_ok=True)  # an earlier trainer's offers are gone with it
        logger.info("direct weight path: transfer server at %s", self._server.address())

    def latest_version(self) -> int | None:
        return self.durable.latest_version()

    def publish(self, params: Any, version: int) -> None:
        newest = max((v for v in (self._version, self.durable.latest_version()) if v is not None), default=None)
        if newest is not None and version <= newest:
            raise ValueError(f"version {version} is not newer than the latest published version {newest}")
        self.serve(params, version)
        self.durable.publish(params, version)

    def serve(self, params: Any, version: int) -> Announcement:
        """Offer `params` as `version` to every puller and announce it (the direct half of `publish`)."""
        started = time.perf_counter()
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        leaves = [leaf for _, leaf in flat]
        copies = copy_to(leaves, [leaf.sharding for leaf in leaves])
        specs, pieces = [], []
        for leaf in copies:
            shards = distinct_shards(leaf)
            specs.append(LeafSpec(tuple(leaf.shape), str(leaf.dtype), tuple(index for index, _ in shards)))
            pieces.extend(piece for _, piece in shards)
        del copies  # the offers hold the pieces; the other replicas of replicated leaves are freed
        jax.block_until_ready(pieces)  # the copy, in the blocking time it is part of
        uuids = tuple(range(self._next_uuid, self._next_uuid + self.pullers))
        self._next_uuid += self.pullers
        expires = _deadline(self.timeout_s)
        for uuid in uuids:
            self._server.await_pull(uuid, pieces, timeout=expires)
        paths = tuple(jax.tree_util.keystr(path) for path, _ in flat)
        announced = Announcement(
            version, self._server.address(), uuids, TRANSPORT_STREAMS, paths, tuple(specs), time.time()
        )
        write_json_atomic(self.announcement, announced.to_json())
        self._version = version
        logger.info(
            "offering weights version %d to %d pullers: %d bytes in %d pieces, %.3f s blocking",
            version,
            self.pullers,
            tree_nbytes(pieces),
            len(pieces),
            time.perf_counter() - started,
        )
        return announced

    def wait(self) -> None:
        self.durable.wait()

    def close(self) -> None:
        self.announcement.unlink(missing_ok=True)  # no reader should dial a server that is going away
        self.durable.close()


class DirectWeightSubscriber:
    """Pulls announced versions as puller `puller`; the store delivers whatever the pull cannot."""

    def __init__(
        self,
        announcement: Path,
        durable: OrbaxWeightSubscriber,
        *,
        puller: int,
        timeout_s: float,
        host: str | None = None,
        poll_s: float = 0.05,
    ):
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"need timeout_s > 0 and poll_s > 0, got {timeout_s} and {poll_s}")
        self.announcement, self.durable = announcement, durable
        self.puller, self.timeout_s, self.poll_s = puller, timeout_s, poll_s
        self.directory = durable.directory
        self._server = start_transfer_server(host)
        self._connection: tuple[str, Any] | None = None
        before = read_announcement(announcement)
        self._announced_before = before.version if before is not None else None
        self._closed = threading.Event()

    def _pullable(self) -> Announcement | None:
        """The announcement, if it offers a version announced after this subscriber opened."""
        announced = read_announcement(self.announcement)
        if announced is None or (self._announced_before is not None and announced.version <= self._announced_before):
            return None
        return announced

    def latest_version(self) -> int | None:
        announced = self._pullable()
        stored = self.durable.latest_version()
        return max((v for v in (announced and announced.version, stored) if v is not None), default=None)

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int | None:
        delays = itertools.repeat(self.poll_s)
        return poll_for_version(self.latest_version, min_version, timeout_s, self._closed, delays)

    def load(self, version: int, target: Any) -> LoadedWeights:
        """The announced version (>= `version`) pulled directly, or else `version` from the store."""
        target_shardings(target)
        announced = self._pullable()
        fell_back = False
        if announced is not None and announced.version >= version:
            try:
                return self._pull(announced, target)
            except DirectTransferError as err:
                logger.warning(
                    "direct pull of weights version %d failed (%s); loading it from the store", announced.version, err
                )
                version, fell_back = announced.version, True
        stored = self.durable.wait_for_version(version, timeout_s=self.timeout_s)
        if stored is None:
            raise RuntimeError(
                f"weights version {version} reached neither by a direct pull nor in {self.directory} within "
                f"cluster.direct_timeout_s={self.timeout_s} s"
            )
        return dataclasses.replace(self.durable.load(stored, target), fell_back=fell_back)

    def _pull(self, announced: Announcement, target: Any) -> LoadedWeights:
        if announced.streams != TRANSPORT_STREAMS:
            raise DirectTransferError(
                f"the trainer's transfer server uses {announced.streams} streams, this one {TRANSPORT_STREAMS}"
            )
        if not 0 <= self.puller < len(announced.uuids):
            raise DirectTransferError(f"offered to {len(announced.uuids)} pullers; this is puller {self.puller}")
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        order, plans = _plans(announced, {jax.tree_util.keystr(path): leaf for path, leaf in flat})
        started = time.perf_counter()
        try:
            pulled = self._connect(announced.address).pull(
                announced.uuids[self.puller],
                [spec for plan in plans for spec in plan.pull_specs()],
                timeout=_deadline(self.timeout_s),
            )
            self._wait_ready(pulled, time.monotonic() + self.timeout_s)
            built, offset = {}, 0
            for path, plan in zip(announced.paths, plans, strict=True):
                count = len(plan.spec.pieces)
                built[path] = plan.build(pulled[offset : offset + count])
                offset += count
            params = jax.block_until_ready(jax.tree.unflatten(treedef, [built[path] for path in order]))
        except Exception as err:  # the pull, or an offer that failed on the trainer's side
            self._connection = None  # it may be broken; abandoned pulls go with it
            if isinstance(err, DirectTransferError):
                raise
            raise DirectTransferError(f"{type(err).__name__}: {err}") from err
        seconds = time.perf_counter() - started
        nbytes = tree_nbytes(params)
        logger.info(
            "pulled weights version %d: %d bytes in %.3f s (%.1f MB/s)",
            announced.version,
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e6,
        )
        return LoadedWeights(params, announced.version, nbytes, seconds, "direct", announced.time)

    def _connect(self, address: str) -> Any:
        if self._connection is None or self._connection[0] != address:
            self._connection = (address, self._server.connect(address))
        return self._connection[1]

    def _wait_ready(self, arrays: list[jax.Array], deadline: float) -> None:
        """Return once every pulled array has arrived (or failed); raise at `deadline` or on close."""
        pending = 0
        while pending < len(arrays):
            if arrays[pending].is_ready():
                pending += 1
                continue
            if self._closed.is_set():
                raise DirectTransferError("closed while pulling")
            if time.monotonic() > deadline:
                raise DirectTransferError(
                    f"no data within cluster.direct_timeout_s={self.timeout_s} s: the offer was taken or has "
                    "expired, or the trainer is unreachable"
                )
            self._closed.wait(_READY_POLL_S)

    def close(self) -> None:
        self._closed.set()
        self._connection = None
        self.durable.close()


def _plans(announced: Announcement, targets: dict[str, Any]) -> tuple[list[str], list[LeafPlan]]:
    """The target's leaf paths in its own order, and a plan per announced leaf (matched by path)."""
    if set(announced.paths) != set(targets):
        missing, extra = sorted(set(targets) - set(announced.paths)), sorted(set(announced.paths) - set(targets))
        raise DirectTransferError(
            f"the announced leaves differ from the target's: missing {missing[:3]}, extra {extra[:3]}"
        )
    plans = []
    for path, spec in zip(announced.paths, announced.leaves, strict=True):
        target = targets[path]
        if spec.shape != tuple(target.shape) or jnp.dtype(spec.dtype) != jnp.dtype(target.dtype):
            raise DirectTransferError(
                f"{path}: announced {spec.shape} {spec.dtype}, target {tuple(target.shape)} {target.dtype}"
            )
        plans.append(plan_leaf(spec, target.sharding))
    return list(targets), plans
