"""`model.moe.*` over an HF checkpoint: the mixture's run-time choices (grouped matmul, dispatch, the
load-balancing loss's weight) apply over the checkpoint's architecture, in the run's policy, the plan's
shapes and the loaded model; an architecture value the checkpoint contradicts is refused naming its key."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.activation_sharding import activations_on
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.planning.architecture import architecture
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.system.assembly import MOE_RUN_TIME_FIELDS, build_tokenizer, policy_config
from tests.hf_fixtures import make_hf_checkpoint

RECIPE = "configs/recipes/qwen3_moe_gsm8k_smoke.yaml"
CHOSEN = {"grouped_matmul": "megablox", "dispatch": "all_to_all", "router_aux_loss_coef": 0.01}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE written by transformers (safetensors): 4 layers, 1 and 2 dense, top-2 of 8 experts of 24."""
    directory = tmp_path_factory.mktemp("qwen3moe")
    make_hf_checkpoint("qwen3moe-mixed", directory)
    assert (directory / "model.safetensors").is_file()
    return directory


def _config(checkpoint, *extra: str):
    overrides = [f"hf_checkpoint={checkpoint}", "tokenizer=char", "model.family=qwen3_moe", "model.moe={}", *extra]
    return load_experiment(RECIPE, overrides)


def _primitives(model, rows: int = 1) -> str:
    """The forward's jaxpr, as text."""
    ids = jnp.broadcast_to(jnp.arange(6) % 40, (rows, 6))
    return str(
        jax.make_jaxpr(lambda: model.logits(ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(6), ids.shape)))()
    )


def test_run_time_choices_apply_over_the_checkpoint(checkpoint):
    assert set(CHOSEN) == set(MOE_RUN_TIME_FIELDS)
    cfg = _config(checkpoint, *(f"model.moe.{k}={v}" for k, v in CHOSEN.items()))
    tokenizer = build_tokenizer(cfg)
    policy = policy_config(cfg, tokenizer)
    hf = json.loads((checkpoint / "config.json").read_text())
    want = model_config_from_hf(hf).moe.replace(**CHOSEN)  # the checkpoint's experts, the user's choices
    assert policy.moe == want and want.expert_intermediate_size == 24 and want.mlp_only_layers == (1, 2)
    assert architecture(cfg).moe == want  # the plan's and the compile command's shapes
    model = load_policy(cfg, None, tokenizer)
    assert model.config.moe == want
    # the built model computes its experts with the chosen grouped matmul: megablox's Pallas kernel
    assert "pallas_call" in _primitives(model)
    default = load_policy(_config(checkpoint), None, tokenizer)
    assert default.config.moe == model_config_from_hf(hf).moe and default.config.moe.dispatch == "auto"
    primitives = _primitives(default)
    assert "ragged_dot" in primitives and "pallas_call" not in primitives
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(default)), strict=True
    ):
        assert (a[...] == b[...]).all(), path  # the same weights


def test_the_chosen_dispatch_is_the_one_the_model_runs_over_a_mesh(checkpoint):
    """Experts over fsdp=8: the all-to-all dispatch runs the experts per shard (`shard_map`, its rounds' exchanges
    emulated by all-gathers on CPU); auto with ragged_dot leaves them to XLA's partitioner (no shard_map)."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    traced = {}
    for dispatch in ("all_to_all", "auto"):
        cfg = _config(checkpoint, "model.moe.grouped_matmul=ragged_dot", f"model.moe.dispatch={dispatch}")
        model = load_policy(cfg, mesh, build_tokenizer(cfg))
        assert model.config.moe.dispatch == dispatch
        with activations_on(mesh):
            traced[dispatch] = _primitives(model, rows=8)
    assert "shard_map" in traced["all_to_all"] and "all_gather" in traced["all_to_all"]
    assert "shard_map" not in traced["auto"] and "ragged_dot" in traced["auto"]


@pytest.mark.parametrize(
    "override, key, given",
    [
        ("model.moe.expert_intermediate_size=32", "model.moe.expert_intermediate_size", "24"),
        ("model.moe.norm_topk_prob=true", "model.moe.norm_topk_prob", "False"),
        ("model.moe.num_experts=4", "model.moe.num_experts", "8"),
        ("model.moe.mlp_only_layers=[0]", "model.moe.mlp_only_layers", r"\(1, 2\)"),
    ],
)
def test_an_architecture_value_the_checkpoint_contradicts_is_refused_naming_its_key(checkpoint, override, key, given):
    cfg = _config(checkpoint, "model.moe.dispatch=all_to_all", override)
    with pytest.raises(ConfigError, match=rf"{key}: value .* contradicts the HF checkpoint .* is {given}"):
        policy_config(cfg, build_tokenizer(cfg))
    # a value equal to the checkpoint's is no contradiction
    same = _config(checkpoint, "model.moe.experts_per_token=2", "model.moe.norm_topk_prob=false")
    assert policy_config(same, build_tokenizer(same)).moe.experts_per_token == 2


def test_moe_choices_over_a_dense_checkpoint_or_a_dense_family_are_refused(checkpoint):
    dense = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64}
    dense |= {"num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ConfigError, match="moe: is set, but the HF checkpoint is a dense qwen3 model"):
        model_config_from_hf(dense, moe_options={"dispatch": "all_to_all"})
    with pytest.raises(ConfigError, match=r"model\.moe: must be set exactly .* set model\.family to the checkpoint's"):
        load_experiment(RECIPE, [f"hf_checkpoint={checkpoint}", "model.moe.dispatch=all_to_all"])


def test_qwen3_5_moe_takes_them_over_its_checkpoint_through_the_same_path(tmp_path):
    """The hybrid mixture (a real tiny Qwen3.5-MoE by transformers): its config needs the family's own sections
    stated to validate (`hybrid` with the checkpoint's layer types, the shared expert's width), each compared key
    by key against the checkpoint; the run-time choices apply, a contradicted hybrid key is refused by name."""
    from tests.test_hybrid_moe import _text_model

    _text_model("periodic-tied", tmp_path)  # 4 layers [linear, full] x 2, top-2 of 6 experts, a shared one of 24
    section = [
        f"hf_checkpoint={tmp_path}",
        "tokenizer=char",
        "model.family=qwen3_5_moe",
        "model.qkv_bias=false",
        "model.num_layers=4",
        "model.hybrid={layer_types: [linear_attention, full_attention, linear_attention, full_attention]}",
        "model.moe={shared_expert_intermediate_size: 24, norm_topk_prob: true}",
        *(f"model.moe.{k}={v}" for k, v in CHOSEN.items()),
    ]
    cfg = load_experiment(RECIPE, section)
    tokenizer = build_tokenizer(cfg)
    want = model_config_from_hf(json.loads((tmp_path / "config.json").read_text())).moe.replace(**CHOSEN)
    assert policy_config(cfg, tokenizer).moe == want and want.num_experts == 6
    model = load_policy(cfg, None, tokenizer)
    assert type(model).__name__ == "HybridDecoder" and model.config.moe == want
    assert "pallas_call" in _primitives(model)
    wrong = load_experiment(RECIPE, [*section, "model.hybrid.linear_value_head_dim=8"])
    with pytest.raises(ConfigError, match=r"model\.hybrid\.linear_value_head_dim: value 8 contradicts .* is 6"):
        policy_config(wrong, tokenizer)


def test_the_engine_runs_its_programs_over_its_mesh(checkpoint):
    """The engine's programs trace under its mesh (`activation_sharding.on_mesh`), as the trainer's do: over
    fsdp=8 the all-to-all dispatch runs per shard in its decode step (a `shard_map`; on TPU the same wiring runs
    megablox and the paged attention kernel per shard), and its greedy answers and their log-probs equal the
    engine's on one device."""
    cfg = _config(checkpoint, "model.moe.grouped_matmul=ragged_dot", "model.moe.dispatch=all_to_all")
    tokenizer = build_tokenizer(cfg)
    prompts = [[1, 2, 3], list(range(5, 20)), [7, 7], [30, 31, 32, 33]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    answers = {}
    for name, mesh in (("one device", None), ("fsdp 8", make_mesh(MeshConfig(data=1, fsdp=8, tensor=1)))):
        model = load_policy(cfg, mesh, tokenizer)
        engine = Engine(model, EngineConfig(max_slots=8, max_length=32), mesh=mesh)
        params = engine.load_params(nnx.state(model), 0)
        decode = engine._generate.lower(params.state, params.layers, engine.init_decode_state(), None).as_text()
        assert ("manual_computation" in decode) == (mesh is not None), name  # shard_map's region
        with Generator(engine, params) as gen:
            futures = [gen.submit(prompt, greedy) for prompt in prompts]
            answers[name] = [future.result(timeout=180)[0] for future in futures]
    for single, sharded in zip(answers["one device"], answers["fsdp 8"], strict=True):
        assert sharded.output_ids == single.output_ids
        np.testing.assert_allclose(sharded.output_logprobs, single.output_logprobs, atol=1e-4)
