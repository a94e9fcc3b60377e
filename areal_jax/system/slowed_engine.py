"""A rollout server slowed on purpose, for the benchmarks that need servers of unequal speed
(`benchmarks/staleness_servers.py`): `AREAL_JAX_SLOW_ROLLOUT_SERVER=<server>:<seconds>` makes that server's
engine wait `seconds` before each decode step. Unset (every real run), the engine is used as it is."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

from areal_jax.inference.serving_engine import ServingEngine

logger = logging.getLogger(__name__)

SLOW_SERVER_ENV = "AREAL_JAX_SLOW_ROLLOUT_SERVER"


def slowed_for_benchmarks(engine: ServingEngine, server: int) -> ServingEngine:
    """`engine`, its `generate` (one decode step of every slot) delayed when `AREAL_JAX_SLOW_ROLLOUT_SERVER`
    names this server."""
    setting = os.environ.get(SLOW_SERVER_ENV, "")
    if not setting:
        return engine
    slow_server, _, delay = setting.partition(":")
    try:
        slowed, delay_s = int(slow_server), float(delay)
    except ValueError:
        raise ValueError(f"{SLOW_SERVER_ENV}={setting!r}: expected <server>:<seconds>, e.g. 1:0.05") from None
    if slowed != server:
        return engine
    logger.warning("rollout server %d slowed for a benchmark: %.3f s before each decode step", server, delay_s)
    generate = engine.generate

    @functools.wraps(generate)
    def slowed_generate(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return generate(*args, **kwargs)

    engine.generate = slowed_generate  # type: ignore[method-assign]  # this one engine, for a benchmark
    return engine
