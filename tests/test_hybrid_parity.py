"""Qwen3.5 (`qwen3_5`) against transformers on CPU: log-probs through the trainer's packed-row path
(`token_logprobs`) on tiny random checkpoints with different layer patterns, the multimodal layout's text model,
and HF safetensors written back that transformers loads to the same logits."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError, from_dict
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint, tensor_mappings
from areal_jax.models.hybrid_config import HybridConfig

LENGTHS = (5, 17, 31, 9)
L, F = "linear_attention", "full_attention"
TEXT = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
)
VARIANTS = {
    # a repeating pattern (Qwen3.5's is 3 linear + 1 full): a scan of two periods; tied embeddings
    "periodic-tied": dict(layer_types=[L, F] * 2, tie_word_embeddings=True),
    # no period: one scan step of every layer; half of each full-attention head rotated
    "irregular-untied": dict(
        layer_types=[F, L, F], tie_word_embeddings=False, rope_parameters=dict(partial_rotary_factor=0.5)
    ),
    # linear attention only (no full-attention stack), one value head per key head
    "linear-only": dict(layer_types=[L, L], tie_word_embeddings=False, linear_num_value_heads=2),
}


def _randomise(model, seed: int, scale: float = 0.1) -> None:
    """Random weights at scales where every part matters (the decays and dt bias keep HF's init)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name or name.endswith(("A_log", "dt_bias")):
                continue
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "conv1d" in name:
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))
    model.eval()


def _text_model(variant: str, directory, seed: int = 0, scale: float = 0.1):
    import torch
    import transformers

    extra = VARIANTS[variant]
    text = {**TEXT, **extra, "num_hidden_layers": len(extra["layer_types"])}
    rope = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}
    text["rope_parameters"] = {**rope, **extra.get("rope_parameters", {})}
    torch.manual_seed(seed)  # HF's init of the decays
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    _randomise(model, seed, scale)
    model.save_pretrained(directory)
    return model


def _hf_logprobs(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """log p(next token) of each position but the last of each sequence, under the torch model (one
    right-padded batch: padding after a sequence changes nothing before it)."""
    import torch

    width = max(map(len, seqs))
    tokens = torch.tensor([seq + [0] * (width - len(seq)) for seq in seqs])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens, attention_mask=mask, use_cache=False).logits.double(), dim=-1)
    return [
        logp[row, : len(seq) - 1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
        for row, seq in enumerate(seqs)
    ]


def _packed(seqs: list[list[int]]) -> tuple[np.ndarray, ...]:
    """One row holding every sequence, 3 padding tokens after them: tokens, targets, segment ids, positions."""
    width = sum(map(len, seqs)) + 3
    tokens, targets, segments, positions = (np.zeros((1, width), np.int32) for _ in range(4))
    offset = 0
    for index, seq in enumerate(seqs):
        n = len(seq)
        tokens[0, offset : offset + n] = seq
        targets[0, offset : offset + n - 1] = seq[1:]
        segments[0, offset : offset + n] = index + 1
        positions[0, offset : offset + n] = np.arange(n)
        offset += n
    return tokens, targets, segments, positions


def _check_packed_logprobs(model, torch_model, vocab: int) -> float:
    """Our packed-row log-probs against HF's, each sequence run alone there; the largest difference."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, vocab, size=n).tolist() for n in LENGTHS]
    graphdef, state = nnx.split(model)
    logprobs = jax.jit(lambda s, *rows: nnx.merge(graphdef, s).token_logprobs(*rows)[0])
    ours = np.asarray(logprobs(state, *map(jnp.asarray, _packed(seqs))))[0]
    worst, offset = 0.0, 0
    for seq, ref in zip(seqs, _hf_logprobs(torch_model, seqs), strict=True):
        np.testing.assert_allclose(ours[offset : offset + len(seq) - 1], ref, atol=1e-4, rtol=0)
        worst = max(worst, float(np.abs(ours[offset : offset + len(seq) - 1] - ref).max()))
        offset += len(seq)
    return worst


def _load(directory):
    """The checkpoint in chunks of 8 (the packed row's sequences start and end inside chunks), its layers
    scanned a period at a time (compiled once per period)."""
    cfg = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    assert cfg.family == "qwen3_5" and cfg.hybrid is not None
    return load_hf_checkpoint(directory, config=cfg.replace(hybrid=cfg.hybrid.replace(chunk=8), scan_layers=True))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logprobs_match_transformers(variant, tmp_path):
    torch_model = _text_model(variant, tmp_path / "hf")
    cfg, model = _load(tmp_path / "hf")
    assert cfg.hybrid is not None and cfg.hybrid.layer_types == tuple(VARIANTS[variant]["layer_types"])
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == cfg.num_params()
    _check_packed_logprobs(model, torch_model, cfg.vocab_size)


def test_export_loads_in_transformers(tmp_path):
    import torch
    import transformers

    torch_model = _text_model("irregular-untied", tmp_path / "hf")
    cfg, model = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(cfg, model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    tokens = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), torch_model(tokens).logits.numpy())
    again, _ = load_hf_checkpoint(tmp_path / "out")
    assert again == cfg


def test_multimodal_checkpoint_loads_its_text_model(tmp_path, caplog):
    import transformers

    text = {**TEXT, "layer_types": [F, L, F], "num_hidden_layers": 3, "tie_word_embeddings": False}
    text["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch_model = transformers.Qwen3_5ForConditionalGeneration(config)
    _randomise(torch_model, seed=2)
    torch_model.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="areal_jax.models.hybrid_io"):
        cfg, model = _load(tmp_path)  # the text model of "irregular-untied": its compiled program, cached
    vision = sum(name.startswith("model.visual.") for name in torch_model.state_dict())
    assert [r.message for r in caplog.records if "vision tower" in r.message] == [
        f"multimodal checkpoint: loading its language model, skipping the vision tower ({vision} tensors)"
    ]
    assert cfg.family == "qwen3_5" and not cfg.tie_word_embeddings
    _check_packed_logprobs(model, torch_model, cfg.vocab_size)


def test_gradients_match_torch_autograd(tmp_path):
    """d(sum of log-probs)/d(every weight) through the packed row, against torch autograd in float64 with each
    sequence run alone, HF's gradients laid out as ours by the same conversions as the weights. Tolerance: 1e-4
    of each tensor's largest gradient, at weights half the other tests' scale: at theirs the gradients are
    ill-conditioned enough that torch's own float32 ones are 5e-4 from its float64 ones."""
    import torch

    torch_model = _text_model("periodic-tied", tmp_path / "hf", scale=0.05)
    cfg, model = _load(tmp_path / "hf")
    torch_model = torch_model.double()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (11, 6)]
    total = 0
    for seq in seqs:
        logp = torch.log_softmax(torch_model(torch.tensor([seq]), use_cache=False).logits[0, :-1], dim=-1)
        total = total + logp.gather(1, torch.tensor(seq[1:])[:, None]).sum()
    total.backward()
    hf_grads = {name: param.grad.float().numpy() for name, param in torch_model.named_parameters()}

    tokens, targets, segments, positions = map(jnp.asarray, _packed(seqs))
    scored = np.zeros(targets.shape, np.float32)  # every position with a next token in its sequence
    scored[0, : len(seqs[0]) - 1] = scored[0, len(seqs[0]) : len(seqs[0]) + len(seqs[1]) - 1] = 1
    graphdef, state = nnx.split(model)

    def loss(s):
        return jnp.sum(nnx.merge(graphdef, s).token_logprobs(tokens, targets, segments, positions)[0] * scored)

    grads = dict(nnx.to_flat_state(jax.jit(jax.grad(loss))(state)))
    for path, mapping in tensor_mappings(cfg).items():
        layers = mapping.stored_layers(cfg.num_layers)
        expected = np.stack(
            [mapping.to_ours([hf_grads[name.format(i=layer)] for name in mapping.hf_names]) for layer in layers]
        )
        ours = np.asarray(grads[path].get_value())
        ours = ours[None] if not mapping.per_layer else ours
        scale = np.abs(expected).max()
        np.testing.assert_allclose(ours / scale, expected / scale, atol=1e-4, rtol=0, err_msg=str(path))


def test_config_checks():
    hybrid = HybridConfig(layer_types=(L, F, L))
    with pytest.raises(ConfigError, match="hybrid"):
        ModelConfig(family="qwen3_5", num_layers=3, qkv_bias=False)
    with pytest.raises(ConfigError, match="hybrid"):
        ModelConfig(family="qwen3", num_layers=3, hybrid=hybrid)
    with pytest.raises(ConfigError, match=r"hybrid\.layer_types"):
        ModelConfig(family="qwen3_5", num_layers=2, qkv_bias=False, hybrid=hybrid)
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        HybridConfig(linear_num_key_heads=2, linear_num_value_heads=3)
    cfg = from_dict(
        ModelConfig, {"family": "qwen3_5", "num_layers": 3, "qkv_bias": False, "hybrid": {"layer_types": [L, F, L]}}
    )
    assert cfg.hybrid == hybrid and cfg.hybrid.period() == 3
    assert HybridConfig(layer_types=(L, L, L, F) * 3).period() == 4


@pytest.mark.parametrize(
    "override,key,reason",
    [
        (  # a paged cache with nothing to page (tests/test_hybrid_paged.py: served paged with full layers)
            "rollout.engine.kv_cache=paged model.hybrid.layer_types=[linear_attention,linear_attention]",
            "rollout.engine.kv_cache",
            "without full-attention layers",
        ),
        ("model.lora.rank=4", "model.lora", "not supported for family 'qwen3_5'"),
    ],
    ids=["paged-cache", "lora"],
)
def test_what_rl_on_a_qwen3_5_model_cannot_do_is_refused_before_any_weights_load(
    tmp_path, capsys, override, key, reason
):
    """RL on a qwen3_5 policy runs (tests/test_hybrid_run.py); a paged KV cache of a model without full-attention
    layers and LoRA are refused by key."""
    from areal_jax.cli import main
    from areal_jax.exit_codes import EXIT_USER_ERROR

    hybrid = [
        "model.family=qwen3_5",
        "model.qkv_bias=false",
        "model.hybrid.layer_types=[linear_attention, full_attention]",
    ]
    overrides = override.split(" ")
    assert main(["train", "configs/train_cpu.yaml", *hybrid, *overrides, f"output_dir={tmp_path}"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert key in err and reason in err
