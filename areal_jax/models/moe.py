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

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from areal_jax.activation_sharding import mesh_platform, program_mesh
from areal_jax.models.config import ModelConfig, MoEConfig

GroupedMatmul = Literal["ragged_dot", "megablox"]
Dispatch = Literal["all_gather", "all_to_all"]
# Megablox tiles (rows, contraction, output): at most 128, the MXU's width.
_MEGABLOX_TILE = 128


def grouped_matmul_impl(moe: MoEConfig, platform: str | None = None) -> GroupedMatmul:
    """`moe.grouped_matmul` with auto resolved for `platform` (default: the current mesh's, `mesh_platform`)."""
    if moe.grouped_matmul != "auto":
        return moe.grouped_matmul
    return "megablox" if (platform or mesh_platform()) == "tpu" else "ragged_dot"


def dispatch_impl(moe: MoEConfig, impl: GroupedMatmul) -> Dispatch:
    """`moe.dispatch` with auto resolved for grouped matmul `impl`: all_to_all with megablox (measured against
    the all-gather on TPU compiles of Qwen3-30B-A3B's layer: docs/moe.md), else all_gather (ragged_dot left to
    XLA's partitioner; the all-to-all is not measured on GPU, and XLA:CPU has no ragged all-to-all)."""
    if moe.dispatch != "auto":
        return moe.dispatch
    return "all_to_all" if impl == "megablox" else "all_gather"


def _megablox(
    lhs_RxI: jax.Array, rhs_GxIxO: jax.Array, group_sizes_E: jax.Array, group_offset: jax.Array | None
) -> jax.Array:
    """megablox.gmm over rows padded to its row tile; interpreted off TPU (for tests: slow, same numbers)."""
    from jax.experimental.pallas.ops.tpu import megablox  # here: Pallas TPU's import costs every process ~0.5 s

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
    return expert_ids_dtype(cfg.moe.num_experts)


def expert_ids_dtype(num_experts: int) -> jnp.dtype:
    """The dtype expert ids are recorded and kept in: uint8 up to 256 experts, else uint16. A router's ids stay
    in it too (stacked over the layers for the statistics; int32 held 4x the bytes: Qwen3-30B-A3B's gradient
    program on v5p-64 at 8 layers was 25 MB larger)."""
    return jnp.dtype(jnp.uint8 if num_experts <= 256 else jnp.uint16)


class RouterOutput(NamedTuple):
    """What a sparse layer's router did, per token: its logits [..., E] fp32, its own top-k experts [..., K] and
    the experts the token was computed with [..., K] (the top-k, or the replayed ones), ids in `expert_ids_dtype`.
    Zeros in a dense layer of a mixed stack."""

    logits: jax.Array
    experts: jax.Array
    used: jax.Array


def _swiglu_rows(
    x_RxD: jax.Array,
    gate_up_GxDx2xF: jax.Array,
    down_GxFxD: jax.Array,
    group_sizes: jax.Array,
    impl: GroupedMatmul,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """[R, D]: each row through the SwiGLU expert of its group (rows grouped in expert order)."""
    g, d, _, f = gate_up_GxDx2xF.shape
    gate_up_Rx2F = grouped_matmul(x_RxD, gate_up_GxDx2xF.reshape(g, d, 2 * f), group_sizes, impl, group_offset)
    gate_RxF, up_RxF = gate_up_Rx2F[:, :f], gate_up_Rx2F[:, f:]
    return grouped_matmul(jax.nn.silu(gate_RxF) * up_RxF, down_GxFxD, group_sizes, impl, group_offset)


def _combine(out_RxD: jax.Array, order_R: jax.Array, weights_MxK: jax.Array) -> jax.Array:
    """[M, D] fp32: rows sorted by `order_R` back in (token, pick) order, weighted and summed over the picks."""
    m, k = weights_MxK.shape
    unsorted_MxKxD = jnp.take(out_RxD, jnp.argsort(order_R), axis=0).reshape(m, k, -1)
    return jnp.einsum("mkd,mk->md", unsorted_MxKxD.astype(jnp.float32), weights_MxK)


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
    k = experts_MxK.shape[1]
    experts_R = experts_MxK.reshape(-1)
    order_R = jnp.argsort(experts_R, stable=True)  # rows grouped by expert, token order within a group
    group_sizes_E = jnp.bincount(experts_R, length=num_experts).astype(jnp.int32)
    x_RxD = jnp.take(x_MxD, order_R // k, axis=0)
    out_RxD = _swiglu_rows(x_RxD, gate_up_GxDx2xF, down_GxFxD, group_sizes_E, impl, group_offset)
    return _combine(out_RxD, order_R, weights_MxK)


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _index(mesh: Mesh | AbstractMesh, axes: tuple[str, ...]) -> jax.Array:
    """This device's index over `axes` (row-major, the first axis the slowest, as collectives number them)."""
    index = jnp.zeros((), jnp.int32)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


def _exchange(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axes: tuple[str, ...],
    mesh: Mesh | AbstractMesh,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` over `axes`. XLA:CPU has no ragged all-to-all (UNIMPLEMENTED in jax 0.10.2):
    there the same result comes from an all-gather of every device's rows (tests only; it moves them all)."""
    if mesh_platform() != "cpu":
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
        )
    me = _index(mesh, axes)
    rows_NxRxD = jax.lax.all_gather(operand, axes, axis=0)
    start_N, size_N, at_N = (
        jax.lax.all_gather(a, axes, axis=0)[:, me] for a in (input_offsets, send_sizes, output_offsets)
    )
    p_P = jnp.arange(output.shape[0])
    hit_NxP = (p_P[None] >= at_N[:, None]) & (p_P[None] < (at_N + size_N)[:, None])
    source_P = jnp.argmax(hit_NxP, axis=0)
    row_P = jnp.clip(start_N[source_P] + p_P - at_N[source_P], 0, operand.shape[0] - 1)
    hit_P = jnp.any(hit_NxP, axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(hit_P, rows_NxRxD[source_P, row_P], output)


def _all_to_all_experts(
    mesh: Mesh | AbstractMesh,
    expert_axes: tuple[str, ...],
    exchange_axes: tuple[str, ...],
    impl: GroupedMatmul,
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_GxDx2xF: jax.Array,
    down_GxFxD: jax.Array,
) -> jax.Array:
    """[M, D] fp32, one device's part of the all-to-all dispatch (inside `shard_map`): this device's tokens'
    picks go only to the devices holding their experts, in N rounds over the N devices of `exchange_axes`
    (the expert axes that also split the tokens). In round r each device sends to the device r places after
    it the rows of that device's experts, receives those of the device r places before it, runs them through
    its G local experts and sends the results back (`ragged_all_to_all` both ways); `lax.scan` over the rounds,
    each rematerialised for the gradient, so one round's buffers are live at a time.

    Dropless with static shapes: a round receives from one device only, at most its M * K rows (a token picks K
    experts, all of which may be here), so a buffer of M * K rows never drops a pick whatever the routing. A
    single-round all-to-all would need N * M * K rows (every device's picks may go to one device): the
    all-gather's size. Each round's buffer holds about M * K / N real rows under balanced routing; megablox
    visits only the real rows' tiles, ragged_dot computes the whole buffer. Picks of experts held along an
    expert axis that does not split the tokens are left to those devices (their sum is the caller's psum)."""
    m, k = experts_MxK.shape
    g = gate_up_GxDx2xF.shape[0]
    n = math.prod(mesh.shape[a] for a in exchange_axes)
    experts_R = experts_MxK.reshape(-1)
    shard_R = experts_R // g
    coord_R: dict[str, jax.Array] = {}
    for axis in reversed(expert_axes):
        coord_R[axis], shard_R = shard_R % mesh.shape[axis], shard_R // mesh.shape[axis]
    peer_R = jnp.zeros_like(experts_R)
    mine_R = jnp.ones(experts_R.shape, bool)
    for axis in expert_axes:
        if axis in exchange_axes:
            peer_R = peer_R * mesh.shape[axis] + coord_R[axis]
        else:
            mine_R &= coord_R[axis] == jax.lax.axis_index(axis)
    # rows sorted by (peer, its local expert); the picks left to other devices last, never sent
    key_R = jnp.where(mine_R, peer_R * g + experts_R % g, n * g)
    order_R = jnp.argsort(key_R, stable=True)
    counts_NxG = jnp.bincount(key_R, length=n * g + 1)[: n * g].reshape(n, g).astype(jnp.int32)
    send_N = jnp.sum(counts_NxG, axis=1)
    send_at_N = jnp.cumsum(send_N) - send_N
    if n > 1:  # what each source sends here, per local expert, and where its rows for here start there
        received_NxG = jax.lax.all_to_all(counts_NxG, exchange_axes, 0, 0, tiled=True)
        source_at_N = jax.lax.all_to_all(send_at_N, exchange_axes, 0, 0, tiled=True)
    else:
        received_NxG, source_at_N = counts_NxG, send_at_N
    recv_N = jnp.sum(received_NxG, axis=1)
    x_RxD = jnp.take(x_MxD, order_R // k, axis=0)
    me = _index(mesh, exchange_axes)
    peers_N = jnp.arange(n)
    zeros_N = jnp.zeros((n,), jnp.int32)

    def round_rows(r: jax.Array) -> jax.Array:
        """[M * K, D]: the rows received in round r through this device's experts, zero past the received."""
        source, dest = (me - r) % n, (me + r) % n
        send, recv = jnp.where(peers_N == dest, send_N, 0), jnp.where(peers_N == source, recv_N, 0)
        rows_CxD = x_RxD  # one device: its own rows
        if n > 1:
            rows_CxD = _exchange(x_RxD, jnp.zeros_like(x_RxD), send_at_N, send, zeros_N, recv, exchange_axes, mesh)
        sizes_G = received_NxG[source]
        out_CxD = _swiglu_rows(rows_CxD, gate_up_GxDx2xF, down_GxFxD, sizes_G, impl)
        return jnp.where((jnp.arange(m * k) < jnp.sum(sizes_G))[:, None], out_CxD, 0)

    def one_round(out_RxD: jax.Array, r: jax.Array) -> tuple[jax.Array, None]:
        out_CxD = jax.checkpoint(round_rows)(r)
        if n == 1:
            return out_CxD, None
        source, dest = (me - r) % n, (me + r) % n
        back, recv = jnp.where(peers_N == source, recv_N, 0), jnp.where(peers_N == dest, send_N, 0)
        return _exchange(out_CxD, out_RxD, zeros_N, back, source_at_N, recv, exchange_axes, mesh), None

    out_RxD, _ = jax.lax.scan(one_round, jnp.zeros_like(x_RxD), jnp.arange(n))
    return _combine(out_RxD, order_R, weights_MxK)


def _expert_parallel(
    mesh: Mesh | AbstractMesh,
    dispatch: Dispatch,
    impl: GroupedMatmul,
    x_MxD: jax.Array,
    weights_MxK: jax.Array,
    experts_MxK: jax.Array,
    gate_up_ExDx2xF: jax.Array,
    down_ExFxD: jax.Array,
) -> jax.Array:
    """[M, D] fp32: the experts per shard of `mesh` (XLA cannot partition a Pallas kernel). Each device holds its
    experts (`expert` axis) and its slice of their width (`mlp`). `all_gather`: the tokens are gathered over the
    devices holding the other experts, each device computes its experts' rows only (megablox's group offset), and
    the partial sums are reduce-scattered back to the tokens' devices. `all_to_all`: `_all_to_all_experts`."""
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
        if dispatch == "all_to_all":
            out_MxD = _all_to_all_experts(
                mesh, expert_axes, gathered, impl, x_MxD, weights_MxK, experts_MxK, gate_up_GxDx2xF, down_GxFxD
            )
            return jax.lax.psum(out_MxD, summed) if summed else out_MxD
        if gathered:
            x_MxD, weights_MxK, experts_MxK = (
                jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x_MxD, weights_MxK, experts_MxK)
            )
        offset = _index(mesh, expert_axes) * gate_up_GxDx2xF.shape[0]
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
    dispatch: Dispatch = "all_gather",
) -> jax.Array:
    """sum_k weights[m, k] * expert_{experts[m, k]}(x[m]), [M, D], every pick computed (no capacity). Over a mesh
    of several devices (`program_mesh`), per shard (`_expert_parallel`) with megablox or the all-to-all dispatch;
    ragged_dot under the all-gather dispatch is left to XLA's partitioner (which gathers the routed rows)."""
    mesh = program_mesh()
    args = (x_MxD, weights_MxK, experts_MxK, gate_up_ExDx2xF, down_ExFxD)
    if mesh is not None and mesh.size > 1 and (impl == "megablox" or dispatch == "all_to_all"):
        combined_MxD = _expert_parallel(mesh, dispatch, impl, *args)
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


def load_balancing_loss(logits_NxE: jax.Array, experts_NxK: jax.Array, mask_N: jax.Array) -> jax.Array:
    """The Switch Transformer's auxiliary loss of one router as HF computes it: E * sum_e f_e * P_e, f_e the share
    of the (token, pick) assignments going to expert e (summing to K), P_e the mean router probability of e,
    over the tokens where `mask_N` is set. N: any leading axes (sparse layers, rows, positions), reduced in place:
    merging a sharded rows axis into others would make the compiler gather every chip's tokens (on TPU, Qwen3-30B-
    A3B's 48 layers of router logits of the global batch, 12 GiB a chip: docs/tpu.md)."""
    e = logits_NxE.shape[-1]
    mask_N = mask_N.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask_N), 1.0)
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    picked_NxE = jnp.sum(jax.nn.one_hot(experts_NxK, e, dtype=jnp.float32), axis=-2)
    leading = tuple(range(mask_N.ndim))
    assigned_E = jnp.sum(picked_NxE * mask_N[..., None], axis=leading) / tokens
    mean_prob_E = jnp.sum(probs_NxE * mask_N[..., None], axis=leading) / tokens
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
        dtype, impl = self.compute_dtype, grouped_matmul_impl(self.moe)
        out_MxD = dropless_experts(
            x_MxD,
            weights_MxK,
            used_MxK,
            self.gate_up[...].astype(dtype),
            self.down[...].astype(dtype),
            impl,
            dispatch_impl(self.moe, impl),
        )
        if self.shared_gate_up is not None:
            out_MxD = out_MxD + self.shared_expert(x_MxD)
        ids = expert_ids_dtype(self.moe.num_experts)
        experts_MxK, used_MxK = experts_MxK.astype(ids), used_MxK.astype(ids)
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
