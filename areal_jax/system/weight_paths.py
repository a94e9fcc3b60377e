"""The weight path between the trainer and the rollout servers, as `cluster.weight_transfer` chooses: the
Orbax store in `<run>/weights` alone, or the direct transfer path beside it (`weights/direct.py`)."""

from __future__ import annotations

import logging

import jax

from areal_jax.config import ExperimentConfig
from areal_jax.system.cluster import ControlFiles
from areal_jax.weights.direct import DirectWeightPublisher, DirectWeightSubscriber
from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber

logger = logging.getLogger(__name__)


def open_publisher(cfg: ExperimentConfig) -> OrbaxWeightPublisher | DirectWeightPublisher:
    """The trainer's end."""
    cluster = cfg.cluster
    store = OrbaxWeightPublisher(cfg.layout.weights, max_to_keep=cluster.weights_keep)
    if cluster.weight_transfer == "orbax":
        return store
    return DirectWeightPublisher(
        _announcement(cfg),
        store,
        pullers=cluster.rollout_servers,
        timeout_s=cluster.direct_timeout_s,
        host=cluster.direct_host,
        store_every=cluster.direct_store_every,
    )


def open_subscriber(cfg: ExperimentConfig, server: int) -> OrbaxWeightSubscriber | DirectWeightSubscriber:
    """Rollout server `server`'s end. A server over several processes reads the store alone, each process
    on its own (`system/mirrored_engine.py`): the direct path pulls onto one process's devices."""
    cluster = cfg.cluster
    poll = cluster.weights_poll_s
    several = jax.process_count() > 1
    store = OrbaxWeightSubscriber(cfg.layout.weights, poll_initial_s=poll, poll_max_s=poll, process_local=several)
    if cluster.weight_transfer == "orbax":
        return store
    if several:
        if jax.process_index() == 0:
            logger.warning(
                "cluster.weight_transfer=direct: rollout server %d runs over %d processes and loads every "
                "version from the store instead (the direct path serves servers of one process)",
                server,
                jax.process_count(),
            )
        return store
    return DirectWeightSubscriber(
        _announcement(cfg),
        store,
        puller=server,
        timeout_s=cluster.direct_timeout_s,
        host=cluster.direct_host,
        poll_s=poll,
    )


def _announcement(cfg: ExperimentConfig) -> str:
    return ControlFiles(cfg.run_location, cfg.cluster.rollout_servers).direct_weights_path
