"""The rollout servers' admission floors, exchanged through the run directory's control files.

Each server publishes its own floor (`StalenessSnapshot.floor`: the oldest version it has a prompt running
at, or its version) when it changes, and hands its manager the lowest of the others' (`set_peer_floor`), so
that a prompt running long on one server holds every server's admissions back as it would in one process
(`rollout/staleness.py`). A server's floor never goes down, so a file read late errs on the safe side. The
trainer writes every server's file at the version it starts from before any server starts
(`ControlFiles.reset_floors`); a server withdraws its own (None) once its prompts ran out, so that it holds
nobody back at the end of a finite dataset.
"""

from __future__ import annotations

from areal_jax.rollout.staleness import StalenessManager
from areal_jax.system.cluster import ControlFiles


class FloorExchange:
    """Server `server`'s side of the exchange; `exchange()` is called from one thread (the server's loop)."""

    def __init__(self, control: ControlFiles, server: int, staleness: StalenessManager):
        self.control, self.server, self.staleness = control, server, staleness
        self._published: int | None = None

    def exchange(self) -> None:
        """Publish this server's floor if it rose, then hold its admissions to the others' lowest."""
        floor = self.staleness.snapshot().floor
        if floor != self._published:
            self.control.write_floor(self.server, floor)
            self._published = floor
        peers = (self.control.floor(i) for i in range(self.control.servers) if i != self.server)
        self.staleness.set_peer_floor(min((f for f in peers if f is not None), default=None))

    def withdraw(self) -> None:
        """This server admits nothing more (its prompts ran out and its groups ended)."""
        self.control.write_floor(self.server, None)
