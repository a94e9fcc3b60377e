"""Flax NNX decoder models, HF checkpoint I/O and tokenizers."""
