"""The mixture-of-experts feed-forward (HF Qwen3-MoE): a softmax router picks each token's top-k experts, and the
experts, SwiGLU MLPs stacked on an `expert` axis, run dropless.

Dropless: every (token, pick) pair is a row; the rows are sorted by expert and multiplied by grouped matmuls
whose groups are the experts' row counts. No expert has a capacity and no token is dropped; the arrays keep
their shapes (M * k rows) whatever the routing, only the group sizes vary. The grouped matmul is
`jax.lax.ragged_dot` (portable) or, on TPU, the Pallas megablox kernel (`grouped_matmul_impl`).

Legend: B batch rows, T length, D model width, M = B * T tokens, E experts, K experts per token (top-k),
R = M * K routed rows, F an expert's MLP width.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu import megablox
from jax.sharding import AbstractMesh, Mesh

from areal_jax.activation_sharding import mesh_platform, program_mesh
from areal_jax.models.config import ModelConfig, MoEConfig

GroupedMatmul = Literal["ragged_dot", "megablox"]
# Megablox tiles (rows, contraction, output): at most 128, the MXU's width.
_MEGABLOX_TILE = 128


def grouped_matmul_impl(moe: MoEConfig, platform: str | None = None) -> GroupedMatmul:
    """`moe.grouped_matmul` with auto resolved for `platform` (default: the current mesh's, `mesh_platform`)."""
    if moe.grouped_matmul != "auto":
        return moe.grouped_matmul
    return "megablox" if (platform or mesh_platform()) == "tpu" else "ragged_dot"


def _megablox(
    lhs_RxI: jax.Array, rhs_GxIxO: jax.Array, group_sizes_E: jax.Array, group_offset: jax.Array | None
) -> jax.Array:
    """megablox.gmm over rows padded to its row tile; interpreted off TPU (for tests: slow, same numbers)."""
    r, i = lhs_RxI.shape
    tm = min(_MEGABLOX_TILE, -(-r // 8) * 8)
    padded = -(-r // tm) * tm
    tiling = (tm, min(_MEGABLOX_TILE, i), min(_MEGABLOX_TILE, rhs_GxIxO.shape[2]))
    out = megablox.gmm(
        jnp.pad(lhs_RxI, ((0, padded - r), (0, 0))),
        rhs_GxIxO,
        group_sizes_E,
        lhs_RxI.dtype,
        tiling,
        group_offset,
        interpret=mesh_platform() != "tpu",
    )
    return out[:r]


def grouped_matmul(
    lhs_RxI: jax.Array,
    rhs_GxIxO: jax.Array,
    group_sizes_E: jax.Array,
    impl: GroupedMatmul = "ragged_dot",
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """[R, O]: rows [start_e, start_e + group_sizes_E[e]) of `lhs_RxI` times `rhs_GxIxO[e]`, for every e in order
    (the groups cover all R rows). With `group_offset` (megablox only) `rhs_GxIxO` holds groups
    group_offset .. group_offset + G - 1 of the E, and the rows of the other groups are zero."""
    if impl == "megablox":
        return _megablox(lhs_RxI, rhs_GxIxO, group_sizes_E, group_offset)
    if group_offset is not None:
        raise ValueError("group_offset needs the megablox grouped matmul")
    return jax.lax.ragged_dot(lhs_RxI, rhs_GxIxO, group_sizes_E)


def route(logits_MxE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [M, K] fp32, expert ids [M, K] int32): the top-k of the fp32 softmax of the router logits, in
    descending probability, renormalised to sum to 1 with `norm_topk_prob`."""
    probs_MxE = jax.nn.softmax(logits_MxE.astype(jnp.float32), axis=-1)
    weights_MxK, experts_MxK = jax.lax.top_k(probs_MxE, k)
    if norm_topk_prob:
        weights_MxK = weights_MxK / jnp.sum(weights_MxK, axis=-1, keepdims=True)
    return weights_MxK, experts_MxK.astype(jnp.int32)


def replayed_weights(logits_MxE: jax.Array, experts_MxK: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """[M, K] fp32: `route`'s weights at given experts (routing replay, R3): the current router's softmax at the
    recorded experts, renormalised with `norm_topk_prob`, so the router keeps its gradient."""
    probs_MxE = jax.nn.softmax(logits_MxE.astype(jnp.float32), axis=-1)
    weights_MxK = jnp.take_along_axis(probs_MxE, experts_MxK, axis=-1)
    if norm_topk_prob:
        weights_MxK = weights_MxK / jnp.sum(weights_MxK, axis=-1, keepdims=True)
    return weights_MxK


def sparse_layer_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """The sparse layers' indices, in order: the layer axis (Ym) of recorded routing."""
    return tuple(i for i, sparse in enumerate(cfg.sparse_layers) if sparse)


def routing_dtype(cfg: ModelConfig) -> jnp.dtype:
    """The compact dtype of recorded expert ids: uint8 up to 256 experts, else uint16."""
    assert cfg.moe is not None
    return jnp.dtype(jnp.uint8 if cfg.moe.num_experts <= 256 else jnp.uint16)


class RouterOutput(NamedTuple):
    """What a sparse layer's router did, per token: its logits [..., E] fp32, its own top-k experts [..., K] int32
    and the experts the token was computed with [..., K] int32 (the top-k, or the replayed ones). Zeros in a
    dense layer of a mixed stack."""

    logits: jax.Array
    experts: jax.Array
    used: jax.Array


def _experts_sum(
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_GxDx2xF: jax.Array,
    down_GxFxD: jax.Array,
    num_experts: int,
    impl: GroupedMatmul,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """[M, D] fp32: `dropless_experts` over the G experts held from `group_offset` on (all E without it); the
    picks of other experts add nothing."""
    m, d = x_MxD.shape
    g, _, _, f = gate_up_GxDx2xF.shape
    k = experts_MxK.shape[1]
    experts_R = experts_MxK.reshape(-1)
    order_R = jnp.argsort(experts_R, stable=True)  # rows grouped by expert, token order within a group
    group_sizes_E = jnp.bincount(experts_R, length=num_experts).astype(jnp.int32)
    x_RxD = jnp.take(x_MxD, order_R // k, axis=0)
    gate_up_Rx2F = grouped_matmul(x_RxD, gate_up_GxDx2xF.reshape(g, d, 2 * f), group_sizes_E, impl, group_offset)
    gate_RxF, up_RxF = gate_up_Rx2F[:, :f], gate_up_Rx2F[:, f:]
    out_RxD = grouped_matmul(jax.nn.silu(gate_RxF) * up_RxF, down_GxFxD, group_sizes_E, impl, group_offset)
    # back to (token, pick) order: the inverse permutation's gather, then a weighted sum over the picks
    unsorted_MxKxD = jnp.take(out_RxD, jnp.argsort(order_R), axis=0).reshape(m, k, d)
    return jnp.einsum("mkd,mk->md", unsorted_MxKxD.astype(jnp.float32), weights_MxK)


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _expert_parallel(
    mesh: Mesh | AbstractMesh,
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_ExDx2xF: jax.Array,
    down_ExFxD: jax.Array,
) -> jax.Array:
    """[M, D] fp32: the megablox experts per shard of `mesh` (XLA cannot partition a Pallas kernel). Each device
    holds its experts (`expert` axis) and its slice of their width (`mlp`); the tokens are gathered over the
    devices holding the other experts (the all-gather dispatch), each device computes its experts' rows only
    (megablox's group offset), and the partial sums are reduce-scattered back to the tokens' devices."""
    from areal_jax.sharding import logical_to_spec

    e = gate_up_ExDx2xF.shape[0]
    expert, _, _, mlp = logical_to_spec(("expert", "embed", "gate_up", "mlp"), gate_up_ExDx2xF.shape, mesh)
    tokens = logical_to_spec(("batch",), x_MxD.shape[:1], mesh)[0]
    expert_axes, mlp_axes, token_axes = _axes(expert), _axes(mlp), _axes(tokens)
    gathered = tuple(a for a in expert_axes if a in token_axes)
    summed = tuple(a for a in expert_axes if a not in token_axes) + mlp_axes
    P = jax.sharding.PartitionSpec

    def local(
        x_MxD: jax.Array,
        weights_MxK: jax.Array,
        experts_MxK: jax.Array,
        gate_up_GxDx2xF: jax.Array,
        down_GxFxD: jax.Array,
    ) -> jax.Array:
        if gathered:
            x_MxD, weights_MxK, experts_MxK = (
                jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_MxD, weights_MxK, experts_MxK)
            )
        shard = jnp.zeros((), jnp.int32)
        for axis in expert_axes:
            shard = shard * mesh.shape[axis] + jax.lax.axis_index(axis)
        offset = shard * gate_up_GxDx2xF.shape[0]
        out_MxD = _experts_sum(x_MxD, weights_MxK, experts_MxK, gate_up_GxDx2xF, down_GxFxD, e, "megablox", offset)
        if summed:
            out_MxD = jax.lax.psum(out_MxD, summed)
        if gathered:
            out_MxD = jax.lax.psum_scatter(out_MxD, gathered, scatter_dimension=0, tiled=True)
        return out_MxD

    rows = P(tokens, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, P(expert, None, None, mlp), P(expert, mlp, None)),
        out_specs=rows,
        check_vma=False,
    )(x_MxD, weights_MxK, experts_MxK, gate_up_ExDx2xF, down_ExFxD)


def dropless_experts(
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_ExDx2xF: jax.Array,
    down_ExFxD: jax.Array,
    impl: GroupedMatmul = "ragged_dot",
) -> jax.Array:
    """sum_k weights[m, k] * expert_{experts[m, k]}(x[m]), [M, D], every pick computed (no capacity). With
    megablox over a mesh of several devices (`program_mesh`), per shard (`_expert_parallel`)."""
    mesh = program_mesh()
    args = (x_MxD, weights_MxK, experts_MxK, gate_up_ExDx2xF, down_ExFxD)
    if impl == "megablox" and mesh is not None and mesh.size > 1:
        combined_MxD = _expert_parallel(mesh, *args)
    else:
        combined_MxD = _experts_sum(*args, gate_up_ExDx2xF.shape[0], impl)
    return combined_MxD.astype(x_MxD.dtype)


def one_hot_experts(
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_ExDx2xF: jax.Array,
    down_ExFxD: jax.Array,
) -> jax.Array:
    """`dropless_experts` computed densely: every expert on every token, combined with one-hot weights (the
    reference of tests and benchmarks; E times the FLOPs)."""
    e = gate_up_ExDx2xF.shape[0]
    combine_MxE = jnp.einsum("mk,mke->me", weights_MxK, jax.nn.one_hot(experts_MxK, e, dtype=jnp.float32))
    gate_up_ExMx2xF = jnp.einsum("md,edcf->emcf", x_MxD, gate_up_ExDx2xF)
    hidden_ExMxF = jax.nn.silu(gate_up_ExMx2xF[:, :, 0]) * gate_up_ExMx2xF[:, :, 1]
    out_ExMxD = jnp.einsum("emf,efd->emd", hidden_ExMxF, down_ExFxD)
    return jnp.einsum("emd,me->md", out_ExMxD.astype(jnp.float32), combine_MxE).astype(x_MxD.dtype)


def load_balancing_loss(logits_MxE: jax.Array, experts_MxK: jax.Array, mask_M: jax.Array) -> jax.Array:
    """The Switch Transformer's auxiliary loss of one router as HF computes it: E * sum_e f_e * P_e, f_e the share
    of the (token, pick) assignments going to expert e (summing to K), P_e the mean router probability of e,
    over the tokens where `mask_M` is set."""
    e = logits_MxE.shape[-1]
    mask_M = mask_M.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask_M), 1.0)
    probs_MxE = jax.nn.softmax(logits_MxE.astype(jnp.float32), axis=-1)
    assigned_E = jnp.einsum("mke,m->e", jax.nn.one_hot(experts_MxK, e, dtype=jnp.float32), mask_M) / tokens
    mean_prob_E = jnp.einsum("me,m->e", probs_MxE, mask_M) / tokens
    return e * jnp.sum(assigned_E * mean_prob_E)


class MoEBlock(nnx.Module):
    """The routed experts of one layer: router [D, E] and SwiGLU experts, gate/up [E, D, 2, F] and down [E, F, D];
    with `shared_expert_intermediate_size` (Qwen2-MoE, Qwen3.5-MoE) also a shared SwiGLU expert every token runs
    through, gate/up [D, 2, S] and down [S, D], its output scaled by sigmoid(x @ shared_gate [D])."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe = cfg.moe
        assert moe is not None
        d, e, f, std = cfg.hidden_size, moe.num_experts, moe.expert_intermediate_size, cfg.initializer_range
        self.moe = moe
        self.compute_dtype = cfg.compute_jnp_dtype

        def param(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
            value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
            return nnx.Param(value.astype(cfg.param_jnp_dtype), out_sharding=axes)

        self.router = param((d, e), ("embed", None))
        self.gate_up = param((e, d, 2, f), ("expert", "embed", "gate_up", "mlp"))
        self.down = param((e, f, d), ("expert", "mlp", "embed"))
        s = moe.shared_expert_intermediate_size
        self.shared_gate_up = None if s is None else param((d, 2, s), ("embed", "gate_up", "mlp"))
        self.shared_down = None if s is None else param((s, d), ("mlp", "embed"))
        self.shared_gate = None if s is None else param((d,), ("embed",))

    def router_logits(self, x_MxD: jax.Array) -> jax.Array:
        """[M, E] fp32."""
        return jnp.einsum("md,de->me", x_MxD, self.router[...].astype(x_MxD.dtype), preferred_element_type=jnp.float32)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        return self.routed(x_BxTxD)[0]

    def routed(self, x_BxTxD: jax.Array, replay_BxTxK: jax.Array | None = None) -> tuple[jax.Array, RouterOutput]:
        """(output [B, T, D], the router's logits and top-k). With `replay_BxTxK` each token runs through those
        experts instead of its top-k, weighted by `replayed_weights`."""
        b, t, d = x_BxTxD.shape
        x_MxD = x_BxTxD.reshape(b * t, d)
        logits_MxE = self.router_logits(x_MxD)
        weights_MxK, experts_MxK = route(logits_MxE, self.moe.experts_per_token, self.moe.norm_topk_prob)
        used_MxK = experts_MxK
        if replay_BxTxK is not None:
            used_MxK = replay_BxTxK.reshape(b * t, -1).astype(jnp.int32)
            weights_MxK = replayed_weights(logits_MxE, used_MxK, self.moe.norm_topk_prob)
        dtype = self.compute_dtype
        out_MxD = dropless_experts(
            x_MxD,
            weights_MxK,
            used_MxK,
            self.gate_up[...].astype(dtype),
            self.down[...].astype(dtype),
            grouped_matmul_impl(self.moe),
        )
        if self.shared_gate_up is not None:
            out_MxD = out_MxD + self.shared_expert(x_MxD)
        router = RouterOutput(*(a.reshape(b, t, -1) for a in (logits_MxE, experts_MxK, used_MxK)))
        return out_MxD.reshape(b, t, d), router

    def shared_expert(self, x_MxD: jax.Array) -> jax.Array:
        """[M, D]: sigmoid(x @ shared_gate) * down(silu(gate(x)) * up(x)), the shared expert's share of every token."""
        assert self.shared_gate_up is not None and self.shared_down is not None and self.shared_gate is not None
        dtype = self.compute_dtype
        gate_up_Mx2xS = jnp.einsum("md,dcs->mcs", x_MxD, self.shared_gate_up[...].astype(dtype))
        out_MxD = (jax.nn.silu(gate_up_Mx2xS[:, 0]) * gate_up_Mx2xS[:, 1]) @ self.shared_down[...].astype(dtype)
        gate_M = jnp.einsum("md,d->m", x_MxD, self.shared_gate[...].astype(dtype), preferred_element_type=jnp.float32)
        return (jax.nn.sigmoid(gate_M)[:, None] * out_MxD.astype(jnp.float32)).astype(x_MxD.dtype)
