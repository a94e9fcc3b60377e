"""Admission control for rollouts: bound how far generation runs ahead of the trainer.

With v = the trainer's published version, B = prompts per training batch and eta =
max_head_offpolicyness, a new prompt is admitted only while

    accepted + running + 1 <= (eta + v + 1) * B     and     running < max_concurrent,

where `accepted` counts prompts whose samples were handed to the trainer side and `running` those
still generating. eta = 0 is synchronous RL: the next batch starts only after the trainer consumed
the previous one. With N rollout servers (separate processes), server i applies the i-th of N near-equal
shares of the first bound (`server_share`) to its own counts, so together they keep the one-process
bound without talking to each other. Thread-safe. `wait_for_capacity` sleeps on a condition variable that `finish`,
`set_version`, `restore` and `close` notify, so a waiter wakes when the answer may have changed; its
optional timeout bounds the wait, and `close` wakes every waiter with False (how the rollout controller's
`stop()` ends its admission wait).
"""

from __future__ import annotations

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
class StalenessSnapshot:
    version: int
    running: int
    accepted: int
    rejected: int
    capacity: int


def server_share(total: int, server: int, servers: int) -> int:
    """Server `server`'s part of `total` split into `servers` near-equal integer parts (they add up to
    `total`; the first `total % servers` parts are one larger)."""
    return (total + servers - 1 - server) // servers


class StalenessManager:
    """Counts running/accepted/rejected prompts against the trainer version (see module docstring)."""

    def __init__(self, config: StalenessConfig, version: int = 0, server: int = 0, servers: int = 1):
        if not 0 <= server < servers:
            raise ValueError(f"server {server} is not one of {servers} servers")
        self.config = config
        self._share = (server, servers)
        self._version = version
        self._running = 0
        self._accepted = 0
        self._rejected = 0
        self._closed = False
        self._cond = threading.Condition()

    def _capacity_locked(self) -> int:
        cfg = self.config
        by_staleness = server_share((cfg.max_head_offpolicyness + self._version + 1) * cfg.batch_prompts, *self._share)
        by_staleness -= self._accepted + self._running
        return max(0, min(by_staleness, cfg.max_concurrent - self._running))

    def wait_for_capacity(self, timeout: float | None = None) -> bool:
        """Block until a prompt may be admitted (then admit it; True) or the manager is closed / times out
        (False); `timeout=0` admits only if it may now."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._capacity_locked() >= 1, timeout):
                return False
            if self._closed:
                return False
            self._running += 1
            return True

    def finish(self, accepted: bool) -> None:
        """A running prompt ended: its samples were handed on (accepted) or dropped (rejected)."""
        with self._cond:
            if self._running < 1:
                raise RuntimeError("finish() without a matching admission")
            self._running -= 1
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

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> StalenessSnapshot:
        with self._cond:
            return StalenessSnapshot(
                self._version, self._running, self._accepted, self._rejected, self._capacity_locked()
            )

    def restore(self, accepted: int, rejected: int, version: int) -> None:
        """Resume counters from a checkpoint (no prompts are running after a restart)."""
        with self._cond:
            self._accepted, self._rejected, self._version, self._running = accepted, rejected, version, 0
            self._cond.notify_all()
