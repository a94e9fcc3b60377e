"""Dynamic batching (AReaL Algorithm 1): pack variable-length sequences into fixed-shape micro-batches.

Host-side NumPy. A micro-batch is a `[rows, length]` array whose rows hold whole sequences back to back,
described by `segment_ids` (0 = padding, 1.. = the sequences of a row in order) and `positions` (0 at the
start of every sequence). The shape is chosen per step from a small fixed set of buckets: a row length from
the ladder of `ROW_LENGTHS` (8 steps per octave) and `rows * 2^j` rows, within the memory cap
`rows x length <= token_budget`; a batch that fits in fewer than `rows` rows is one micro-batch of
`min_rows * 2^j` rows instead (a small batch costs its own tokens, not `rows` rows of padding). For every
row length the sequences are placed first-fit-decreasing; the bucket and micro-batch count with the fewest
token slots (least padding) win. The micro-batch count is
padded up (to a multiple or a power of two), so only a few shapes ever reach jit. `fixed_count_plan` is the
baseline for comparison: a fixed number of sequences per micro-batch, padded to the longest.
Legend: N sequences, P mini-batches packed to one shape, M micro-batches, B rows of a micro-batch, L row length.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from areal_jax.configuration import Config, ConfigError, option

# Row lengths of the buckets: 1..15, then m * 2^e for m in 8..15 (8 per octave, adjacent ones <= 12.5% apart);
# from 64 on they are multiples of 8, from 1024 on multiples of 128.
ROW_LENGTHS = tuple(sorted({*range(1, 16), *(m << e for m in range(8, 16) for e in range(1, 24))}))
# `token_budget: auto` per platform, before it is raised to fit the longest sample
AUTO_TOKEN_BUDGET = {"cpu": 1024, "accelerator": 16384}


@dataclasses.dataclass(frozen=True)
class PackingConfig(Config):
    """The buckets the packed micro-batches are shaped from, the memory cap, and how their count is rounded."""

    token_budget: int | Literal["auto"] = option(
        "auto",
        gt=0,
        doc="memory cap: token slots (rows * row length) of one micro-batch; each step's shape is chosen under it. "
        f"auto: about {AUTO_TOKEN_BUDGET['cpu']} on CPU (a micro-batch whose activations stay in the cache: "
        f"docs/benchmarks.md), {AUTO_TOKEN_BUDGET['accelerator']} on TPU/GPU, raised to rows x the run's "
        "longest sample when that is more",
    )
    rows: int = option(
        8,
        gt=0,
        doc="row granularity: a micro-batch has rows * 2^j rows (a multiple of the trainer's data*fsdp shards); "
        "the longest row, so the longest sequence, is token_budget / rows",
    )
    min_rows: int | None = option(
        None,
        gt=0,
        doc="fewest rows of a micro-batch: a batch that fits in fewer than `rows` rows is one micro-batch of "
        "min_rows * 2^j rows (so its cost follows its tokens), larger batches use rows * 2^j; null = the "
        "trainer's data*fsdp shards (outside a trainer: rows)",
    )
    microbatch_rounding: Literal["multiple", "pow2"] = option(
        "multiple",
        doc="pad the number of micro-batches up to a multiple of microbatch_multiple, or to a power of two",
    )
    microbatch_multiple: int = option(1, ge=1, doc="with rounding 'multiple': the micro-batch count is a multiple")
    min_row_length: int = option(
        0,
        ge=0,
        doc="no bucket has shorter rows (0 = any length): fewer shapes to compile when the longest sequence of a "
        "step swings widely, at the cost of padding; at most token_budget / rows",
    )

    def validate(self) -> None:
        budget_set = self.token_budget != "auto"  # auto is chosen to fit: `resolved`
        if budget_set and self.token_budget % self.rows:
            raise ConfigError("token_budget", f"{self.token_budget} is not divisible by rows={self.rows}")
        if self.microbatch_rounding == "pow2" and self.microbatch_multiple != 1:
            raise ConfigError(
                "microbatch_multiple", f"is {self.microbatch_multiple} but microbatch_rounding is 'pow2'; set it to 1"
            )
        if self.min_rows is not None and self.min_rows > self.rows:
            raise ConfigError("min_rows", f"value {self.min_rows} exceeds rows={self.rows} (the longest row's count)")
        if budget_set and self.min_row_length > self.row_length:
            raise ConfigError(
                "min_row_length",
                f"value {self.min_row_length} exceeds the longest row, token_budget / rows = {self.row_length}",
            )

    def resolved(self, platform: str, longest: int = 0) -> PackingConfig:
        """This config with `token_budget: auto` chosen for `platform` ('cpu', 'gpu', 'tpu'): the platform's
        budget, raised so a row holds a sample of `longest` tokens (and divisible by `rows`)."""
        if self.token_budget != "auto":
            return self
        target = AUTO_TOKEN_BUDGET["cpu" if platform == "cpu" else "accelerator"]
        row_length = max(-(-target // self.rows), longest, self.min_row_length)
        return self.replace(token_budget=self.rows * row_length)

    @property
    def row_length(self) -> int:
        """The longest row of any bucket (and so the longest sequence that can be packed)."""
        if self.token_budget == "auto":
            raise ValueError("packing.token_budget is 'auto': resolve it with PackingConfig.resolved(platform) first")
        return self.token_budget // self.rows

    def row_lengths(self, longest: int) -> list[int]:
        """The bucket row lengths a batch whose longest sequence is `longest` can use (the longest row included)."""
        shortest = max(longest, self.min_row_length)
        return [n for n in ROW_LENGTHS if shortest <= n < self.row_length] + [self.row_length]

    @property
    def fewest_rows(self) -> int:
        """The smallest row count of a bucket: `min_rows`, else `rows`."""
        return self.min_rows if self.min_rows is not None else self.rows

    def row_counts(self, row_length: int) -> list[int]:
        """The bucket row counts of micro-batches with rows of `row_length` within the token budget:
        fewest_rows * 2^j below `rows` (for batches one such micro-batch holds), then rows * 2^j."""
        budget = self.rows * self.row_length  # token_budget, refused by `row_length` while it is auto
        small = [self.fewest_rows << j for j in range(self.rows.bit_length()) if self.fewest_rows << j < self.rows]
        counts, count = [c for c in small if c * row_length <= budget], self.rows
        while count * row_length <= budget:
            counts.append(count)
            count *= 2
        return counts

    def round_microbatches(self, count: int) -> int:
        """The padded number of micro-batches for `count` needed ones."""
        if self.microbatch_rounding == "pow2":
            return 1 << max(count - 1, 0).bit_length()
        return -(-count // self.microbatch_multiple) * self.microbatch_multiple


@dataclasses.dataclass(frozen=True, eq=False)
class PackPlan:
    """Where every sequence went: sequence i, token t lies at (microbatch_N[i], row_N[i], offset_N[i] + t)."""

    lengths_N: np.ndarray
    microbatch_N: np.ndarray
    row_N: np.ndarray
    offset_N: np.ndarray
    segment_N: np.ndarray
    shapes: tuple[tuple[int, int], ...]

    @property
    def num_sequences(self) -> int:
        return len(self.lengths_N)

    @property
    def num_microbatches(self) -> int:
        return len(self.shapes)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths_N.sum())

    @property
    def capacity(self) -> int:
        """Token slots in all micro-batches together, padding included."""
        return sum(rows * length for rows, length in self.shapes)

    @functools.cached_property
    def _bases(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([rows * length for rows, length in self.shapes])])

    @functools.cached_property
    def _token_slots(self) -> np.ndarray:
        """Flat slot of every token (sequences concatenated in index order) in the concatenated micro-batches."""
        lengths = np.array([length for _, length in self.shapes], dtype=np.int64)
        starts_N = self._bases[self.microbatch_N] + self.row_N * lengths[self.microbatch_N] + self.offset_N
        return np.repeat(starts_N, self.lengths_N) + self._token_ranks

    @functools.cached_property
    def _token_ranks(self) -> np.ndarray:
        """Index of every token within its sequence (sequences concatenated in index order)."""
        firsts_N = np.cumsum(self.lengths_N) - self.lengths_N
        return np.arange(self.num_tokens) - np.repeat(firsts_N, self.lengths_N)

    def _scatter(self, tokens: np.ndarray, pad_value: Any) -> list[np.ndarray]:
        flat = np.full((self.capacity, *tokens.shape[1:]), pad_value, dtype=tokens.dtype)
        flat[self._token_slots] = tokens
        return [
            flat[self._bases[m] : self._bases[m + 1]].reshape(rows, length, *tokens.shape[1:])
            for m, (rows, length) in enumerate(self.shapes)
        ]

    def pack(self, values: Sequence[np.ndarray], pad_value: Any = 0) -> list[np.ndarray]:
        """Per-token arrays of every sequence (`values[i]` of shape [len_i, ...]) → one [B, L, ...] per micro-batch."""
        if len(values) != self.num_sequences:
            raise ValueError(f"got {len(values)} sequences to pack; the plan holds {self.num_sequences}")
        arrays = [np.asarray(v) for v in values]
        for i, array in enumerate(arrays):
            if array.ndim == 0 or array.shape[0] != self.lengths_N[i]:
                raise ValueError(f"sequence {i} has shape {array.shape}; the plan expects length {self.lengths_N[i]}")
        return self._scatter(np.concatenate(arrays), pad_value)

    def broadcast(self, values_N: np.ndarray, pad_value: Any = 0) -> list[np.ndarray]:
        """A per-sequence value (shape [N, ...]) written to each of its tokens, per micro-batch."""
        values_N = np.asarray(values_N)
        if values_N.shape[:1] != (self.num_sequences,):
            raise ValueError(f"values_N has shape {values_N.shape}; expected leading axis {self.num_sequences}")
        return self._scatter(np.repeat(values_N, self.lengths_N, axis=0), pad_value)

    def segment_ids(self) -> list[np.ndarray]:
        """[B, L] int32 per micro-batch: 0 on padding, 1.. for the sequences of a row in order."""
        return self.broadcast(self.segment_N.astype(np.int32))

    def positions(self) -> list[np.ndarray]:
        """[B, L] int32 per micro-batch: the index of each token within its sequence (0 on padding)."""
        return self._scatter(self._token_ranks.astype(np.int32), 0)

    def seq_index(self) -> list[np.ndarray]:
        """[B, L] int32 per micro-batch: the sequence each token belongs to, -1 on padding."""
        return self.broadcast(np.arange(self.num_sequences, dtype=np.int32), pad_value=-1)

    def unpack(self, packed: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per-token outputs, one [B, L, ...] per micro-batch (or stacked [M, B, L, ...]) → one array per sequence."""
        if len(packed) != self.num_microbatches:
            raise ValueError(f"got {len(packed)} micro-batches; the plan has {self.num_microbatches}")
        arrays = [np.asarray(p) for p in packed]
        for m, (array, shape) in enumerate(zip(arrays, self.shapes, strict=True)):
            if array.shape[:2] != shape:
                raise ValueError(f"micro-batch {m} has shape {array.shape}; the plan expects {shape} leading")
        flat = np.concatenate([a.reshape(-1, *a.shape[2:]) for a in arrays])
        return np.split(flat[self._token_slots], np.cumsum(self.lengths_N)[:-1])


def _check_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    lengths_N = np.asarray(lengths)
    if lengths_N.ndim != 1 or lengths_N.size == 0 or not np.issubdtype(lengths_N.dtype, np.integer):
        raise ValueError(f"lengths must be a non-empty 1-d integer sequence; got {lengths_N.dtype} {lengths_N.shape}")
    empty = np.flatnonzero(lengths_N < 1)
    if empty.size:
        raise ValueError(f"sequence {empty[0]} has length {lengths_N[empty[0]]}; every sequence needs >= 1 token")
    return lengths_N.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _RowPlacement:
    """First-fit-decreasing placement of one mini-batch's sequences into rows of one length."""

    row_N: np.ndarray
    offset_N: np.ndarray
    segment_N: np.ndarray
    num_rows: int


def first_fit_decreasing(lengths_N: np.ndarray, row_length: int) -> _RowPlacement:
    """Longest first, each sequence into the first row with room, a new row otherwise (sequences must fit a row)."""
    free: list[int] = []  # per used row, the tokens still free
    count: list[int] = []
    row_N, offset_N, segment_N = (np.empty_like(lengths_N) for _ in range(3))
    for i in np.argsort(-lengths_N, kind="stable").tolist():
        n = int(lengths_N[i])
        r = next((r for r, room in enumerate(free) if room >= n), len(free))
        if r == len(free):
            free.append(row_length)
            count.append(0)
        row_N[i], offset_N[i] = r, row_length - free[r]
        free[r] -= n
        count[r] += 1
        segment_N[i] = count[r]
    return _RowPlacement(row_N, offset_N, segment_N, len(free))


def plan_minibatches(lengths_P: Sequence[Sequence[int] | np.ndarray], config: PackingConfig) -> list[PackPlan]:
    """Pack each of P mini-batches into micro-batches of one common bucket `[M, B, L]`: the one with the fewest
    token slots P * M * B * L (ties: fewer micro-batches, then shorter rows) over the bucket row lengths L, row
    counts B and the rounded micro-batch counts M that hold every mini-batch's first-fit-decreasing rows.

    A sequence longer than `config.row_length` is refused with an error naming its index and length.
    """
    checked_P = [_check_lengths(lengths) for lengths in lengths_P]
    longest = max(int(lengths.max()) for lengths in checked_P)
    if longest > config.row_length:
        p = next(p for p, lengths in enumerate(checked_P) if lengths.max() == longest)
        i = int(np.argmax(checked_P[p]))
        where = f"sequence {i}" if len(checked_P) == 1 else f"sequence {i} of mini-batch {p}"
        raise ValueError(
            f"{where} has length {longest} > row length {config.row_length} "
            f"(token_budget {config.token_budget} / rows {config.rows}); it cannot be packed"
        )
    tokens = max(int(lengths.sum()) for lengths in checked_P)
    num_minibatches = len(checked_P)

    def bound(row_length: int) -> int:  # no bucket of this row length has fewer slots
        # a row holds at most row_length tokens and at most one sequence longer than half of it
        rows = max(-(-tokens // row_length), *(int(np.sum(2 * lengths > row_length)) for lengths in checked_P))
        return num_minibatches * row_length * -(-rows // config.fewest_rows) * config.fewest_rows

    best: tuple[tuple[int, int, int], int, list[_RowPlacement]] | None = None
    for row_length in sorted(config.row_lengths(longest), key=bound):
        if best is not None and bound(row_length) > best[0][0]:
            break
        placements = [first_fit_decreasing(lengths, row_length) for lengths in checked_P]
        rows_needed = max(placement.num_rows for placement in placements)
        for rows in config.row_counts(row_length):
            if rows < config.rows and rows < rows_needed:
                continue  # fewer rows than `rows` only for a batch they hold whole: big batches keep their buckets
            count = config.round_microbatches(-(-rows_needed // rows))
            key = (num_minibatches * count * rows * row_length, count, row_length)
            if best is None or key < best[0]:
                best = (key, rows, placements)
    assert best is not None  # `rows` rows of `row_length` (the longest row length) always fit the budget
    (_, count, row_length), rows, placements = best
    return [
        PackPlan(
            lengths_N=lengths,
            microbatch_N=placement.row_N // rows,
            row_N=placement.row_N % rows,
            offset_N=placement.offset_N,
            segment_N=placement.segment_N,
            shapes=((rows, row_length),) * count,
        )
        for lengths, placement in zip(checked_P, placements, strict=True)
    ]


def pack_sequences(lengths: Sequence[int] | np.ndarray, config: PackingConfig) -> PackPlan:
    """One mini-batch packed into the bucket with the least padding (`plan_minibatches`)."""
    return plan_minibatches([lengths], config)[0]


def fixed_count_plan(
    lengths: Sequence[int] | np.ndarray, seqs_per_microbatch: int, length_multiple: int = 1
) -> PackPlan:
    """Baseline batching: consecutive sequences, `seqs_per_microbatch` per micro-batch, one per row, each
    micro-batch padded to its longest sequence (rounded up to `length_multiple`); the last one gets empty rows."""
    if seqs_per_microbatch < 1:
        raise ValueError(f"seqs_per_microbatch must be >= 1; got {seqs_per_microbatch}")
    if length_multiple < 1:
        raise ValueError(f"length_multiple must be >= 1; got {length_multiple}")
    lengths_N = _check_lengths(lengths)
    index_N = np.arange(len(lengths_N))
    microbatch_N = index_N // seqs_per_microbatch
    num_microbatches = int(microbatch_N[-1]) + 1
    longest_M = np.zeros(num_microbatches, dtype=np.int64)
    np.maximum.at(longest_M, microbatch_N, lengths_N)
    padded_M = -(-longest_M // length_multiple) * length_multiple
    return PackPlan(
        lengths_N=lengths_N,
        microbatch_N=microbatch_N,
        row_N=index_N % seqs_per_microbatch,
        offset_N=np.zeros_like(lengths_N),
        segment_N=np.ones_like(lengths_N),
        shapes=tuple((seqs_per_microbatch, int(length)) for length in padded_M),
    )
