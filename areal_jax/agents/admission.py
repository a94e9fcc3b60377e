"""Whether the proxy may start a new episode for a client that opens one itself (its first request names a
session the agent workflow did not open). Episodes the workflow opens were admitted by the rollout
controller already; an episode in flight is never refused."""

from __future__ import annotations

from typing import Protocol

from areal_jax.rollout.staleness import StalenessManager


class EpisodeAdmission(Protocol):
    def try_admit(self) -> bool:
        """Admit one episode now if the bound allows (True), else refuse (False); never blocks."""

    def release(self) -> None:
        """An admitted episode ended."""


class StalenessAdmission:
    """Episodes counted against the rollout side's staleness bound, like prompts. An external episode's
    samples are returned to its client, not handed to the trainer, so it ends as rejected."""

    def __init__(self, staleness: StalenessManager):
        self.staleness = staleness

    def try_admit(self) -> bool:
        return self.staleness.wait_for_capacity(timeout=0)

    def release(self) -> None:
        self.staleness.finish(accepted=False)
