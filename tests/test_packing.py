"""Token-budget packing: budget respected, every token exactly once, fixed shapes, refusals, the baseline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.packing import PackingConfig, PackPlan, fixed_count_plan, pack_sequences


def check_layout(plan: PackPlan) -> None:
    """Segments contiguous and numbered 1.. per row, positions restart, each (sequence, token) exactly once."""
    seen = np.zeros(plan.num_tokens, dtype=int)
    firsts = np.cumsum(plan.lengths_N) - plan.lengths_N
    for m, (seg, pos, idx) in enumerate(zip(plan.segment_ids(), plan.positions(), plan.seq_index(), strict=True)):
        assert seg.shape == pos.shape == idx.shape == plan.shapes[m]
        assert seg.dtype == pos.dtype == idx.dtype == np.int32
        np.testing.assert_array_equal(seg == 0, idx == -1)
        assert np.all(pos[seg == 0] == 0)
        for row_seg, row_pos, row_idx in zip(seg, pos, idx, strict=True):
            used = row_seg > 0
            n_used = int(used.sum())
            assert np.all(used[:n_used]), "padding only at the end of a row"
            starts = np.flatnonzero(np.diff(np.concatenate([[0], row_seg[:n_used]])) != 0)
            np.testing.assert_array_equal(row_seg[starts], np.arange(1, len(starts) + 1))
            np.testing.assert_array_equal(row_pos[starts], 0)
            for s in range(len(starts)):
                stop = starts[s + 1] if s + 1 < len(starts) else n_used
                i = row_idx[starts[s]]
                assert np.all(row_idx[starts[s] : stop] == i)
                np.testing.assert_array_equal(row_pos[starts[s] : stop], np.arange(plan.lengths_N[i]))
        np.add.at(seen, firsts[idx[idx >= 0]] + pos[idx >= 0], 1)
    np.testing.assert_array_equal(seen, 1)


def random_lengths(seed: int, n: int, high: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high + 1, size=n)


@pytest.mark.parametrize("seed", range(4))
def test_budget_respected_and_every_token_once(seed):
    cfg = PackingConfig(token_budget=256, rows=4)
    lengths = random_lengths(seed, 50, cfg.row_length)
    plan = pack_sequences(lengths, cfg)
    assert set(plan.shapes) == {(4, 64)}
    for m in range(plan.num_microbatches):
        in_m = plan.microbatch_N == m
        assert plan.lengths_N[in_m].sum() <= cfg.token_budget
        for r in range(cfg.rows):
            in_row = in_m & (plan.row_N == r)
            assert plan.lengths_N[in_row].sum() <= cfg.row_length
            assert np.all(plan.offset_N[in_row] + plan.lengths_N[in_row] <= cfg.row_length)
    check_layout(plan)
    assert plan.num_microbatches >= -(-lengths.sum() // cfg.token_budget)


def test_round_trip_of_per_token_values_with_trailing_axes():
    lengths = random_lengths(5, 30, 24)
    plan = pack_sequences(lengths, PackingConfig(token_budget=96, rows=3, microbatch_rounding="pow2"))
    rng = np.random.default_rng(6)
    values = [rng.normal(size=(n, 2, 3)).astype(np.float32) for n in lengths]
    packed = plan.pack(values, pad_value=np.nan)
    assert all(p.shape == (3, 32, 2, 3) for p in packed)
    assert sum(int(np.isfinite(p[..., 0, 0]).sum()) for p in packed) == lengths.sum()
    for got, want in zip(plan.unpack(packed), values, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(plan.unpack(np.stack(packed)), values, strict=True):
        np.testing.assert_array_equal(got, want)
    for i in (0, 7, 29):
        for t in (0, lengths[i] - 1):
            m, r, c = plan.locate(i, t)
            np.testing.assert_array_equal(packed[m][r, c], values[i][t])
    broadcast = plan.unpack(plan.broadcast(np.arange(30) * 10))
    for i, (seq_values, n) in enumerate(zip(broadcast, lengths, strict=True)):
        np.testing.assert_array_equal(seq_values, np.full(n, 10 * i))


def test_first_fit_decreasing_fills_rows_tightly():
    plan = pack_sequences([2, 6, 3, 2, 5, 4, 2], PackingConfig(token_budget=16, rows=2))
    assert plan.num_microbatches == 2  # 3 rows of 8 are enough for 24 tokens: [6, 2], [5, 3], [4, 2, 2]
    global_row_N = plan.microbatch_N * 2 + plan.row_N
    rows = [plan.lengths_N[global_row_N == g][np.argsort(plan.offset_N[global_row_N == g])].tolist() for g in range(4)]
    assert rows == [[6, 2], [5, 3], [4, 2, 2], []]
    assert plan.capacity == 32 and plan.num_tokens == 24


@pytest.mark.parametrize(
    ("rounding", "multiple", "allowed"),
    [("multiple", 1, None), ("multiple", 3, {3, 6, 9, 12, 15}), ("pow2", 1, {1, 2, 4, 8, 16})],
)
def test_microbatch_count_comes_from_a_small_fixed_set(rounding, multiple, allowed):
    cfg = PackingConfig(token_budget=128, rows=2, microbatch_rounding=rounding, microbatch_multiple=multiple)
    counts = set()
    for seed in range(12):
        n = int(np.random.default_rng(seed).integers(1, 40))
        plan = pack_sequences(random_lengths(seed, n, 64), cfg)
        needed = int(plan.microbatch_N.max()) + 1
        assert plan.num_microbatches >= needed
        assert set(plan.shapes) == {(2, 64)}
        if allowed is None:
            assert plan.num_microbatches == needed
        else:
            assert plan.num_microbatches in allowed
            assert plan.num_microbatches == min(a for a in allowed if a >= needed)
        counts.add(plan.num_microbatches)
    assert len(counts) > 1


def test_jitted_step_compiles_once_across_batches():
    cfg = PackingConfig(token_budget=64, rows=2)
    step = jax.jit(lambda seg, pos: jnp.sum(jnp.where(seg > 0, pos, 0)))
    for seed in range(5):
        plan = pack_sequences(random_lengths(seed, 20, 32), cfg)
        total = sum(int(step(s, p)) for s, p in zip(plan.segment_ids(), plan.positions(), strict=True))
        assert total == sum(n * (n - 1) // 2 for n in plan.lengths_N)
    assert step._cache_size() == 1


def test_oversize_and_empty_sequences_are_refused():
    cfg = PackingConfig(token_budget=64, rows=2)
    with pytest.raises(ValueError, match=r"sequence 3 has length 40 > row length 32"):
        pack_sequences([5, 32, 7, 40, 50], cfg)
    with pytest.raises(ValueError, match=r"sequence 1 has length 0"):
        pack_sequences([5, 0, 7], cfg)
    with pytest.raises(ValueError, match="non-empty 1-d integer"):
        pack_sequences([], cfg)
    plan = pack_sequences([5, 7], cfg)
    with pytest.raises(ValueError, match=r"sequence 1 has shape \(6,\); the plan expects length 7"):
        plan.pack([np.zeros(5), np.zeros(6)])
    with pytest.raises(IndexError, match="token 7 out of range for sequence 1"):
        plan.locate(1, 7)


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="token_budget: 100 is not divisible by rows=3"):
        PackingConfig(token_budget=100, rows=3)
    with pytest.raises(ConfigError, match="microbatch_multiple: is 2 but microbatch_rounding is 'pow2'"):
        PackingConfig(microbatch_rounding="pow2", microbatch_multiple=2)
    with pytest.raises(ConfigError, match="rows: value 0 is out of range"):
        PackingConfig(rows=0)


def test_fixed_count_baseline():
    lengths = np.array([5, 9, 2, 7, 3, 3, 8])
    plan = fixed_count_plan(lengths, seqs_per_microbatch=3, length_multiple=4)
    assert plan.shapes == ((3, 12), (3, 8), (3, 8))
    np.testing.assert_array_equal(plan.microbatch_N, [0, 0, 0, 1, 1, 1, 2])
    np.testing.assert_array_equal(plan.row_N, [0, 1, 2, 0, 1, 2, 0])
    check_layout(plan)
    last = plan.seq_index()[2]
    np.testing.assert_array_equal(last[0], [6] * 8)
    assert np.all(last[1:] == -1)
    values = [np.arange(n) + 100 * i for i, n in enumerate(lengths)]
    for got, want in zip(plan.unpack(plan.pack(values)), values, strict=True):
        np.testing.assert_array_equal(got, want)
    assert plan.capacity == 3 * 12 + 3 * 8 + 3 * 8
    with pytest.raises(ValueError, match="seqs_per_microbatch must be >= 1; got 0"):
        fixed_count_plan(lengths, 0)
