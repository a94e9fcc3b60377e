"""The jobs: what `areal-jax` runs (train, trainer, rollout, launch, sft, demo), assembled from the system layer."""
