"""Logits parity with HF transformers (torch, CPU) for tiny random Qwen2, Qwen3 and Llama-3 models."""

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.hf_io import load_hf_checkpoint
from tests.hf_fixtures import VARIANTS, hf_logits, make_hf_checkpoint

LENGTHS = (5, 17, 31, 9)


def _sequences(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in LENGTHS]


def _padded(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    segments = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
        segments[row, : len(seq)] = 1
        positions[row, : len(seq)] = np.arange(len(seq))
    return tokens, segments, positions


def _packed(seqs: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    tokens = np.zeros((1, width), np.int32)
    segments = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    spans, offset = [], 0
    for index, seq in enumerate(seqs):
        tokens[0, offset : offset + len(seq)] = seq
        segments[0, offset : offset + len(seq)] = index + 1
        positions[0, offset : offset + len(seq)] = np.arange(len(seq))
        spans.append((offset, len(seq)))
        offset += len(seq)
    return tokens, segments, positions, spans


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    torch_model = make_hf_checkpoint(variant, tmp_path)
    cfg, model = load_hf_checkpoint(tmp_path)
    assert cfg.num_heads // cfg.num_kv_heads == 3
    seqs = _sequences(cfg.vocab_size)
    references = [hf_logits(torch_model, s) for s in seqs]

    tokens, segments, positions = _padded(seqs)
    logits = np.asarray(model.logits(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)))
    for row, ref in enumerate(references):
        np.testing.assert_allclose(logits[row, : len(seqs[row])], ref, atol=1e-4, rtol=0)

    tokens, segments, positions, spans = _packed(seqs, width=sum(LENGTHS) + 3)
    logits = np.asarray(model.logits(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)))
    for (offset, n), ref in zip(spans, references, strict=True):
        np.testing.assert_allclose(logits[0, offset : offset + n], ref, atol=1e-4, rtol=0)


def test_config_fields_read_from_hf(tmp_path):
    make_hf_checkpoint("llama3-tied", tmp_path / "llama")
    cfg, _ = load_hf_checkpoint(tmp_path / "llama")
    assert cfg.family == "llama" and cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_theta == 500000.0
    make_hf_checkpoint("qwen3-tied", tmp_path / "qwen3")
    cfg, _ = load_hf_checkpoint(tmp_path / "qwen3")
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and cfg.resolved_head_dim == 16
