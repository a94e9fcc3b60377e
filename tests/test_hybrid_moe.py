"""Qwen3.5-MoE (`qwen3_5_moe`): the hybrid layer stack with every feed-forward the mixture of experts (router,
renormalised top-k, the shared expert with its sigmoid gate). Against transformers on CPU: packed-row log-probs
on tiny random checkpoints with different layer patterns, the multimodal layout's text model, and our export
loaded by transformers to the same logits. Routing replay through the hybrid model: the engine records each
token's experts of every layer, and the trainer's forward replays them exactly."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.hf_config import CheckpointError, model_config_from_hf
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.hybrid import HybridDecoder
from areal_jax.models.hybrid_config import HybridConfig
from tests.test_hybrid_parity import TEXT, _check_packed_logprobs, _randomise

L, F = "linear_attention", "full_attention"
MOE_TEXT = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | dict(
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
)
VARIANTS = {
    # two periods of [linear, full] (a scan of two steps), tied embeddings, top-2 of 6 experts
    "periodic-tied": dict(layer_types=[L, F] * 2, tie_word_embeddings=True),
    # no period (one scan step of every layer), half of each full-attention head rotated, top-3 of 6 experts
    "irregular-untied": dict(
        layer_types=[F, L, L],
        tie_word_embeddings=False,
        num_experts_per_tok=3,
        rope_parameters=dict(partial_rotary_factor=0.5),
    ),
}


def _text_config(variant: str) -> dict:
    extra = VARIANTS[variant]
    text = {**MOE_TEXT, **extra, "num_hidden_layers": len(extra["layer_types"])}
    rope = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}
    text["rope_parameters"] = {**rope, **extra.get("rope_parameters", {})}
    return text


def _randomise_moe(model, seed: int) -> None:
    """`_randomise`, then routers at a scale where the top-k is decided (no near ties) yet varies by token."""
    import torch

    _randomise(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * torch.randn_like(param))


def _text_model(variant: str, directory, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(**_text_config(variant))
    config._experts_implementation = "eager"  # the per-expert loop of the modeling file, float64 too
    model = transformers.Qwen3_5MoeForCausalLM(config)
    _randomise_moe(model, seed)
    model.save_pretrained(directory)
    return model


def _load(directory):
    """The checkpoint in delta-rule chunks of 8, its layers scanned a period at a time."""
    cfg = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    assert cfg.family == "qwen3_5_moe" and cfg.hybrid is not None and cfg.moe is not None
    return load_hf_checkpoint(directory, config=cfg.replace(hybrid=cfg.hybrid.replace(chunk=8), scan_layers=True))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logprobs_match_transformers(variant, tmp_path):
    torch_model = _text_model(variant, tmp_path / "hf")
    cfg, model = _load(tmp_path / "hf")
    text = _text_config(variant)
    assert cfg.hybrid.layer_types == tuple(text["layer_types"])
    assert cfg.moe == MoEConfig(
        num_experts=6,
        experts_per_token=text["num_experts_per_tok"],
        expert_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
    )
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == cfg.num_params()
    assert cfg.num_params() == sum(p.numel() for p in torch_model.parameters())  # tied embeddings counted once
    _check_packed_logprobs(model, torch_model.double(), cfg.vocab_size)  # against float64: HF fp32 is 8e-5 off it


def test_export_loads_in_transformers_and_back(tmp_path):
    """Our HF directory (one tensor per expert, as transformers writes them) loads in transformers to the same
    logits, and back into the same config."""
    import torch
    import transformers

    torch_model = _text_model("irregular-untied", tmp_path / "hf")
    cfg, model = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(cfg, model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, experts_implementation="eager"
    )
    assert type(reloaded).__name__ == "Qwen3_5MoeForCausalLM"
    original = torch_model.state_dict()
    for name, tensor in reloaded.state_dict().items():  # every tensor bit for bit (experts fused by transformers)
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), err_msg=name)
    tokens = torch.tensor([list(range(3, 40))])
    with torch.no_grad():  # not bit for bit: 2e-6 apart at a few positions (both eager experts; cause not isolated)
        np.testing.assert_allclose(reloaded(tokens).logits.numpy(), torch_model(tokens).logits.numpy(), atol=1e-5)
    again, _ = load_hf_checkpoint(tmp_path / "out")
    assert again == cfg


def test_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    import transformers

    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4)
    text = _text_config("irregular-untied")  # its program compiled by the parity test (the session's cache)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config._experts_implementation = config.text_config._experts_implementation = "eager"
    torch_model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    _randomise_moe(torch_model, seed=2)
    torch_model.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="areal_jax.models.hybrid_io"):
        cfg, model = _load(tmp_path)
    vision_tensors = sum(name.startswith("model.visual.") for name in torch_model.state_dict())
    assert [r.message for r in caplog.records if "vision tower" in r.message] == [
        f"multimodal checkpoint: loading its language model, skipping the vision tower ({vision_tensors} tensors)"
    ]
    assert cfg.family == "qwen3_5_moe" and not cfg.tie_word_embeddings
    _check_packed_logprobs(model, torch_model.double(), cfg.vocab_size)  # against float64: HF fp32 is 8e-5 off it


def test_what_qwen3_5_moe_lacks_is_refused():
    """HF's Qwen3.5-MoE router always renormalises its top-k and every layer is sparse: a config that says
    otherwise is refused by key, as is a config.json with norm_topk_prob false."""
    moe = MoEConfig(num_experts=4, experts_per_token=2, shared_expert_intermediate_size=8, norm_topk_prob=True)
    base = dict(family="qwen3_5_moe", num_layers=2, qkv_bias=False, hybrid=HybridConfig())
    ModelConfig(**base, moe=moe)
    for change, key in [
        (dict(norm_topk_prob=False), "moe.norm_topk_prob"),
        (dict(decoder_sparse_step=2), "moe.decoder_sparse_step"),
        (dict(mlp_only_layers=(0,)), "moe.mlp_only_layers"),
        (dict(shared_expert_intermediate_size=None), "moe.shared_expert_intermediate_size"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            ModelConfig(**base, moe=moe.replace(**change))
    with pytest.raises(ConfigError, match="hybrid"):
        ModelConfig(**{**base, "hybrid": None}, moe=moe)
    hf = {"architectures": ["Qwen3_5MoeForCausalLM"], **_text_config("periodic-tied"), "num_hidden_layers": 4}
    assert model_config_from_hf(hf).moe.norm_topk_prob
    with pytest.raises(CheckpointError, match="norm_topk_prob"):
        model_config_from_hf({**hf, "norm_topk_prob": False})


# -- routing replay through the hybrid model ------------------------------------------------------------------

TINY_MOE = ModelConfig(
    family="qwen3_5_moe",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=False,
    initializer_range=0.3,
    hybrid=HybridConfig(layer_types=(L, F, L), linear_key_head_dim=8, linear_value_head_dim=8, chunk=8),
    moe=MoEConfig(
        num_experts=6,
        experts_per_token=2,
        expert_intermediate_size=16,
        shared_expert_intermediate_size=16,
        norm_topk_prob=True,
    ),
)
PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8])


def test_trainer_replays_the_engines_recorded_routing(tmp_path):
    """The engine records every token's experts of every layer (prompt at prefill, outputs when fed): the
    trainer's own routing of the same weights (packed rows) where it agrees, and with replay on, under a router
    perturbed so that its own top-k differs on some tokens, every token of every layer goes through exactly the
    recorded experts."""
    from areal_jax.inference.engine import Engine, EngineConfig
    from areal_jax.inference.generator import Generator
    from areal_jax.inference.sampling import SamplingParams
    from areal_jax.models.moe import routing_dtype

    model = HybridDecoder(TINY_MOE, nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=2, max_length=32))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=1)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(list(prompt), sampling) for prompt in PROMPTS]
        results = [future.result(timeout=120)[0] for future in futures]
    seqs = [[*r.prompt_ids, *r.output_ids] for r in results]
    recorded = [r.routing for r in results]
    for seq, routing in zip(seqs, recorded, strict=True):
        assert routing is not None and routing.shape == (len(seq), 3, 2) and routing.dtype == routing_dtype(TINY_MOE)

    # one packed row of both sequences, as the trainer scores them: [B, T, Y, K] recorded experts
    width = sum(map(len, seqs)) + 3
    tokens, segments, positions = (np.zeros((1, width), np.int32) for _ in range(3))
    replay = np.zeros((1, width, 3, 2), np.int32)
    offset = 0
    for index, (seq, routing) in enumerate(zip(seqs, recorded, strict=True)):
        n = len(seq)
        tokens[0, offset : offset + n], segments[0, offset : offset + n] = seq, index + 1
        positions[0, offset : offset + n] = np.arange(n)
        replay[0, offset : offset + n] = routing
        offset += n
    real = segments[0] > 0
    graphdef, state = nnx.split(model)

    @jax.jit
    def routed(s, replay_BxTxYxK):
        rows = (jnp.asarray(tokens), jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions))
        _, _, router = nnx.merge(graphdef, s).token_logprobs_routed(*rows, replay_BxTxYmxK=replay_BxTxYxK)
        return router.experts, router.used

    def per_token(a_YxBxTxK):  # [T real, Y, K], each top-k sorted
        return np.sort(np.moveaxis(np.asarray(a_YxBxTxK), 0, 2)[0][real], axis=-1)

    want = np.sort(replay[0][real], axis=-1)
    own, _ = routed(state, None)
    agree = (per_token(own) == want).all(axis=-1)
    # the engine (prefill, then decode steps) routes as the trainer's packed forward but where two experts' router
    # probabilities tie within rounding: on nearly every token of every layer
    assert agree.mean() > 0.97, agree.mean()

    for layer in state["linear_layers"]["moe"]["router"], state["full_layers"]["moe"]["router"]:
        layer[...] = layer[...] + 0.5 * jax.random.normal(jax.random.key(7), layer[...].shape)
    own, used = routed(state, None)
    assert (per_token(own) != want).any(axis=-1).mean() > 0.1  # the perturbed router picks other experts
    own, used = routed(state, jnp.asarray(replay))
    np.testing.assert_array_equal(per_token(used), want)  # replayed: exactly the recorded experts, every token
    assert (per_token(own) != want).any()  # while its own top-k still differs
