"""Seeds derived on the host: one mixing function for every seed the rollout side derives."""

from __future__ import annotations


def mix_seed(*values: int) -> int:
    """A well-spread seed in [0, 2**63) from `values` (SplitMix64, on the host). Every derived seed comes
    from here: a request's when it has none, each sample's PRNG key, a workflow's per-group and per-turn
    seeds. It fits an int64, so any consumer of `SamplingParams.seed` takes it."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 31
    return state >> 1


def sample_key_words(seed: int, sample_index: int, position: int) -> tuple[int, int]:
    """The two uint32 words of the PRNG key a sample uses when (re-)inserted after `position` tokens."""
    mixed = mix_seed(seed, sample_index, position)
    return mixed >> 32, mixed & 0xFFFFFFFF
