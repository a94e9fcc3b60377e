"""The supervised warm start: its examples and teacher-forced scores against a greedy decode and a NumPy
log-softmax, the fit itself, and its cache in the run directory (`areal-jax sft`, `load_policy`, resume)."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.data.datasets import PromptRecord
from areal_jax.jobs.sft import encode_examples, heldout_scores, train_warm_start
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models import lora
from areal_jax.models.config import ModelConfig
from areal_jax.models.init import create_decoder
from areal_jax.models.tokenizer import CharTokenizer
from areal_jax.sft_config import SUMMARY_FILE, WARM_START_DIR, WarmStartConfig
from areal_jax.system.assembly import build_tokenizer
from areal_jax.system.run_dir import prepare_run_dir

TINY = ModelConfig(
    family="qwen2",
    vocab_size=27,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=32,
)
SMALL_RUN = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "dataset.chain_sums.max_terms=4",
    "dataset.chain_sums.problems=300",
    "dataset.heldout=20",
    "warm_start.steps=30",
    "warm_start.batch_size=16",
    "warm_start.heldout_examples=20",
]


def _render(record: PromptRecord) -> list[int]:
    return CharTokenizer().apply_chat_template([{"role": "user", "content": record.prompt}], add_generation_prompt=True)


@nnx.jit
def _logits(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.logits(tokens, (tokens > 0).astype(np.int32), positions)


def _greedy(model, prompt: list[int], steps: int, width: int = 16) -> list[int]:
    """Greedy decoding by full forward passes (no KV cache): an independent route to the model's answer."""
    ids = list(prompt)
    for _ in range(steps):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(ids)] = ids
        ids.append(int(np.argmax(_logits(model, tokens)[0, len(ids) - 1])))
        if ids[-1] == CharTokenizer().eos_id:
            break
    return ids[len(prompt) :]


def test_examples_mask_exactly_the_answer_and_its_stop_token():
    tokenizer = CharTokenizer()
    record = PromptRecord("s", "7+5+3", "12,15", None, "chain_sums", {})
    examples = encode_examples([record], _render, tokenizer, length=24)
    prompt = _render(record)
    answer = [*tokenizer.encode("12,15"), tokenizer.eos_id]
    masked = np.flatnonzero(examples.mask[0])
    assert masked.tolist() == list(range(len(prompt) - 1, len(prompt) + len(answer) - 1))
    assert examples.targets[0, masked].tolist() == answer  # each masked position predicts the next answer token
    assert examples.segment_ids[0].sum() == len(prompt) + len(answer) and examples.tokens.shape == (1, 24)
    with pytest.raises(ValueError, match="more than 8"):
        encode_examples([record], _render, tokenizer, length=8)


def test_balanced_draws_make_every_answer_length_equally_likely():
    answers = ["3"] * 6 + ["3,7"] * 3 + ["3,7,12"]  # answer lengths 1, 3, 6 characters (+ the stop token)
    records = [PromptRecord(f"s{i}", "1+2", a, None, "chain_sums", {}) for i, a in enumerate(answers)]
    weights = encode_examples(records, _render, CharTokenizer(), length=24).answer_length_weights()
    expected = np.array([1 / 18] * 6 + [1 / 9] * 3 + [1 / 3])  # a third per length, split among its examples
    np.testing.assert_allclose(weights, expected, rtol=1e-12)
    drawn = np.random.default_rng(0).choice(len(records), size=30_000, p=weights)
    share_by_length = [np.isin(drawn, group).mean() for group in (range(6), range(6, 9), [9])]
    np.testing.assert_allclose(share_by_length, [1 / 3] * 3, atol=0.01)


def test_fit_raises_teacher_forced_scores_that_match_greedy_decoding_and_numpy():
    tokenizer = CharTokenizer()
    records = [PromptRecord(f"s{i}", f"{i}+{i % 3}", str(i + i % 3), None, "chain_sums", {}) for i in range(8)]
    examples = encode_examples(records, _render, tokenizer)
    model = create_decoder(TINY, seed=0)
    before = heldout_scores(model, examples)
    losses = train_warm_start(model, WarmStartConfig(steps=100, batch_size=8, lr=2e-2, warmup_steps=5), examples, 0)
    after = heldout_scores(model, examples)
    assert losses[-1] < 0.2 * losses[0]
    assert before["greedy_exact"] == 0.0 and after["greedy_exact"] >= 0.75 and after["sampled_exact"] > 0.5
    hits = 0
    for record in records:  # greedy_exact is exactly "greedy decoding produces the answer"
        decoded = tokenizer.decode(_greedy(model, _render(record), 4), skip_special_tokens=True)
        hits += decoded == record.answer
    assert hits / len(records) == after["greedy_exact"]
    logits = np.asarray(model.logits(examples.tokens, examples.segment_ids, examples.positions), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, examples.targets[..., None], -1)[..., 0]
    expected = np.exp((picked * examples.mask).sum(-1)).mean()
    np.testing.assert_allclose(after["sampled_exact"], expected, rtol=1e-4)


def test_warm_start_is_cached_in_the_run_directory_and_reused(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    overrides = [*SMALL_RUN, f"output_dir={tmp_path}"]
    assert main(["sft", "configs/chain_sums_cpu.yaml", *overrides]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 30 and printed["loss_last"] < printed["loss_first"]
    cfg = load_experiment("configs/chain_sums_cpu.yaml", overrides)
    summary_file = cfg.run_dir / WARM_START_DIR / SUMMARY_FILE
    written = summary_file.stat().st_mtime_ns
    summary = json.loads(summary_file.read_text())
    assert summary["heldout_prompts"] == 20 and set(summary["heldout_after"]) == {"greedy_exact", "sampled_exact"}

    prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)  # `train` after `sft`: not refused
    tokenizer = build_tokenizer(cfg)
    model = load_policy(cfg, None, tokenizer)
    assert "using the cached" in caplog.text and summary_file.stat().st_mtime_ns == written  # not trained again
    fresh = load_policy(cfg.replace(warm_start=cfg.warm_start.replace(steps=0)), None, tokenizer)
    embed, fresh_embed = np.asarray(model.embed[...]), np.asarray(fresh.embed[...])
    assert not np.allclose(embed, fresh_embed)  # the policy is the warm start, not the random init

    changed = cfg.replace(warm_start=cfg.warm_start.replace(steps=31))
    load_policy(changed, None, tokenizer)
    assert "trained with other settings" in caplog.text
    assert json.loads(summary_file.read_text())["steps"] == 31
    assert jax.tree.leaves(model)  # loaded onto the default device


def test_lora_rl_reuses_the_warm_start_as_its_frozen_base(tmp_path, caplog):
    """`model.lora` does not change the warm start (it is fitted without adapters), so a LoRA run reuses the
    cached one and its base weights are the warm start's."""
    caplog.set_level(logging.INFO)
    overrides = [*SMALL_RUN, f"output_dir={tmp_path}"]
    assert main(["sft", "configs/chain_sums_cpu.yaml", *overrides]) == 0
    summary_file = load_experiment("configs/chain_sums_cpu.yaml", overrides).run_dir / WARM_START_DIR / SUMMARY_FILE
    written = summary_file.stat().st_mtime_ns
    cfg = load_experiment("configs/chain_sums_cpu.yaml", [*overrides, "model.lora.rank=4", "model.lora.alpha=8"])
    tokenizer = build_tokenizer(cfg)
    caplog.clear()
    model = load_policy(cfg, None, tokenizer)
    assert "using the cached" in caplog.text and summary_file.stat().st_mtime_ns == written
    assert model.config.lora is not None and model.config.lora.rank == 4
    warm = load_policy(cfg.replace(model=cfg.model.replace(lora=None)), None, tokenizer)
    adapters, base = lora.split_trainable(model.config, nnx.state(model, nnx.Param))
    assert jax.tree.leaves(adapters)
    jax.tree.map(np.testing.assert_array_equal, base, nnx.state(warm, nnx.Param))


def test_sft_command_refuses_a_config_without_a_warm_start(capsys):
    assert main(["sft", "configs/chain_sums_cpu.yaml", "warm_start.steps=0"]) == 2
    assert "warm_start.steps: is 0" in capsys.readouterr().err


def test_a_warm_start_on_a_bucket_is_cached_there_and_loaded_on_another_host(tmp_path, gcs, caplog):
    from areal_jax import storage
    from tests.gcs_emulator import BUCKET

    caplog.set_level(logging.INFO)
    output_dir = f"gs://{BUCKET}/{tmp_path.name}"
    overrides = [*SMALL_RUN, f"output_dir={output_dir}", f"local_copy_dir={tmp_path / 'host-a'}"]
    assert main(["sft", "configs/chain_sums_cpu.yaml", *overrides]) == 0
    cfg = load_experiment("configs/chain_sums_cpu.yaml", overrides)
    on_bucket = storage.files_below(storage.join(cfg.run_location, WARM_START_DIR))
    assert SUMMARY_FILE in on_bucket and any(name.endswith(".safetensors") for name in on_bucket)

    elsewhere = cfg.replace(local_copy_dir=str(tmp_path / "host-b"))  # nothing of it on this host yet
    tokenizer = build_tokenizer(elsewhere)
    model = load_policy(elsewhere, None, tokenizer)
    assert "using the cached" in caplog.text
    trained = load_policy(cfg, None, tokenizer)  # from host a's own copy
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(trained.embed[...]))
    assert (elsewhere.run_dir / WARM_START_DIR).is_dir()
