"""The gated delta rule and its convolution against transformers' torch references (forward and autograd),
finite differences, the chunked form against the recurrent one, and packed sequences kept apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from areal_jax.models.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    conv_step,
    gated_delta_step,
    recurrent_gated_delta_rule,
    resets_from_segments,
)

B, T, N, H, K, V = 2, 19, 2, 4, 8, 6
CHUNK = 8


def _inputs(seed: int = 0, t: int = T, b: int = B) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q": rng.normal(size=(b, t, N, K)).astype(np.float32),
        "k": rng.normal(size=(b, t, N, K)).astype(np.float32),
        "v": rng.normal(size=(b, t, H, V)).astype(np.float32),
        "g": -np.log1p(np.exp(rng.normal(size=(b, t, H)))).astype(np.float32),
        "beta": (1 / (1 + np.exp(-rng.normal(size=(b, t, H))))).astype(np.float32),
        "state": (0.3 * rng.normal(size=(b, H, K, V))).astype(np.float32),
    }


def _torch_reference(kind: str, x: dict[str, np.ndarray], cot_out: np.ndarray, cot_state: np.ndarray):
    """(output, final state, gradients of <out, cot_out> + <state, cot_state>) under transformers' rule."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    args = {name: torch.tensor(value, requires_grad=True) for name, value in x.items()}
    common = dict(initial_state=args["state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    if kind == "chunk":
        fn, common = hf.torch_chunk_gated_delta_rule, {**common, "chunk_size": CHUNK}
    else:
        fn = hf.torch_recurrent_gated_delta_rule
    out, state = fn(args["q"], args["k"], args["v"], g=args["g"], beta=args["beta"], **common)
    loss = (out * torch.tensor(cot_out)).sum() + (state * torch.tensor(cot_state)).sum()
    loss.backward()
    grads = {name: arg.grad.numpy() for name, arg in args.items()}
    return out.detach().numpy(), state.detach().numpy(), grads


def _ours(kind: str):
    def run(q, k, v, g, beta, state):
        if kind == "chunk":
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=state, chunk=CHUNK)
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=state)

    return run


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_matches_transformers_forward_and_gradients(kind):
    x = _inputs()
    rng = np.random.default_rng(1)
    cot_out = rng.normal(size=(B, T, H, V)).astype(np.float32)
    cot_state = rng.normal(size=(B, H, K, V)).astype(np.float32)
    ref_out, ref_state, ref_grads = _torch_reference(kind, x, cot_out, cot_state)

    run = jax.jit(_ours(kind))
    out, state = run(**x)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(state, ref_state, atol=2e-5, rtol=0)

    def loss(*args):
        out, state = run(*args)
        return jnp.sum(out * cot_out) + jnp.sum(state * cot_state)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*x.values())
    for name, grad in zip(x, grads, strict=True):
        scale = np.abs(ref_grads[name]).max()
        np.testing.assert_allclose(grad / scale, ref_grads[name] / scale, atol=2e-5, rtol=0, err_msg=name)


def test_finite_differences():
    x = _inputs(2, t=5, b=1)
    reset = np.array([[False, False, True, False, False]])
    with jax.enable_x64(True):
        args = [np.asarray(value, np.float64) for value in x.values()]
        check_grads(
            jax.jit(lambda q, k, v, g, beta, state: chunk_gated_delta_rule(q, k, v, g, beta, reset, state, chunk=2)),
            args,
            order=1,
            modes=("rev",),
            atol=1e-6,
            rtol=1e-6,
        )


# In float64 the forms agree to rounding (so any fp32 gap between them is summation order, not a different
# function): measured 1e-15, bound 1e-12.
@pytest.mark.parametrize("dtype, atol", [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_chunked_equals_recurrent_with_resets(dtype, atol):
    x = {name: value.astype(dtype) for name, value in _inputs(3, t=23).items()}
    reset = np.zeros((B, 23), bool)
    reset[0, [0, 5, 16]] = True  # row 0 starts fresh three times; row 1 continues its initial state
    with jax.enable_x64(dtype == np.float64):
        chunked = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk=CHUNK))(*list(x.values())[:5], reset, x["state"])
        recurrent = jax.jit(recurrent_gated_delta_rule)(*list(x.values())[:5], reset, x["state"])
        assert chunked[0].dtype == recurrent[0].dtype == dtype
        for a, b in zip(chunked, recurrent, strict=True):
            np.testing.assert_allclose(a, b, atol=atol, rtol=0)
        state = x["state"]
        step = jax.jit(gated_delta_step)
        for i in range(23):  # and the decode step, token by token
            token = [value[:, i] for value in list(x.values())[:5]]
            state = jnp.where(reset[:, i, None, None, None], 0.0, state)
            out, state = step(*token, state)
            np.testing.assert_allclose(out, recurrent[0][:, i], atol=atol, rtol=0)
        np.testing.assert_allclose(state, recurrent[1], atol=atol, rtol=0)


def test_strong_gates_lose_no_precision_within_a_chunk():
    """A chunk of 64 whose log decay sums to ~ -500 (every 4th token wipes the state, the others barely decay
    it): the decays between neighbours are summed over their span, not as differences of the chunk's running
    sums (which carry ~|sum| x eps of rounding: 4e-6 here), so fp32 stays as close to the float64 recurrence as
    fp32's own recurrence (4e-8 and 5e-8 measured)."""
    rng = np.random.default_rng(7)
    b, t, n, h, k, v = 1, 64, 2, 4, 16, 8
    q, key = rng.normal(size=(2, b, t, n, k))
    value = rng.normal(size=(b, t, h, v))
    g = np.where(np.arange(t)[None, :, None] % 4 == 3, -30.0, -0.01 * rng.random(size=(b, t, h)))
    beta = rng.uniform(0.2, 0.8, size=(b, t, h))
    with jax.enable_x64(True):
        reference = np.asarray(jax.jit(recurrent_gated_delta_rule)(q, key, value, g, beta)[0])
    fp32 = [x.astype(np.float32) for x in (q, key, value, g, beta)]
    out, _ = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk=64))(*fp32)
    np.testing.assert_allclose(out, reference, atol=4e-7, rtol=0)


def test_packed_row_keeps_sequences_apart():
    lengths = (7, 12, 4)
    x = _inputs(4, t=sum(lengths) + 3, b=1)  # 3 padding tokens at the end
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(3)])[None]
    reset = resets_from_segments(jnp.asarray(segments))
    conv_weight = np.random.default_rng(5).normal(size=(4, H * V)).astype(np.float32)
    seq = list(x.values())[:5]
    rule = jax.jit(lambda *a: chunk_gated_delta_rule(*a, chunk=CHUNK))
    conv1d = jax.jit(causal_conv1d)
    packed_out, _ = rule(*seq, reset, x["state"])
    packed_conv = conv1d(jnp.asarray(x["v"].reshape(1, -1, H * V)), conv_weight, reset)
    start = 0
    for n in lengths:
        alone = [value[:, start : start + n] for value in seq]
        out, _ = rule(*alone)
        np.testing.assert_allclose(packed_out[:, start : start + n], out, atol=2e-5, rtol=0)
        conv = conv1d(jnp.asarray(alone[2].reshape(1, n, H * V)), conv_weight)
        np.testing.assert_allclose(packed_conv[:, start : start + n], conv, atol=1e-6, rtol=0)
        start += n


def test_conv_matches_torch_and_its_step():
    import torch

    rng = np.random.default_rng(6)
    x = rng.normal(size=(B, T, 5)).astype(np.float32)
    weight = rng.normal(size=(4, 5)).astype(np.float32)
    ref = torch.nn.functional.conv1d(
        torch.tensor(x).transpose(1, 2), torch.tensor(weight.T[:, None]), padding=3, groups=5
    )[:, :, :T]
    np.testing.assert_allclose(causal_conv1d(jnp.asarray(x), weight), ref.transpose(1, 2).numpy(), atol=1e-5)
    window = rng.normal(size=(B, 3, 5)).astype(np.float32)
    whole = causal_conv1d(jnp.asarray(x), weight, window_BxWxE=jnp.asarray(window))
    step = jax.jit(conv_step)
    for i in range(T):
        y, window = step(jnp.asarray(x[:, i]), weight, window)
        np.testing.assert_allclose(y, whole[:, i], atol=1e-5, rtol=0)
