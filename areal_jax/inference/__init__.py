"""Rollout-side inference: sampling and generation over the decoder's KV-cache paths."""
