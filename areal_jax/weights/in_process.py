"""The in-process weight channel: trainer and generator in one JAX program, each on its own mesh.

`InProcessPublisher` is the trainer loop's `WeightPublisher` when the rollout side runs in its program: it
hands the trainer's params as they are to the rollout side, which swaps them into its generator, then into
admission. The engine's load copies them device to device onto its own shardings (`Engine.load_params`:
no host round trip, never aliasing the trainer's buffers), so the trainer may donate them to its next step
as soon as `publish` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flax import nnx

from areal_jax.weights.base import tree_nbytes

logger = logging.getLogger(__name__)


class InProcessPublisher:
    """Trainer -> generator weights within one program; see the module docstring. `apply(params, version)`
    is the rollout side's (`RolloutSide.apply`: the generator, then admission)."""

    def __init__(self, apply: Callable[[nnx.State, int], None]):
        self.apply = apply

    def publish(self, params: nnx.State, version: int) -> None:
        """Publish `params` as `version`; returns once the generator uses its copy and admission follows."""
        started = time.perf_counter()
        self.apply(params, version)
        logger.debug(
            "published v%d in process: %d bytes in %.3f s", version, tree_nbytes(params), time.perf_counter() - started
        )

    def close(self) -> None:
        pass
