"""Whether the proxy may start a new episode for a client that opens one itself (its first request names a
session the agent workflow did not open). Episodes the workflow opens were admitted by the rollout
controller already; an episode in flight is never refused."""

from __future__ import annotations

from typing import Protocol

from areal_jax.rollout.staleness import Admission, StalenessManager


class EpisodeAdmission(Protocol):
    def try_admit(self) -> Admission | None:
        """Admit one episode now if the bound allows, else refuse (None); never blocks."""

    def release(self, admission: Admission) -> None:
        """An admitted episode ended."""


class StalenessAdmission:
    """Episodes counted against the rollout side's staleness bound, like prompts. An external episode's
    samples are returned to its client, not handed to the trainer, so it ends as rejected and, however long it
    runs, holds no admission floor back."""

    def __init__(self, staleness: StalenessManager):
        self.staleness = staleness

    def try_admit(self) -> Admission | None:
        return self.staleness.wait_for_capacity(timeout=0, trains=False)

    def release(self, admission: Admission) -> None:
        self.staleness.finish(admission, accepted=False)
