"""Mixture of experts (Qwen3-MoE): dropless grouped matmuls against a dense one-hot reference, routing, the
config's layer rule and parameter counts against transformers, HF export, and the engine against the trainer."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_config import model_config_from_hf
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.init import create_decoder
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.models.moe import (
    dispatch_impl,
    dropless_experts,
    grouped_matmul_impl,
    load_balancing_loss,
    one_hot_experts,
    route,
)
from areal_jax.planning.memory import plan_memory
from areal_jax.sharding import MeshConfig, data_sharding, make_mesh
from tests.engine_fixtures import scoring_logprobs
from tests.hf_fixtures import TINY, VARIANTS, make_hf_checkpoint

# tokens M, experts E, top-k K, width D, expert width F
M, E, K, D, F = 24, 6, 2, 16, 8

MOE = ModelConfig(
    family="qwen3_moe",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=40,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    qkv_bias=False,
    qk_norm=True,
    initializer_range=0.3,
    moe=MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=16, mlp_only_layers=(1,)),
)


def _expert_inputs(seed: int = 0) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (M, D))
    logits = jax.random.normal(keys[1], (M, E))
    gate_up = 0.3 * jax.random.normal(keys[2], (E, D, 2, F))
    down = 0.3 * jax.random.normal(keys[3], (E, F, D))
    return x, logits, gate_up, down


@pytest.mark.parametrize("impl", ["ragged_dot", "megablox"])
def test_dropless_equals_one_hot_reference_forward_and_gradient(impl):
    """Every (token, pick) computed, in any routing (one expert left without tokens): the grouped matmuls equal
    every expert on every token combined one-hot, and so do the gradients of the input, the gate weights and
    both expert kernels. megablox runs interpreted off TPU."""
    x, logits, gate_up, down = _expert_inputs()
    logits = logits.at[:, E - 1].set(-10.0)  # expert E - 1 gets no token: an empty group

    def loss(fn, x, logits, gate_up, down):
        weights, experts = route(logits, K, norm_topk_prob=True)
        return jnp.sum(jnp.sin(fn(x, weights, experts, gate_up, down)))

    def grouped(*args):
        return dropless_experts(*args, impl=impl)

    args = (x, logits, gate_up, down)
    value, grads = jax.jit(jax.value_and_grad(lambda *a: loss(grouped, *a), argnums=(0, 1, 2, 3)))(*args)
    want, want_grads = jax.value_and_grad(lambda *a: loss(one_hot_experts, *a), argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(grads[2][E - 1])), "an expert without tokens gets no gradient"


def test_route_matches_hf_top_k_and_renormalisation():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0]])
    probs = np.asarray(jax.nn.softmax(logits[0]))
    weights, experts = route(logits, 2, norm_topk_prob=False)
    assert experts.tolist() == [[1, 2]] and experts.dtype == jnp.int32
    np.testing.assert_allclose(weights[0], probs[[1, 2]], rtol=1e-6)
    weights, _ = route(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(weights[0], probs[[1, 2]] / probs[[1, 2]].sum(), rtol=1e-6)


def test_grouped_matmul_follows_the_platform_unless_set():
    moe = MoEConfig()
    assert grouped_matmul_impl(moe, "tpu") == "megablox"
    assert grouped_matmul_impl(moe, "gpu") == grouped_matmul_impl(moe, "cpu") == "ragged_dot"
    assert grouped_matmul_impl(moe.replace(grouped_matmul="ragged_dot"), "tpu") == "ragged_dot"
    cpu_mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    with jax.set_mesh(cpu_mesh):
        assert grouped_matmul_impl(moe) == "ragged_dot"
    assert dispatch_impl(moe, "megablox") == "all_to_all"  # measured: docs/moe.md
    assert dispatch_impl(moe, "ragged_dot") == "all_gather"
    assert dispatch_impl(moe.replace(dispatch="all_gather"), "megablox") == "all_gather"


def test_load_balancing_loss_equals_transformers():
    """One router's loss over masked tokens, and the trainer's form: [layers, rows, positions] reduced in place
    (no reshape that merges the sharded rows axis) equal to HF's concatenation of every layer's logits."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, logits, _, _ = _expert_inputs(1)
    mask = (np.arange(M) % 5 != 0).astype(np.int32)
    _, experts = route(logits, K, norm_topk_prob=False)
    got = load_balancing_loss(logits, experts, jnp.asarray(mask))
    torch_logits = torch.tensor(np.asarray(logits))
    want = load_balancing_loss_func((torch_logits,), E, K, attention_mask=torch.tensor(mask)[None])
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)

    layers, rows = 3, 2
    logits_YxBxLxE = jax.random.normal(jax.random.key(2), (layers, rows, M // rows, E))
    _, experts_YxBxLxK = route(logits_YxBxLxE, K, norm_topk_prob=False)
    mask_BxL = mask.reshape(rows, M // rows)
    got = load_balancing_loss(logits_YxBxLxE, experts_YxBxLxK, jnp.broadcast_to(mask_BxL, (layers, rows, M // rows)))
    per_layer = tuple(torch.tensor(np.asarray(layer).reshape(M, E)) for layer in logits_YxBxLxE)
    want = load_balancing_loss_func(per_layer, E, K, attention_mask=torch.tensor(mask_BxL))
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)


def test_sparse_layers_and_parameter_counts_equal_transformers():
    """Which layers are sparse (decoder_sparse_step, mlp_only_layers) and the total parameter count, as the torch
    model builds them; the active count is the total less the unrouted experts."""
    import torch
    import transformers

    for step, only in [(1, [1, 2]), (2, []), (2, [3]), (3, [0])]:
        extra = dict(VARIANTS["qwen3moe-mixed"][1], decoder_sparse_step=step, mlp_only_layers=only)
        hf_config = transformers.Qwen3MoeConfig(**{**TINY, **extra})
        with torch.device("meta"):
            torch_model = transformers.AutoModelForCausalLM.from_config(hf_config)
        cfg = model_config_from_hf({**hf_config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
        want = tuple(hasattr(layer.mlp, "experts") for layer in torch_model.model.layers)
        assert cfg.sparse_layers == want, (step, only)
        assert cfg.num_params() == sum(p.numel() for p in torch_model.parameters())
        unrouted = sum(want) * (cfg.moe.num_experts - cfg.moe.experts_per_token) * 3 * 48 * 24
        assert cfg.num_active_params() == cfg.num_params() - unrouted
        mixed = 0 < sum(want) < 4  # then every layer holds a zero MLP or zero experts beside its own
        router_and_experts = 48 * 8 + 8 * 3 * 48 * 24
        missing = sum(3 * 48 * 80 if sparse else router_and_experts for sparse in want) if mixed else 0
        held = cfg.num_params() + missing
        assert cfg.num_held_params() == held


def test_config_refusals():
    with pytest.raises(ConfigError, match="moe"):
        MOE.replace(moe=None)
    with pytest.raises(ConfigError, match="experts_per_token"):
        MoEConfig(num_experts=2, experts_per_token=3)
    with pytest.raises(ConfigError, match="dispatch"):
        MoEConfig(dispatch="ring")
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        MOE.replace(moe=MOE.moe.replace(mlp_only_layers=(3,)))
    with pytest.raises(ConfigError, match="attention only") as err:
        MOE.replace(lora=LoRAConfig(rank=2, targets=("q", "up")))
    assert err.value.key == "lora.targets"
    assert MOE.replace(lora=LoRAConfig(rank=2)).lora is not None


def test_export_loads_in_transformers_with_equal_logits_over_a_padded_vocabulary(tmp_path):
    """Our export (one tensor per expert, dense layers' MLPs only where HF has them) loads in transformers with
    the same logits; a padded vocabulary masks the ids past vocab_limit and leaves the others as they are."""
    import torch
    import transformers

    cfg = MOE.replace(vocab_limit=40)
    model = Decoder(cfg, nnx.Rngs(0))
    save_hf_checkpoint(cfg, model, tmp_path)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 40, (1, 13))
    with torch.no_grad():
        want = torch_model(torch.tensor(tokens)).logits[0].numpy()
    ones = jnp.ones(tokens.shape, jnp.int32)
    got = np.asarray(model.logits(jnp.asarray(tokens), ones, jnp.arange(13)[None]))[0]
    np.testing.assert_allclose(got[:, :40], want[:, :40], atol=1e-4, rtol=0)
    assert np.all(got[:, 40:] < -1e29)
    loaded_cfg, loaded = load_hf_checkpoint(tmp_path, vocab_limit=40)
    assert loaded_cfg.moe == cfg.moe and loaded_cfg.family == "qwen3_moe"
    np.testing.assert_array_equal(np.asarray(loaded.logits(jnp.asarray(tokens), ones, jnp.arange(13)[None]))[0], got)


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_engine_logprobs_equal_trainer_logprobs(kv_cache, tmp_path):
    """A tiny mixture loaded from HF: the engine's sampled tokens' log-probs (prefill, then decode over a dense or
    paged cache) equal the trainer's scoring of the same sequences."""
    make_hf_checkpoint("qwen3moe-mixed", tmp_path)
    _, model = load_hf_checkpoint(tmp_path)
    engine = Engine(model, EngineConfig(max_slots=4, max_length=48, kv_cache=kv_cache, page_size=8))
    sampling = SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(list(range(3, 6 + 4 * i)), sampling, n=2) for i in range(2)]
        results = [r for f in futures for r in f.result(timeout=120)]
    gap = max(
        np.abs(scoring_logprobs(model, list(r.prompt_ids), list(r.output_ids), 0.9) - r.output_logprobs).max()
        for r in results
    )
    assert gap <= 1e-5


def _collectives(hlo: str) -> list[tuple[str, int]]:
    """(kind, element count) of every collective in a compiled module's text."""
    kinds = "all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter"
    found = re.findall(rf"= \w+\[([\d,]*)\]\S* ({kinds})(?:-start)?\(", hlo)
    return [(kind, math.prod(int(n) for n in dims.split(",") if n)) for dims, kind in found]


def test_expert_parallel_equals_single_device_and_keeps_experts_in_place():
    """Experts split over fsdp=4 (2 each), their width over tensor=2, tokens over the batch: log-probs and
    gradients equal one device's. In the compiled step no expert kernel moves: every collective is smaller
    than one layer's expert stack (XLA dispatches by gathering the routed rows to the experts' devices and
    all-reducing their outputs; no all-to-all)."""
    cfg = MOE.replace(num_layers=1, moe=MOE.moe.replace(num_experts=8, mlp_only_layers=()))
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    single, sharded = create_decoder(cfg, 0), create_decoder(cfg, 0, mesh)
    gate_up = nnx.state(sharded)["layers"]["moe"]["gate_up"][...]
    assert gate_up.sharding.spec == P(None, "fsdp", None, None, "tensor")
    assert gate_up.addressable_shards[0].data.shape == (1, 2, 32, 2, 8)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
    segments, positions = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(12), tokens.shape)
    graphdef, _ = nnx.split(single)

    def loss(state, tokens):
        logp, _ = nnx.merge(graphdef, state).token_logprobs(tokens, jnp.roll(tokens, -1, 1), segments, positions)
        return jnp.mean(logp)

    step = jax.jit(jax.value_and_grad(loss))
    value_1, grads_1 = step(nnx.state(single), tokens)
    sharded_step = step.lower(nnx.state(sharded), jax.device_put(tokens, data_sharding(mesh))).compile()
    value_8, grads_8 = sharded_step(nnx.state(sharded), jax.device_put(tokens, data_sharding(mesh)))
    np.testing.assert_allclose(value_8, value_1, rtol=1e-6)
    for (path, g8), (_, g1) in zip(nnx.to_flat_state(grads_8), nnx.to_flat_state(grads_1), strict=True):
        np.testing.assert_allclose(g8[...], g1[...], atol=1e-6, err_msg=str(path))
    collectives = _collectives(sharded_step.as_text())
    assert collectives and not [c for c in collectives if c[0] == "all-to-all"]
    assert max(size for _, size in collectives) < gate_up[0].size, collectives


def test_memory_plan_counts_every_expert_and_the_dispatch_rows():
    """The plan's params are the held ones (every expert, the routers, the zero halves of mixed layers); the
    activations grow with the (token, pick) rows of the dispatch."""
    cfg = load_experiment("configs/train_cpu.yaml", [])
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])

    def items(model: ModelConfig) -> dict[str, int]:
        plan = plan_memory(cfg, model, mesh, mesh)
        return {item.name.split(" (")[0]: item.bytes for side in plan.sides for item in side.items}

    plan = items(MOE)
    assert plan["params"] == MOE.num_held_params() * 4 > MOE.num_params() * 4
    assert plan["engine weights"] == MOE.num_held_params() * 4
    more_picks = MOE.replace(moe=MOE.moe.replace(experts_per_token=4, num_experts=8))
    assert items(more_picks)["activations"] > plan["activations"]


def test_megablox_is_chosen_and_compiles_for_a_tpu_mesh():
    """Traced under a TPU slice's mesh (compile-only devices from libtpu, on this CPU machine), the experts run
    through the Pallas megablox kernels: the forward and its gradient compile to TPU custom calls."""
    pytest.importorskip("libtpu")
    from areal_jax.compile.topology import slice_devices

    mesh = jax.sharding.Mesh(np.asarray(slice_devices("v5p-8")[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, P())
    shapes = [(128, 128), (128, 4), (4, 128, 2, 128), (4, 128, 128)]
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated) for shape in shapes]

    def loss(x, logits, gate_up, down):
        weights, experts = route(logits, 2, norm_topk_prob=True)
        return jnp.sum(dropless_experts(x, weights, experts, gate_up, down, grouped_matmul_impl(MoEConfig())))

    with jax.set_mesh(mesh):
        assert grouped_matmul_impl(MoEConfig()) == "megablox"
        compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') >= 4


def test_megablox_per_shard_equals_one_device():
    """Megablox (interpreted here) over 8 devices runs per shard: experts split over fsdp=4 (2 each), their width
    over tensor=2, tokens gathered over the expert group and reduce-scattered back. Value and gradients (tokens,
    router logits, experts) equal one device's ragged_dot; the lowered program is a shard_map."""
    from jax.sharding import NamedSharding

    from areal_jax.activation_sharding import activations_on

    keys = jax.random.split(jax.random.key(2), 4)
    e, m = 8, 32
    x, logits = jax.random.normal(keys[0], (m, D)), jax.random.normal(keys[1], (m, e))
    gate_up, down = 0.3 * jax.random.normal(keys[2], (e, D, 2, F)), 0.3 * jax.random.normal(keys[3], (e, F, D))

    def loss(x, logits, gate_up, down, impl):
        weights, experts = route(logits, K, norm_topk_prob=True)
        return jnp.sum(jnp.sin(dropless_experts(x, weights, experts, gate_up, down, impl)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
    value_1, grads_1 = step(x, logits, gate_up, down, "ragged_dot")
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    specs = [P(("data", "fsdp")), P(("data", "fsdp")), P("fsdp", None, None, "tensor"), P("fsdp", "tensor")]
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, logits, gate_up, down), specs, strict=True)]
    with activations_on(mesh):
        lowered = step.lower(*args, "megablox")
        value_8, grads_8 = step(*args, "megablox")
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    np.testing.assert_allclose(value_8, value_1, rtol=1e-5)
    for g8, g1 in zip(grads_8, grads_1, strict=True):  # f32 sums in another order: ~1 ulp per term
        np.testing.assert_allclose(g8, g1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("routing", "impl"), [("top-k", "ragged_dot"), ("one device", "ragged_dot"), ("one device", "megablox")]
)
def test_all_to_all_dispatch_equals_one_device(routing, impl):
    """The all-to-all dispatch over 8 devices (experts over fsdp=4, 2 each, their width over tensor=2; XLA:CPU has
    no ragged all-to-all, so `_exchange` emulates it here) against one device's ragged_dot, value and gradients
    (tokens, router logits, experts). "one device": every pick goes to device 0's two experts, the worst case
    of a round's buffer (each source's M * K rows at once): nothing dropped."""
    from jax.sharding import NamedSharding

    from areal_jax.activation_sharding import activations_on

    keys = jax.random.split(jax.random.key(3), 4)
    e, m = 8, 32
    x, logits = jax.random.normal(keys[0], (m, D)), jax.random.normal(keys[1], (m, e))
    if routing == "one device":
        logits = logits.at[:, :2].add(10.0)
    gate_up, down = 0.3 * jax.random.normal(keys[2], (e, D, 2, F)), 0.3 * jax.random.normal(keys[3], (e, F, D))

    def loss(x, logits, gate_up, down, impl, dispatch):
        weights, experts = route(logits, K, norm_topk_prob=False)
        return jnp.sum(jnp.sin(dropless_experts(x, weights, experts, gate_up, down, impl, dispatch)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=(4, 5))
    value_1, grads_1 = step(x, logits, gate_up, down, "ragged_dot", "all_gather")
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    specs = [P(("data", "fsdp")), P(("data", "fsdp")), P("fsdp", None, None, "tensor"), P("fsdp", "tensor")]
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, logits, gate_up, down), specs, strict=True)]
    with activations_on(mesh):
        value_8, grads_8 = step(*args, impl, "all_to_all")
    if routing == "one device":
        assert set(np.asarray(route(logits, K, False)[1]).ravel()) == {0, 1}
        assert float(jnp.abs(grads_1[2][2:]).max()) == 0.0 < float(jnp.abs(grads_1[2][:2]).min())
    np.testing.assert_allclose(value_8, value_1, rtol=1e-5)
    for g8, g1 in zip(grads_8, grads_1, strict=True):  # f32 sums in another order: ~1 ulp per term
        np.testing.assert_allclose(g8, g1, rtol=1e-5, atol=1e-5)


def test_compile_command_compiles_a_mixture_with_replay_for_a_tpu_slice(capsys):
    """`areal-jax compile` of a mixture under routing replay for 4 + 4 v5e chips: the trainer's programs take the
    recorded routing [M, B, L, Ym, K], and the experts compile to megablox kernels per shard on both sides (a
    Mosaic kernel XLA had to partition would fail to compile), dispatched by ragged all-to-alls (the auto
    dispatch with megablox; XLA:CPU cannot run them, XLA:TPU lowers them) and no all-gather of the tokens."""
    pytest.importorskip("libtpu")
    from areal_jax.cli import main

    overrides = [
        "model.family=qwen3_moe",
        "model.qkv_bias=false",
        "model.qk_norm=true",
        "model.hidden_size=128",
        "model.num_layers=2",
        "model.vocab_size=512",
        "model.max_position_embeddings=128",
        "model.scan_layers=true",
        "model.moe={num_experts: 8, experts_per_token: 2, expert_intermediate_size: 128, norm_topk_prob: true}",
        "trainer.moe.routing_replay=rollout",
        "trainer.packing.rows=8",
        "trainer.packing.token_budget=384",
        "rollout.staleness.batch_prompts=1",
        "rollout.inference_share=1",
        "rollout.trainer_share=1",
    ]
    assert main(["compile", "configs/train_cpu.yaml", "--topology", "v5e-8", "--json", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    gradient = next(p for p in report["trainer"]["programs"] if p["name"].startswith("gradient"))
    assert sum(gradient["kernels"].values()) >= 4, gradient["kernels"]  # two gmm forward, their gradients
    # per sparse layer and round (4): the dispatch and the return, the dispatch again (remat), their gradients
    assert gradient["collectives"]["ragged-all-to-all"]["runs"] >= 2 * 4 * 5, gradient["collectives"]
    # the plan's mini-batch line is the program's arguments beside the params, recorded routing included
    plan = {line["line"].split(" (")[0]: line["bytes"] for line in report["trainer"]["plan"]}
    beside = gradient["arguments"] - gradient["resident"]
    assert 0 <= beside - plan["mini-batch inputs"] <= 4096 < plan["mini-batch inputs"], (plan, beside)
    # 2 layers, 2 of the 8 rows of 48: logits and cotangents fp32, the 2 ids of a token uint8
    assert plan["router logits and ids"] == 2 * 2 * 48 * (2 * 8 * 4 + 2)
    decode = next(p for p in report["inference"]["programs"] if p["name"].startswith("decode"))
    assert sum(decode["kernels"].values()) >= 2, decode["kernels"]


def test_lora_adapters_on_attention_of_a_mixture():
    """Adapters on q/k/v/o of a mixture train alone; the experts stay base, and a fresh adapter changes nothing."""
    from areal_jax.models.lora import adapter_state

    cfg = MOE.replace(lora=LoRAConfig(rank=2))
    model, base = Decoder(cfg, nnx.Rngs(0)), Decoder(MOE, nnx.Rngs(0))
    adapters = nnx.to_flat_state(adapter_state(nnx.state(model)))
    assert adapters and all(path[1] in ("qkv", "lora_o") for path, _ in adapters)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9]])
    args = (tokens, jnp.ones_like(tokens), jnp.arange(6)[None])
    logits = nnx.jit(lambda m, *a: m.logits(*a))
    np.testing.assert_array_equal(logits(model, *args), logits(base, *args))
