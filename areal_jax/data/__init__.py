"""Prompt datasets, the rollout log and the trainer-side Grain pipeline."""
