"""The trainer → rollout weight channel: versioned params, published once, loaded onto each reader's mesh.

`OrbaxWeightPublisher` / `OrbaxWeightSubscriber` share a directory (local or gs://) across processes;
`InProcessWeights` reshards between two meshes of one JAX program with `jax.device_put`.
"""

from areal_jax.weights.base import (
    LoadedWeights,
    WeightPublisher,
    WeightSubscriber,
    abstract_target,
    target_shardings,
    tree_nbytes,
)
from areal_jax.weights.in_process import InProcessWeights
from areal_jax.weights.orbax_store import OrbaxWeightPublisher, OrbaxWeightSubscriber

__all__ = [
    "InProcessWeights",
    "LoadedWeights",
    "OrbaxWeightPublisher",
    "OrbaxWeightSubscriber",
    "WeightPublisher",
    "WeightSubscriber",
    "abstract_target",
    "target_shardings",
    "tree_nbytes",
]
