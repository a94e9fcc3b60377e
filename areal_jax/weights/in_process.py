"""The in-process weight channel: trainer and generator in one JAX program, each on its own mesh.

`InProcessPublisher` is the trainer's `publish(params, version)`: it copies the params device to device
onto the generator's inference shardings (`sharding.copy_to`: no host round trip, never aliasing the
trainer's buffers, so the trainer may donate them to its next step as soon as `publish` returns), waits
until the generator decodes with them, then tells the staleness manager the new version.
"""

from __future__ import annotations

import logging
import time

from flax import nnx

from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.weight_versions import apply_version
from areal_jax.sharding import copy_to
from areal_jax.weights.base import tree_nbytes

logger = logging.getLogger(__name__)


def unaliased_for(engine: Engine, params: nnx.State) -> nnx.State:
    """What to hand `engine.load_params` of trainer params the trainer donates to its next step: the params
    themselves when the engine stores cast copies of them (`Engine.casts_weights`), else a device-to-device
    copy onto its shardings."""
    return params if engine.casts_weights else copy_to(params, engine.param_shardings)


class InProcessPublisher:
    """Trainer -> generator weights within one program; see the module docstring."""

    def __init__(self, generator: Generator, staleness: StalenessManager, interrupt: bool):
        """`interrupt`: in-flight samples re-prefill under the new weights (True) or finish on the old ones
        before the swap (False); see `Generator.update_params`."""
        self.generator = generator
        self.staleness = staleness
        self.interrupt = interrupt

    def __call__(self, params: nnx.State, version: int) -> None:
        """Publish `params` as `version`; returns once the generator uses them and admission follows."""
        started = time.perf_counter()
        source = unaliased_for(self.generator.engine, params)
        apply_version(self.generator, self.staleness, source, version, interrupt=self.interrupt)
        logger.debug(
            "published v%d in process: %d bytes in %.3f s", version, tree_nbytes(source), time.perf_counter() - started
        )
