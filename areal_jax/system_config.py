"""The config sections of the system layer: the multi-process shape (`ClusterConfig`), `jax.distributed` per role
(`DistributedConfig`), and what a run reports (`ReportConfig`). A leaf: `areal_jax.config` gathers it with the
other sections."""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option


@dataclasses.dataclass(frozen=True)
class ClusterConfig(Config):
    """Rollout servers and the trainer as separate processes (`areal-jax launch local`, `areal-jax rollout`,
    `areal-jax trainer`); unused by the one-process `areal-jax train`."""

    rollout_servers: int = option(1, ge=1, doc="rollout server processes; server i owns group ids g % N == i")
    weights_keep: int = option(
        3, ge=2, doc="weight versions kept in <run>/weights (a server reading a deleted one loads the newest)"
    )
    weights_poll_s: float = option(0.05, gt=0, doc="how often a rollout server looks for a new weight version")
    start_timeout_s: float = option(
        600.0, gt=0, doc="how long a rollout server waits for the trainer's first weight version"
    )
    restarts: int = option(3, ge=0, doc="launch local: restarts of a rollout server that dies before the run ends")
    status_every_s: float = option(2.0, gt=0, doc="how often a rollout server writes control/rollout-<i>.json")
    floors_poll_s: float = option(
        0.05,
        gt=0,
        doc="how often a rollout server publishes its admission floor and reads the other servers' "
        "(control/rollout-<i>.floor.json: the staleness bound over several servers, docs/distributed.md)",
    )
    weight_transfer: Literal["orbax", "direct"] = option(
        "orbax",
        doc="how new weight versions reach the rollout servers: orbax = through the store in <run>/weights; "
        "direct = pulled from the trainer's memory by JAX's transfer server, with the store kept for "
        "(re)started servers and failed pulls (docs/distributed.md)",
    )
    direct_timeout_s: float = option(
        30.0,
        gt=0,
        doc="direct: how long a version stays offered to a server that has not pulled it, and how long a "
        "pull may take before the server loads that version from the store",
    )
    direct_store_every: int = option(
        1,
        ge=1,
        doc="direct: a version goes into the store only once this many versions have passed since the last "
        "stored one (the trainer's first is always stored); at most max_head_offpolicyness + 1. The store's "
        "background write costs trainer CPU every step; what it buys is the version a (re)started server "
        "starts from (it admits against that version and catches up at the next direct offer) and a failed "
        "pull's fallback, which then waits for the next stored version: keep direct_timeout_s above this "
        "many steps",
    )
    direct_host: str | None = option(
        None,
        doc="direct: the host name or IP each process's transfer server binds; every trainer process's must "
        "be reachable from every rollout server; null = the address of this host's name (keep null for a "
        "trainer over several hosts)",
    )

    def validate(self) -> None:
        if self.direct_store_every != 1 and self.weight_transfer != "direct":
            raise ConfigError(
                "direct_store_every",
                f"is {self.direct_store_every} but weight_transfer is {self.weight_transfer!r}: the store is the "
                "only weight path then, and every version goes into it (set weight_transfer: direct, or 1)",
            )


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Config):
    """`jax.distributed` for the role this process runs (`areal-jax trainer`, `areal-jax rollout`) spread over
    several processes (hosts) as one program on one mesh. Null fields are detected from the environment
    (Cloud TPU, SLURM, Open MPI), as `jax.distributed.initialize()` does."""

    enabled: bool = option(False, doc="call jax.distributed.initialize before building the role's mesh")
    coordinator_address: str | None = option(None, doc="host:port of process 0; null = detect")
    num_processes: int | None = option(None, ge=1, doc="processes of the role; null = detect")
    process_id: int | None = option(None, ge=0, doc="this process's index; null = detect")
    local_device_ids: tuple[int, ...] | None = option(None, doc="devices this process uses; null = all local")
    peer_timeout_s: float = option(
        60.0,
        gt=2.0,
        doc="a rollout server over several processes: process 0 exits (status 1, for a restart of the whole "
        "server) when another of its processes closed its connection, or showed no sign of life for this long",
    )

    def validate(self) -> None:
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ConfigError("process_id", f"value {self.process_id} must be below num_processes={self.num_processes}")


@dataclasses.dataclass(frozen=True)
class ReportConfig(Config):
    """What a run shows while it trains and writes besides metrics.jsonl, TensorBoard and train.log."""

    wandb_project: str = option("", doc="Weights & Biases project to log every step to (needs wandb); empty = off")
    live: Literal["auto", "always", "never"] = option(
        "auto", doc="live progress display on stderr; auto = when stderr is a terminal"
    )
    plots: bool = option(True, doc="write PNG plots of reward, staleness and throughput into <run>/plots at the end")
