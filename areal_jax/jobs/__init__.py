"""The jobs: what `areal-jax` runs (train, trainer, rollout, launch), assembled from the system layer."""
