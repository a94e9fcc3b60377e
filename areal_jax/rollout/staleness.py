"""Admission control for rollouts: bound how far generation runs ahead of the trainer.

With v = the trainer's published version, B = prompts per training batch, eta = max_head_offpolicyness and
f = the admission floor (below), a new prompt is admitted only while

    accepted + running + 1 <= (eta + min(v, f + 1) + 1) * B     and     running < max_concurrent,

where `accepted` counts prompts whose samples were handed to the trainer side and `running` those still
generating (`admission_limit` is the first bound, the one rule). eta = 0 is synchronous RL: the next batch
starts only after the trainer consumed the previous one.

The floor f is the oldest version a running prompt was admitted at, or the version when none is older. The
trainer fills batches in completion order, so a prompt admitted at v trains at v + eta + 1 at most only if
no more than (eta + v + 2) * B prompts are admitted before it ends; the floor keeps that true when a prompt
runs long (or on a slow server), at the price of admitting less while it runs: with every prompt admitted
at v - 1 or later, min(v, f + 1) = v and the rule is AReaL's.

With N rollout servers (separate processes), server i applies the i-th of N near-equal shares of the limit
(`server_share`) to its own counts, with f the lowest of its own floor and the other servers' (`set_peer_floor`,
which they publish through the run directory: `system/admission_floors.py`; it admits nothing before the
first). A server's floor never goes down (a prompt is admitted at the version or later, a version never
goes back), so a floor read late is lower than the true one: the limit it gives is the safe side. A
restarted server keeps the floor it published before (`admits_from`): it admits nothing until its version
reaches it (it may start from an older stored version and catch up).

Thread-safe. `wait_for_capacity` sleeps on a condition variable that `finish`, `set_version`,
`set_peer_floor`, `restore` and `close` notify, so a waiter wakes when the answer may have changed; its
optional timeout bounds the wait, and `close` wakes every waiter with None (how the rollout controller's
`stop()` ends its admission wait).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from areal_jax.configuration import Config, option


@dataclasses.dataclass(frozen=True)
class StalenessConfig(Config):
    """How far rollouts may run ahead."""

    max_head_offpolicyness: int = option(1, ge=0, doc="eta: versions a new rollout may be ahead of the trainer")
    batch_prompts: int = option(8, ge=1, doc="B: prompts per training batch")
    max_concurrent: int = option(64, ge=1, doc="prompts generating at once at most")


@dataclasses.dataclass(frozen=True)
class Admission:
    """An admitted prompt, handed back to `StalenessManager.finish` when it ends."""

    version: int  # the version it was admitted at: its generation starts at this version or a newer one
    trains: bool = True  # False: its samples never reach the trainer (an agent proxy's external episode)


@dataclasses.dataclass(frozen=True)
class StalenessSnapshot:
    version: int
    running: int
    accepted: int
    rejected: int
    capacity: int
    floor: int  # this manager's own admission floor (what a server publishes to the others)


def admission_limit(config: StalenessConfig, version: int, floor: int) -> int:
    """Prompts admitted over all servers (accepted + running) at most, at trainer `version` and admission
    `floor` (see the module docstring)."""
    return (config.max_head_offpolicyness + min(version, floor + 1) + 1) * config.batch_prompts


def server_share(total: int, server: int, servers: int) -> int:
    """Server `server`'s part of `total` split into `servers` near-equal integer parts (they add up to
    `total`; the first `total % servers` parts are one larger)."""
    return (total + servers - 1 - server) // servers


class StalenessManager:
    """Counts running/accepted/rejected prompts against the trainer version (see module docstring)."""

    def __init__(
        self, config: StalenessConfig, version: int = 0, server: int = 0, servers: int = 1, admits_from: int = 0
    ):
        if not 0 <= server < servers:
            raise ValueError(f"server {server} is not one of {servers} servers")
        self.config = config
        self._share = (server, servers)
        self._version = version
        self._admits_from = admits_from
        self._running_at: collections.Counter[int] = collections.Counter()  # admission version -> running
        self._running_untrained = 0  # running, but never trained: they hold no floor back
        self._accepted = 0
        self._rejected = 0
        self._peer_floor: int | None = None
        self._peers_heard = servers == 1  # a server of several admits nothing before it knows the others' floors
        self._closed = False
        self._cond = threading.Condition()

    def _floor_locked(self) -> int:
        return min(self._running_at, default=max(self._version, self._admits_from))

    def _capacity_locked(self) -> int:
        if self._version < self._admits_from or not self._peers_heard:
            return 0
        floor = self._floor_locked()
        if self._peer_floor is not None:
            floor = min(floor, self._peer_floor)
        running = self._running()
        limit = server_share(admission_limit(self.config, self._version, floor), *self._share)
        return max(0, min(limit - self._accepted - running, self.config.max_concurrent - running))

    def _running(self) -> int:
        return self._running_at.total() + self._running_untrained

    def wait_for_capacity(self, timeout: float | None = None, trains: bool = True) -> Admission | None:
        """Block until a prompt may be admitted (then admit it) or the manager is closed / times out (None);
        `timeout=0` admits only if it may now. `trains=False`: its samples never reach the trainer, so it
        counts as running but sets no floor."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._capacity_locked() >= 1, timeout):
                return None
            if self._closed:
                return None
            if trains:
                self._running_at[self._version] += 1
            else:
                self._running_untrained += 1
            return Admission(self._version, trains)

    def finish(self, admission: Admission, accepted: bool) -> None:
        """A running prompt ended: its samples were handed on (accepted) or dropped (rejected)."""
        with self._cond:
            if not admission.trains:
                if self._running_untrained < 1:
                    raise RuntimeError(f"finish() of {admission} without a matching admission")
                self._running_untrained -= 1
            elif self._running_at[admission.version] < 1:
                raise RuntimeError(f"finish() of {admission} without a matching admission")
            else:
                self._running_at[admission.version] -= 1
                if not self._running_at[admission.version]:
                    del self._running_at[admission.version]
            if accepted:
                self._accepted += 1
            else:
                self._rejected += 1
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        """The trainer published `version`; more rollouts may start."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"version went backwards: {version} < {self._version}")
            self._version = version
            self._cond.notify_all()

    def set_peer_floor(self, floor: int | None) -> None:
        """The lowest admission floor the other servers published (None: none of them holds one back)."""
        with self._cond:
            self._peer_floor, self._peers_heard = floor, True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> StalenessSnapshot:
        with self._cond:
            return StalenessSnapshot(
                self._version,
                self._running(),
                self._accepted,
                self._rejected,
                self._capacity_locked(),
                self._floor_locked(),
            )

    def restore(self, accepted: int, rejected: int, version: int) -> None:
        """Resume counters from a checkpoint (no prompts are running after a restart)."""
        with self._cond:
            self._accepted, self._rejected, self._version = accepted, rejected, version
            self._running_at.clear()
            self._running_untrained = 0
            self._cond.notify_all()
