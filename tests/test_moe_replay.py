"""Routing replay (R3) of a mixture of experts: the engine records each token's experts (prompt at prefill,
outputs when fed; anew for the context re-prefilled after an interruption), trajectories carry them through
the rollout log and the agent proxy's records, and the trainer replays them exactly; the routers' load-balancing
loss against transformers'."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.agents.sessions import TokenSequence
from areal_jax.data.rollout_log_records import decode_record, encode_record
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import MoEConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.config import TrainerMoEConfig
from areal_jax.trainer.train_step import TrainStep
from tests.engine_fixtures import all_at_once
from tests.hf_fixtures import make_hf_checkpoint
from tests.test_moe import MOE
from tests.test_train_step import CONFIG, single_device_mesh

PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def models():
    return Decoder(MOE, nnx.Rngs(0)), Decoder(MOE, nnx.Rngs(1))


def _own_routing(model: Decoder, tokens: list[int]) -> np.ndarray:
    """[T, Ym, K] each position's top-k of every sparse layer under `model`'s full forward, sorted per token."""
    ids = jnp.asarray([tokens])
    _, router = model.routed_hidden_states(ids, jnp.ones_like(ids), jnp.arange(len(tokens))[None])
    return np.sort(np.asarray(jnp.moveaxis(router.experts, 0, 2))[0], axis=-1)


def _wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_engine_records_routing_anew_after_an_interruption(models, kv_cache):
    """Interrupted by a weight update mid-generation: the prompt's routing is the re-prefill's (new weights), each
    output keeps the routing of the version that sampled (and fed) it."""
    old, new = models
    engine = Engine(old, EngineConfig(max_slots=2, max_length=64, kv_cache=kv_cache, page_size=8))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    with Generator(engine, engine.load_params(nnx.state(old), 0)) as gen:
        future = gen.submit(PROMPT, sampling)
        _wait_until(lambda: gen.stats.emitted_tokens >= 4)
        with all_at_once(gen):
            applied = gen.update_params(nnx.state(new), 1, interrupt=True)
        assert applied.result(timeout=60) == 1
        (result,) = future.result(timeout=60)
    assert result.num_interruptions == 1 and result.routing is not None
    versions = np.asarray(result.output_versions)
    assert 0 < (versions == 0).sum() < len(versions)
    tokens = [*PROMPT, *result.output_ids]
    assert result.routing.shape == (len(tokens), 2, 2) and result.routing.dtype == np.uint8
    got = np.sort(result.routing, axis=-1)
    by_old, by_new = _own_routing(old, tokens), _own_routing(new, tokens)
    p = len(PROMPT)
    assert not np.array_equal(by_old[:p], by_new[:p])  # the two versions route the prompt differently
    np.testing.assert_array_equal(got[:p], by_new[:p])
    expected = np.where((versions == 0)[:, None, None], by_old[p:], by_new[p:])
    np.testing.assert_array_equal(got[p:], expected)


def _trajectories(results: list[GenerationResult]) -> list[Trajectory]:
    out = []
    for i, r in enumerate(results):
        p, o = len(r.prompt_ids), len(r.output_ids)
        out.append(
            Trajectory(
                token_ids=np.asarray([*r.prompt_ids, *r.output_ids], np.int32),
                behav_logprobs=np.asarray([0.0] * p + list(r.output_logprobs), np.float32),
                versions=np.asarray([-1] * p + list(r.output_versions), np.int32),
                loss_mask=np.asarray([0] * p + [1] * o, np.bool_),
                prompt_length=p,
                reward=float(i % 2),
                prompt_id="p",
                group_id=0,
                sample_index=i,
                routing=r.routing,
            )
        )
    return out


def test_trainer_replays_the_rollout_routing_exactly(models):
    """A trainer whose routers differ from the sampler's (perturbed): without replay it routes some trained tokens
    elsewhere; with replay every trained token of every sparse layer goes through the recorded experts, and the
    routers still get a gradient."""
    model, _ = models
    engine = Engine(model, EngineConfig(max_slots=4, max_length=48))
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        results = gen.submit(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1), n=4).result(120)
    trajectories = _trajectories(results)
    # round trip through the rollout log's record format
    trajectories = [decode_record(encode_record(t, "w", i, 0.0))[3] for i, t in enumerate(trajectories)]
    graphdef, state = nnx.split(model)
    noise = jax.random.normal(jax.random.key(7), state["layers"]["moe"]["router"][...].shape)
    state["layers"]["moe"]["router"][...] = state["layers"]["moe"]["router"][...] + 0.2 * noise
    stats = {}
    for replay in ("none", "rollout"):
        config = CONFIG.replace(moe=TrainerMoEConfig(routing_replay=replay))
        step = TrainStep(graphdef, state, config, single_device_mesh(), temperature=1.0)
        params, opt_state = step.init(state)
        (mb,) = build_batch(trajectories, config).minibatches
        assert mb.routing is not None and mb.routing.dtype == np.uint8
        new_params, _, update_stats = step.update(params, opt_state, step.put_batch(mb), None, 0, prox_is_current=True)
        stats[replay] = {k: float(v) for k, v in jax.device_get(update_stats).items()}
        moved = new_params["layers"]["moe"]["router"][...] - state["layers"]["moe"]["router"][...]
        assert float(jnp.abs(moved).max()) > 0
    off, on = stats["none"], stats["rollout"]
    assert off["moe/routing_differs/mean"] > 0 and off["moe/routing_differs/mean"] == off["moe/router_differs/mean"]
    for layer in (0, 1):
        assert on[f"moe/routing_differs/layer{layer}"] == 0.0
    assert on["moe/router_differs/mean"] == off["moe/router_differs/mean"]
    assert on["moe/routing_differs/n_tokens"] == sum(t.num_loss_tokens for t in trajectories)


def test_replay_without_recorded_routing_is_refused():
    t = Trajectory(
        token_ids=np.arange(4, dtype=np.int32),
        behav_logprobs=np.zeros(4, np.float32),
        versions=np.asarray([-1, -1, 0, 0], np.int32),
        loss_mask=np.asarray([0, 0, 1, 1], np.bool_),
        prompt_length=2,
        reward=1.0,
        prompt_id="p",
        group_id=0,
        sample_index=0,
    )
    with pytest.raises(ValueError, match="has no routing"):
        build_batch([t], CONFIG, routing_replay=True)
    assert build_batch([t], CONFIG).minibatches[0].routing is None  # a dense model's trajectory, replay default on
    idle = dataclasses.replace(t, loss_mask=np.zeros(4, np.bool_))  # an aborted sample: nothing trains, no routing
    assert build_batch([idle], CONFIG, routing_replay=True).minibatches[0].routing is None
    assert decode_record(encode_record(t, "w", 0, 0.0))[3].routing is None  # a record without routing reads


def test_agent_sequences_keep_each_turns_routing():
    """A second turn's result routes the whole conversation anew; the sequence keeps the first turn's outputs'
    routing and takes the new context's and outputs' from the second."""

    def result(prompt: list[int], outputs: list[int], fill: int) -> GenerationResult:
        routing = np.full((len(prompt) + len(outputs), 2, 2), fill, np.uint8)
        n = len(outputs)
        return GenerationResult("r", 0, tuple(prompt), tuple(outputs), (0.0,) * n, (0,) * n, "stop", 0, {}, routing)

    first = TokenSequence().extended([1, 2], result([1, 2], [3, 4], fill=1))
    second = first.extended([5], result([1, 2, 3, 4, 5], [6], fill=2))
    np.testing.assert_array_equal(second.routing_array()[:, 0, 0], [1, 1, 1, 1, 2, 2])
    assert second.trajectory(1.0, True, prompt_id="p", group_id=0, sample_index=0).routing.shape == (6, 2, 2)
    unrouted = GenerationResult("r", 0, (1, 2, 3, 4, 5), (6,), (0.0,), (0,), "stop", 0, {})
    assert first.extended([5], unrouted).routing_array() is None


def test_router_aux_loss_equals_transformers(tmp_path):
    """The trainer's load-balancing term on one sequence equals transformers' aux_loss of the same checkpoint
    (sparse layers only), and adds coef times it to the loss."""
    import torch

    torch_model = make_hf_checkpoint("qwen3moe-mixed", tmp_path)
    tokens = np.random.default_rng(0).integers(0, 97, 14).astype(np.int32)
    with torch.no_grad():
        # the trainer's inputs: every token but the last (which is only a target)
        want = torch_model(torch.tensor(tokens[None, :-1]), output_router_logits=True).aux_loss.item()
    cfg, model = load_hf_checkpoint(tmp_path)
    trajectory = Trajectory(
        token_ids=tokens,
        behav_logprobs=np.full(14, -4.0, np.float32),
        versions=np.zeros(14, np.int32),
        loss_mask=np.ones(14, np.bool_),
        prompt_length=1,
        reward=1.0,
        prompt_id="p",
        group_id=0,
        sample_index=0,
    )
    losses = {}
    for coef in (0.0, 0.5):
        model_cfg = cfg.replace(moe=cfg.moe.replace(router_aux_loss_coef=coef))
        graphdef, state = nnx.split(Decoder(model_cfg, nnx.Rngs(0)))
        state = nnx.state(model)
        step = TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=1.0)
        params, opt_state = step.init(state)
        (mb,) = build_batch([trajectory], CONFIG).minibatches
        _, _, stats = step.update(params, opt_state, step.put_batch(mb), None, 0, prox_is_current=True)
        losses[coef] = float(stats["train/loss"])
        np.testing.assert_allclose(float(stats["moe/aux_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(losses[0.5] - losses[0.0], 0.5 * want, rtol=1e-4)


def test_moe_smoke_recipe_trains_with_replay_and_evaluates(tmp_path):
    """`areal-jax train` on the MoE smoke recipe (a tiny Qwen3-MoE with the BPE tokenizer of the other smoke runs):
    three steps with every trained token replayed, and an evaluation."""
    import shutil

    from areal_jax.cli import main
    from areal_jax.config import load_experiment
    from areal_jax.jsonl import read_jsonl
    from areal_jax.models.hf_io import save_hf_checkpoint
    from areal_jax.models.init import create_decoder
    from areal_jax.reporting.metric_keys import is_evaluation
    from tests.tiny_hf_run import TOKENIZER_FILES, make_tiny_hf_run, tiny_qwen2_config

    tiny = make_tiny_hf_run(tmp_path / "tiny")
    dense = tiny_qwen2_config(tiny.model_vocab)
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=32, mlp_only_layers=(0,))
    cfg = dense.replace(family="qwen3_moe", qkv_bias=False, qk_norm=True, moe=moe)
    checkpoint = tmp_path / "tiny-qwen3-moe"
    save_hf_checkpoint(cfg, create_decoder(cfg, 0, mesh=None), checkpoint)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tiny.checkpoint / name, checkpoint / name)
    recipe = "configs/recipes/qwen3_moe_gsm8k_smoke.yaml"
    overrides = [
        f"output_dir={tmp_path / 'runs'}",
        f"hf_checkpoint={checkpoint}",
        f"dataset.files=[{{path: '{tiny.gsm8k}', mapping: gsm8k}}]",
    ]
    assert main(["train", recipe, *overrides]) == 0
    run = load_experiment(recipe, overrides)
    assert run.trainer.moe.routing_replay == "rollout"
    lines = list(read_jsonl(run.run_dir / "metrics.jsonl"))
    metrics = [m for m in lines if not is_evaluation(m)]
    assert [m["train/version"] for m in metrics] == [1, 2, 3]
    assert all(m["moe/routing_differs/mean"] == 0.0 and m["moe/routing_differs/n_tokens"] > 0 for m in metrics)
    assert any("eval/pass@1" in m for m in lines if is_evaluation(m))
