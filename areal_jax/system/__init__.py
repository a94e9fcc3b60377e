"""Wiring of the rollout side and the trainer side into runnable systems."""
