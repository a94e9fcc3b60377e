"""The trainer → rollout weight channel: versioned params, published once, loaded onto each reader's mesh.

`OrbaxWeightPublisher` / `OrbaxWeightSubscriber` share a directory (local or gs://) across processes;
`DirectWeightPublisher` / `DirectWeightSubscriber` pull each version from the trainer's memory over JAX's
transfer server, with such a directory kept beside them; `InProcessPublisher` copies the trainer's params
onto the generator's shardings within one JAX program.
"""

from areal_jax.weights.base import (
    LoadedWeights,
    WeightPublisher,
    WeightSubscriber,
    abstract_target,
    target_shardings,
    tree_nbytes,
)
from areal_jax.weights.direct import DirectWeightPublisher, DirectWeightSubscriber
from areal_jax.weights.in_process import InProcessPublisher
from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber

__all__ = [
    "DirectWeightPublisher",
    "DirectWeightSubscriber",
    "InProcessPublisher",
    "LoadedWeights",
    "OrbaxWeightPublisher",
    "OrbaxWeightSubscriber",
    "WeightPublisher",
    "WeightSubscriber",
    "abstract_target",
    "target_shardings",
    "tree_nbytes",
]
