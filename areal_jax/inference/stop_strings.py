"""Stop strings found in a sample's text as it is decoded, one token at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from areal_jax.models.tokenizer import IncrementalDecoder


class StopStringMatcher:
    """Whether a sample's text contains one of its stop strings, fed one token at a time: only the new
    text and the stop strings' possible overlap with the text before it are searched."""

    def __init__(self, stop_strings: tuple[str, ...], decode: Callable[[Sequence[int]], str]):
        self._stops = stop_strings
        self._overlap = max(0, *(len(stop) - 1 for stop in stop_strings))
        self._decoder = IncrementalDecoder(decode)
        self._tail = ""

    def push(self, token: int) -> bool:
        new = self._decoder.push(token)
        if not new:
            return False
        window = self._tail + new
        self._tail = window[-self._overlap :] if self._overlap else ""
        return any(stop in window for stop in self._stops)
