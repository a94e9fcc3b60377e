"""Ahead-of-time compilation of a run's programs for Cloud TPU topologies on any machine (`areal-jax compile`)."""
