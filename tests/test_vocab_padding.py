"""Vocabulary padding: ids >= vocab_limit are never sampled, and behaviour and trainer log-probs are both
normalised over the usable ids only."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import MASKED_LOGIT, Decoder, mask_padded_vocab
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint

VOCAB, LIMIT = 64, 27
PADDED = ModelConfig(
    vocab_size=VOCAB,
    vocab_limit=LIMIT,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    initializer_range=0.3,
    logprob_chunk=7,
)
UNPADDED = PADDED.replace(vocab_limit=None)


def _model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    return Decoder(cfg, nnx.Rngs(seed))  # vocab_limit does not enter the init: same seed, same weights


def _np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    top = z.max(-1, keepdims=True)
    return z - (np.log(np.exp(z - top).sum(-1, keepdims=True)) + top)


def _packed(rng: np.random.Generator, rows: int, length: int):
    tokens = jnp.asarray(rng.integers(0, LIMIT, (rows, length)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, LIMIT, (rows, length)), jnp.int32)
    segments = jnp.ones((rows, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
    return tokens, targets, segments, positions


def test_usable_vocab_and_refusals():
    assert PADDED.usable_vocab == LIMIT and UNPADDED.usable_vocab == VOCAB
    with pytest.raises(ConfigError, match=r"vocab_limit.*65.*vocab_size=64") as err:
        PADDED.replace(vocab_limit=VOCAB + 1)
    assert err.value.key == "vocab_limit"
    with pytest.raises(ConfigError, match="vocab_limit"):
        PADDED.replace(vocab_limit=0)
    assert PADDED.replace(vocab_limit=VOCAB).usable_vocab == VOCAB


def test_no_mask_op_when_nothing_is_padded():
    logits = jnp.zeros((2, 3, VOCAB))
    assert mask_padded_vocab(logits, VOCAB) is logits
    tokens, _, segments, positions = _packed(np.random.default_rng(0), 1, 4)
    programs = {}
    for limit in (None, VOCAB, LIMIT):
        model = _model(PADDED.replace(vocab_limit=limit))
        programs[limit] = jax.make_jaxpr(lambda t, m=model: m.logits(t, segments, positions))(tokens)
    assert len(programs[VOCAB].eqns) == len(programs[None].eqns) < len(programs[LIMIT].eqns)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_scoring_equals_numpy_over_usable_ids(temperature):
    padded, unpadded = _model(PADDED), _model(UNPADDED)
    tokens, targets, segments, positions = _packed(np.random.default_rng(1), 3, 20)  # 20: not a multiple of 7
    raw = np.asarray(unpadded.logits(tokens, segments, positions))
    probs_padded = np.exp(_np_log_softmax(raw))[..., LIMIT:].sum(-1)
    assert probs_padded.min() > 0.05  # without the mask the padded ids would carry real mass

    masked = np.asarray(padded.logits(tokens, segments, positions))
    np.testing.assert_array_equal(masked[..., :LIMIT], raw[..., :LIMIT])
    assert (masked[..., LIMIT:] == MASKED_LOGIT).all()

    logp, entropy = padded.token_logprobs(tokens, targets, segments, positions, temperature)
    log_probs = _np_log_softmax(raw[..., :LIMIT] / temperature)
    expected = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, expected, atol=2e-5)
    assert np.isfinite(np.asarray(entropy)).all()
    np.testing.assert_allclose(entropy, -(np.exp(log_probs) * log_probs).sum(-1), atol=2e-5)


def test_masked_scoring_has_finite_gradients():
    model = _model(PADDED)
    tokens, targets, segments, positions = _packed(np.random.default_rng(2), 2, 12)

    def loss(m: Decoder) -> jax.Array:
        logp, entropy = m.token_logprobs(tokens, targets, segments, positions, 0.9)
        return jnp.sum(logp) + jnp.sum(entropy)

    grads = nnx.grad(loss)(model)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_prefill_and_decode_logits_are_masked():
    model = _model(PADDED)
    logits, cache = model.prefill(jnp.asarray([[1, 2, 3, 0], [4, 5, 6, 7]]), jnp.asarray([3, 4]))
    assert (np.asarray(logits)[:, LIMIT:] == MASKED_LOGIT).all()
    logits, _ = model.decode_step(jnp.asarray([8, 9]), jnp.asarray([3, 4]), cache)
    assert (np.asarray(logits)[:, LIMIT:] == MASKED_LOGIT).all()


def test_engine_never_samples_padded_ids_and_matches_trainer_logprobs():
    """64 slots each run to the end of the cache: > 10,000 tokens with plain, top-k and top-p sampling;
    the plain-temperature ones carry the trainer's log-probs. Over this many tokens the rounding of the
    cached decode against the full forward reaches ~1e-5 in a few places, also without any padding,
    hence the rtol next to atol=1e-5."""
    model = _model(PADDED, seed=1)
    slots, length = 64, 176
    engine = Engine(model, EngineConfig(max_slots=slots, max_length=length))
    params = engine.load_params(nnx.state(model), 0)
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
    ]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, LIMIT, 3 + slot % 8).tolist() for slot in range(slots)]
    samplings = [kinds[slot % len(kinds)] for slot in range(slots)]
    state = engine.init_decode_state()
    for slot, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        padded, n = engine.pad_tokens(prompt)
        state = engine.insert(engine.prefill(params, padded, n), state, slot, sampling, jax.random.key(slot))
    emitted, logprobs = [], []
    for _ in range(length - min(len(p) for p in prompts)):
        state, result = engine.generate(params, state)
        emitted.append(np.asarray(result.tokens))
        logprobs.append(np.asarray(result.logprobs))
    emitted_SxN, logprobs_SxN = np.stack(emitted, axis=1), np.stack(logprobs, axis=1)
    # slot s emits tokens fed at positions len(prompt) .. length - 1; later steps are clamped no-ops
    outputs = [emitted_SxN[s, : length - len(p)] for s, p in enumerate(prompts)]
    behaviour = [logprobs_SxN[s, : length - len(p)] for s, p in enumerate(prompts)]
    sampled = np.concatenate(outputs)
    assert sampled.size >= 10_000
    assert sampled.max() < LIMIT
    assert len(np.unique(sampled)) > LIMIT // 2

    seqs = np.stack([np.concatenate([p, o]) for p, o in zip(prompts, outputs, strict=True)]).astype(np.int32)
    targets = np.concatenate([seqs[:, 1:], np.zeros((slots, 1), np.int32)], axis=1)
    segments = jnp.ones((slots, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length), (slots, length))
    score = nnx.jit(lambda m, t, y, tau: m.token_logprobs(t, y, segments, positions, tau)[0])
    for temperature in (1.0, 0.7):
        trainer = np.asarray(score(model, jnp.asarray(seqs), jnp.asarray(targets), temperature))
        for s, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            if sampling.temperature != temperature:
                continue
            ours = trainer[s, len(prompt) - 1 : length - 1]
            if sampling.top_k == 0 and sampling.top_p == 1.0:
                np.testing.assert_allclose(behaviour[s], ours, atol=1e-5, rtol=1e-5, err_msg=f"slot {s}")
            else:  # truncation renormalises over the kept set: never below the full distribution
                assert (behaviour[s] >= ours - (1e-5 + 1e-5 * np.abs(ours))).all(), f"slot {s}"  # allclose's slack


def test_hf_round_trip_leaves_vocab_limit_out_and_load_applies_it(tmp_path):
    cfg = PADDED.replace(family="qwen2")
    model = _model(cfg)
    save_hf_checkpoint(cfg, model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "vocab_limit" not in config and config["vocab_size"] == VOCAB

    plain_cfg, plain = load_hf_checkpoint(tmp_path / "hf")
    assert plain_cfg.vocab_limit is None
    limited_cfg, limited = load_hf_checkpoint(tmp_path / "hf", vocab_limit=LIMIT)
    assert limited_cfg.vocab_limit == LIMIT
    tokens, _, segments, positions = _packed(np.random.default_rng(4), 1, 6)
    raw = np.asarray(plain.logits(tokens, segments, positions))
    masked = np.asarray(limited.logits(tokens, segments, positions))
    assert (raw[..., LIMIT:] != MASKED_LOGIT).all()
    np.testing.assert_array_equal(masked[..., :LIMIT], raw[..., :LIMIT])
    assert (masked[..., LIMIT:] == MASKED_LOGIT).all()
    np.testing.assert_array_equal(masked, np.asarray(model.logits(tokens, segments, positions)))
    with pytest.raises(ConfigError, match="vocab_limit"):
        load_hf_checkpoint(tmp_path / "hf", vocab_limit=VOCAB + 1)
