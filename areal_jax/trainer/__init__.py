"""The trainer: sharded train step, training loop, checkpoints."""
