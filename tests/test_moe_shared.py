"""The shared expert (Qwen2-MoE, Qwen3.5-MoE): a SwiGLU every token runs through beside its routed experts,
scaled by a sigmoid gate. The block against transformers' Qwen2MoeSparseMoeBlock, the qwen2_moe family's
parameter count, and our export loaded by transformers (the checkpoint's logits: tests/test_model_hf_parity.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.moe import MoEBlock
from tests.hf_fixtures import TINY

# width D, experts E, top-k K, expert width F, shared expert width S, tokens M
D, E, K, F, S, M = 32, 6, 2, 16, 24, 40

QWEN2_MOE = ModelConfig(
    family="qwen2_moe",
    vocab_size=64,
    hidden_size=D,
    intermediate_size=40,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    qkv_bias=True,
    initializer_range=0.3,
    moe=MoEConfig(
        num_experts=E,
        experts_per_token=K,
        expert_intermediate_size=F,
        shared_expert_intermediate_size=S,
        decoder_sparse_step=2,
    ),
)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_block_equals_transformers_sparse_moe_block(norm_topk_prob):
    """Router, routed experts and the gated shared expert, fp32, on the same weights as HF's block."""
    import torch
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_config = transformers.Qwen2MoeConfig(
        hidden_size=D,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=S,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.3 * torch.randn_like(param))
    cfg = QWEN2_MOE.replace(compute_dtype="float32", moe=QWEN2_MOE.moe.replace(norm_topk_prob=norm_topk_prob))
    with nnx.use_eager_sharding(False):  # as the decoder builds it: no mesh needed
        ours = MoEBlock(cfg, nnx.Rngs(0))
    w = {name: p.detach().numpy() for name, p in block.named_parameters()}
    gate_up = w["experts.gate_up_proj"].reshape(E, 2, F, D)  # HF [E, 2F, D]: gate rows, then up rows
    ours.router[...] = jnp.asarray(w["gate.weight"].T)
    ours.gate_up[...] = jnp.asarray(gate_up.transpose(0, 3, 1, 2))
    ours.down[...] = jnp.asarray(w["experts.down_proj"].transpose(0, 2, 1))
    shared = [w[f"shared_expert.{p}_proj.weight"] for p in ("gate", "up", "down")]
    ours.shared_gate_up[...] = jnp.asarray(np.stack([shared[0].T, shared[1].T], axis=1))
    ours.shared_down[...] = jnp.asarray(shared[2].T)
    ours.shared_gate[...] = jnp.asarray(w["shared_expert_gate.weight"][0])
    x = np.random.default_rng(1).normal(size=(2, M // 2, D)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x)).numpy()
    got = np.asarray(ours(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    without_shared = np.asarray(
        ours.routed(jnp.asarray(x))[0] - ours.shared_expert(jnp.asarray(x).reshape(M, D)).reshape(x.shape)
    )
    assert np.abs(without_shared - want).max() > 1e-2  # the shared expert's share is not negligible here


def test_qwen2_moe_parameter_count_equals_transformers():
    import torch
    import transformers

    extra = dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        num_hidden_layers=4,
    )
    hf_config = transformers.Qwen2MoeConfig(**{**TINY, **extra})
    with torch.device("meta"):
        torch_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    cfg = model_config_from_hf({**hf_config.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]})
    assert cfg.family == "qwen2_moe" and cfg.qkv_bias and not cfg.qk_norm
    assert cfg.moe.shared_expert_intermediate_size == 40
    assert cfg.sparse_layers == tuple(hasattr(layer.mlp, "experts") for layer in torch_model.model.layers)
    assert cfg.num_params() == sum(p.numel() for p in torch_model.parameters())


def test_shared_expert_belongs_to_qwen2_moe_only():
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        QWEN2_MOE.replace(moe=QWEN2_MOE.moe.replace(shared_expert_intermediate_size=None))
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        QWEN2_MOE.replace(family="qwen3_moe", qkv_bias=False, qk_norm=True)


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    """Our qwen2_moe export (routed experts one tensor each, the shared expert and its [1, D] gate, dense MLPs
    in the dense layers) loads in transformers with the same logits, and loads back unchanged."""
    import torch
    import transformers

    model = Decoder(QWEN2_MOE, nnx.Rngs(0))
    save_hf_checkpoint(QWEN2_MOE, model, tmp_path)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(torch_model).__name__ == "Qwen2MoeForCausalLM"
    tokens = np.random.default_rng(0).integers(0, QWEN2_MOE.vocab_size, (1, 13))
    with torch.no_grad():
        want = torch_model(torch.tensor(tokens)).logits[0].numpy()
    ones, positions = jnp.ones(tokens.shape, jnp.int32), jnp.arange(13)[None]
    got = np.asarray(model.logits(jnp.asarray(tokens), ones, positions))[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    loaded_cfg, loaded = load_hf_checkpoint(tmp_path)
    assert loaded_cfg.moe == QWEN2_MOE.moe and loaded_cfg.family == "qwen2_moe"
    np.testing.assert_array_equal(np.asarray(loaded.logits(jnp.asarray(tokens), ones, positions))[0], got)
