"""The in-process weight channel: trainer and generator in one JAX program, each on its own mesh.

`InProcessPublisher` is the trainer loop's `WeightPublisher` when the rollout side runs in its program: it
copies the params device to device onto the engine's shardings (`sharding.copy_to`: no host round trip,
never aliasing the trainer's buffers, so the trainer may donate them to its next step as soon as `publish`
returns) and hands them to the rollout side, which swaps them into its generator, then into admission.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flax import nnx

from areal_jax.inference.engine import Engine
from areal_jax.sharding import copy_to
from areal_jax.weights.base import tree_nbytes

logger = logging.getLogger(__name__)


def unaliased_for(engine: Engine, params: nnx.State) -> nnx.State:
    """What to hand `engine.load_params` of trainer params the trainer donates to its next step: the params
    themselves when the engine stores cast copies of them (`Engine.casts_weights`), else a device-to-device
    copy onto its shardings (for a LoRA version of adapters alone, their shardings)."""
    return params if engine.casts_weights else copy_to(params, engine.shardings_for(params))


class InProcessPublisher:
    """Trainer -> generator weights within one program; see the module docstring. `apply(params, version)`
    is the rollout side's (`RolloutSide.apply`: the generator, then admission)."""

    def __init__(self, engine: Engine, apply: Callable[[nnx.State, int], None]):
        self.engine = engine
        self.apply = apply

    def publish(self, params: nnx.State, version: int) -> None:
        """Publish `params` as `version`; returns once the generator uses them and admission follows."""
        started = time.perf_counter()
        source = unaliased_for(self.engine, params)
        self.apply(source, version)
        logger.debug(
            "published v%d in process: %d bytes in %.3f s", version, tree_nbytes(source), time.perf_counter() - started
        )

    def close(self) -> None:
        pass
