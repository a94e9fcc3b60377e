"""The direct weight path: each version pulled from the trainer's memory by JAX's transfer server
(`jax.experimental.transfer`), beside the durable Orbax store.

The trainer's `DirectWeightPublisher` copies every new version (the trainer donates its params right after
`publish`), cuts it into single-device pieces (`pieces.py`), offers them once to each of the `pullers`
rollout servers under its own uuid, and announces the version in a small JSON file written to a temporary
name and renamed. Then it saves the same version into the Orbax store as before. A trainer over several
processes (`distributed.enabled`) serves from every process: each has its own transfer server and offers
the pieces it is the lowest process to hold; their addresses, uuids and piece lists are gathered, and
process 0 alone writes the announcement once every process has made its offers. So the announcement names
one source per serving process (address, a uuid per puller, which pieces in which order) and how every
leaf is cut; one process is one source. A rollout server's `DirectWeightSubscriber` reads the
announcement, pulls its uuid from every source at once onto its own devices (resharding on arrival where
its layout cuts the leaves differently) and falls back to the store when any pull fails. How JAX's
transfer server behaves, as measured on jax 0.10.2 (CPU):

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
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import transfer

from areal_jax import storage
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.sharding import copy_to
from areal_jax.storage import read_json, write_json_atomic
from areal_jax.weights.base import LoadedWeights, poll_for_version, target_shardings, tree_nbytes
from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber
from areal_jax.weights.pieces import LeafPlan, LeafSpec, offered_pieces, plan_leaf

logger = logging.getLogger(__name__)

TRANSPORT_STREAMS = 4  # parallel sockets per transfer; every process must use the same number (see above)
_READY_POLL_S = 0.002


class DirectTransferError(RuntimeError):
    """A direct pull that could not deliver (the caller loads the version from the store instead)."""


def start_transfer_server(host: str | None) -> transfer.TransferServer:
    """This process's transfer server on `host` (None: this host's address), on free ports."""
    host = host or socket.gethostbyname(socket.gethostname())
    bind = f"[{host}]:0" if ":" in host else f"{host}:0"
    return transfer.start_transfer_server(jax.local_devices()[0].client, bind, [bind] * TRANSPORT_STREAMS)


@dataclasses.dataclass(frozen=True)
class Source:
    """One trainer process's offers of a version: where to pull them, under which uuid per puller, and
    which pieces they are, in the order they were offered."""

    address: str
    uuids: tuple[int, ...]  # puller i pulls uuids[i]
    pieces: tuple[tuple[int, int], ...]  # (leaf, number of the piece in that leaf's `LeafSpec.pieces`)

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "uuids": list(self.uuids), "pieces": [list(p) for p in self.pieces]}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Source:
        pieces = tuple((int(leaf), int(piece)) for leaf, piece in value["pieces"])
        return cls(str(value["address"]), tuple(int(u) for u in value["uuids"]), pieces)


@dataclasses.dataclass(frozen=True)
class Announcement:
    """A version on offer: how its leaves are cut, and the sources that offer their pieces (together, each
    piece once)."""

    version: int
    streams: int
    paths: tuple[str, ...]  # every leaf's path in the published pytree (`jax.tree_util.keystr`)
    leaves: tuple[LeafSpec, ...]  # how each leaf is cut, in the same order
    sources: tuple[Source, ...]  # the trainer processes that offer pieces, in process order
    time: float  # wall clock when every offer had been made

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "streams": self.streams,
            "paths": list(self.paths),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "sources": [source.to_json() for source in self.sources],
            "time": self.time,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Announcement:
        return cls(
            version=int(value["version"]),
            streams=int(value["streams"]),
            paths=tuple(str(path) for path in value["paths"]),
            leaves=tuple(LeafSpec.from_json(leaf) for leaf in value["leaves"]),
            sources=tuple(Source.from_json(source) for source in value["sources"]),
            time=float(value["time"]),
        )


def read_announcement(path: storage.Location) -> Announcement | None:
    value = read_json(path)
    return None if value is None else Announcement.from_json(value)


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


class DirectWeightPublisher:
    """Offers each version to `pullers` readers over the transfer server, then saves it into `durable`
    (the first version, then one at least `store_every` versions after the last saved).

    With several trainer processes every process opens one and makes the same calls (`publish` is
    collective, as the store's is); process 0 alone writes and removes the announcement."""

    def __init__(
        self,
        announcement: storage.Location,
        durable: OrbaxWeightPublisher,
        *,
        pullers: int,
        timeout_s: float,
        host: str | None = None,
        store_every: int = 1,
    ):
        if pullers < 1 or timeout_s <= 0 or store_every < 1:
            raise ValueError(
                f"need pullers >= 1, timeout_s > 0 and store_every >= 1, got {pullers}, {timeout_s} and {store_every}"
            )
        self.announcement, self.durable = announcement, durable
        self.pullers, self.timeout_s, self.store_every = pullers, timeout_s, store_every
        self._stored: int | None = None  # the last version this publisher saved into the store
        self._processes = TrainerProcesses()
        self._server = start_transfer_server(host)
        self._serial = itertools.count()
        self._version: int | None = None
        if self._processes.primary:
            storage.remove(announcement)  # an earlier trainer's offers are gone with it
        logger.info("direct weight path: transfer server at %s", self._server.address())

    def latest_version(self) -> int | None:
        return self.durable.latest_version()

    def publish(self, params: Any, version: int) -> None:
        newest = max((v for v in (self._version, self.durable.latest_version()) if v is not None), default=None)
        if newest is not None and version <= newest:
            raise ValueError(f"version {version} is not newer than the latest published version {newest}")
        self.serve(params, version)
        if self._stored is None or version - self._stored >= self.store_every:
            self.durable.publish(params, version)
            self._stored = version

    def serve(self, params: Any, version: int) -> Announcement:
        """Offer `params` as `version` to every puller and announce it (the direct half of `publish`)."""
        started = time.perf_counter()
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        leaves = [leaf for _, leaf in flat]
        copies = copy_to(leaves, [leaf.sharding for leaf in leaves])
        specs: list[LeafSpec] = []
        offered: list[tuple[int, int]] = []
        pieces: list[jax.Array] = []
        for number, leaf in enumerate(copies):
            spec, mine = offered_pieces(leaf)
            specs.append(spec)
            offered.extend((number, piece) for piece, _ in mine)
            pieces.extend(array for _, array in mine)
        del copies  # the offers hold the pieces; the other replicas are freed
        jax.block_until_ready(pieces)  # the copy, in the blocking time it is part of
        uuids = self._uuids()
        if pieces:  # a process holding no piece of its own (every leaf replicated) serves nothing
            expires = _deadline(self.timeout_s)
            for uuid in uuids:
                self._server.await_pull(uuid, pieces, timeout=expires)
        own = Source(self._server.address(), uuids, tuple(offered))
        # a collective every process enters after its offers: the announcement names only offers that exist
        sources = tuple(Source.from_json(s) for s in self._processes.gather(own.to_json()) if s["pieces"])
        paths = tuple(jax.tree_util.keystr(path) for path, _ in flat)
        announced = Announcement(version, TRANSPORT_STREAMS, paths, tuple(specs), sources, time.time())
        self._processes.on_primary(lambda: write_json_atomic(self.announcement, announced.to_json()))
        self._version = version
        logger.info(
            "offering weights version %d to %d pullers from %d processes: %d bytes in %d pieces here, %.3f s blocking",
            version,
            self.pullers,
            len(sources),
            tree_nbytes(pieces),
            len(pieces),
            time.perf_counter() - started,
        )
        return announced

    def _uuids(self) -> tuple[int, ...]:
        """This process's uuid for each puller of the next version (distinct over versions and processes)."""
        serial, processes = next(self._serial), self._processes
        first = serial * self.pullers
        return tuple(1 + (first + puller) * processes.count + processes.index for puller in range(self.pullers))

    def wait(self) -> None:
        self.durable.wait()

    def close(self) -> None:
        if self._processes.primary:
            storage.remove(self.announcement)  # no reader should dial a server that is going away
        self.durable.close()


class DirectWeightSubscriber:
    """Pulls announced versions as puller `puller`; the store delivers whatever the pull cannot."""

    def __init__(
        self,
        announcement: storage.Location,
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
        self._connections: dict[str, Any] = {}  # address -> connection to that trainer process
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
        announced_version = None if announced is None else announced.version
        return max((v for v in (announced_version, stored) if v is not None), default=None)

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
                f"the trainer's transfer servers use {announced.streams} streams, this one {TRANSPORT_STREAMS}"
            )
        for source in announced.sources:
            if not 0 <= self.puller < len(source.uuids):
                raise DirectTransferError(
                    f"{source.address} offers to {len(source.uuids)} pullers; this is puller {self.puller}"
                )
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        order, plans = _plans(announced, {jax.tree_util.keystr(path): leaf for path, leaf in flat})
        requests = _requests(announced, plans)
        started = time.perf_counter()
        try:
            connections = self._connect([source.address for source in announced.sources])
            expires = _deadline(self.timeout_s)
            pulled = [  # issued to every source before any is waited on
                connection.pull(source.uuids[self.puller], specs, timeout=expires)
                for source, specs, connection in zip(announced.sources, requests, connections, strict=True)
            ]
            self._wait_ready([array for arrays in pulled for array in arrays], time.monotonic() + self.timeout_s)
            placed: list[list[Any]] = [[None] * len(plan.spec.pieces) for plan in plans]
            for source, arrays in zip(announced.sources, pulled, strict=True):
                for (leaf, piece), array in zip(source.pieces, arrays, strict=True):
                    placed[leaf][piece] = array
            built = {path: plan.build(a) for path, plan, a in zip(announced.paths, plans, placed, strict=True)}
            params = jax.block_until_ready(jax.tree.unflatten(treedef, [built[path] for path in order]))
        except Exception as err:  # a pull, or an offer that failed on the trainer's side
            self._connections.clear()  # they may be broken; abandoned pulls go with them
            if isinstance(err, DirectTransferError):
                raise
            raise DirectTransferError(f"{type(err).__name__}: {err}") from err
        seconds = time.perf_counter() - started
        nbytes = tree_nbytes(params)
        logger.info(
            "pulled weights version %d from %d sources: %d bytes in %.3f s (%.1f MB/s)",
            announced.version,
            len(announced.sources),
            nbytes,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e6,
        )
        return LoadedWeights(params, announced.version, nbytes, seconds, "direct", announced.time)

    def _connect(self, addresses: list[str]) -> list[Any]:
        """A connection to each address, kept for the next versions; those to other addresses (an earlier
        trainer's) are dropped."""
        kept = self._connections
        self._connections = {a: kept[a] if a in kept else self._server.connect(a) for a in addresses}
        return [self._connections[a] for a in addresses]

    def _wait_ready(self, arrays: list[jax.Array], deadline: float) -> None:
        """Return once every pulled array has arrived (or failed); raise at `deadline` or on close."""
        pending = 0
        while pending < len(arrays):
            if arrays[pending].is_ready():  # type: ignore[attr-defined]  # ArrayImpl's, missing from jax.Array's stub
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
        self._connections.clear()
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


def _requests(announced: Announcement, plans: list[LeafPlan]) -> list[list[jax.ShapeDtypeStruct]]:
    """What to pull from each source, in the order it offered its pieces (refused unless the sources
    offer every piece of every leaf exactly once)."""
    specs = [plan.pull_specs() for plan in plans]
    offered = [piece for source in announced.sources for piece in source.pieces]
    every = {(leaf, piece) for leaf, leaf_specs in enumerate(specs) for piece in range(len(leaf_specs))}
    if len(offered) != len(set(offered)) or set(offered) != every:
        raise DirectTransferError(
            f"the announced sources must offer each of the {len(every)} pieces once; they offer {len(offered)} "
            f"({len(set(offered) - every)} unknown, {len(offered) - len(set(offered))} repeated)"
        )
    return [[specs[leaf][piece] for leaf, piece in source.pieces] for source in announced.sources]
