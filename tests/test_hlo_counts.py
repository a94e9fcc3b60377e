# ruff: noqa: E501  (HLO text keeps its long lines)
"""`compile/hlo.collectives` counts each collective as often as it runs per call of the program: trip counts
multiply along the actual nesting of loops, a computation is counted once per call site, and an async start's
bytes are its buffer's (not a permute's u32 contexts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from areal_jax.compile import hlo


def test_a_psum_in_a_scan_in_a_scan_runs_outer_times_inner_trips():
    """shard_map over the 8 CPU devices: a psum inside a scan of 4 inside a scan of 3 runs 12 times, another
    psum in the outer scan's body only 3 times."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))

    def inner(c, _):
        return jax.lax.psum(c * 2.0, "x") * 0.1 + c, None

    def outer(c, _):
        c, _ = jax.lax.scan(inner, c, None, length=4)
        return jnp.sin(jax.lax.psum(c[:, :3], "x").sum() + c), None

    def f(x):
        return jax.shard_map(
            lambda x: jax.lax.scan(outer, x, None, length=3)[0], mesh=mesh, in_specs=P("x"), out_specs=P("x")
        )(x)

    text = jax.jit(f).lower(jnp.ones((8, 16))).compile().as_text()
    found = sorted((c.kind, c.runs, c.shapes) for c in hlo.collectives(text))
    assert found == [("all-reduce", 3, (("f32", (1, 3)),)), ("all-reduce", 12, (("f32", (1, 16)),))], found


# XLA:TPU's form (no known_trip_count): an s32 scan of 3 whose body runs a windowed einsum loop of 8 trips counted
# in u32 (a collective-permute-start: operand, result and two u32 contexts) and, at two call sites, the same loop
# body of a `i <= 1` loop (2 trips) and a loop XLA knows runs 5 times.
TPU_LIKE = """HloModule nested

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%window_cond (p: (bf16[4,128], u32[])) -> pred[] {
  %p = (bf16[4,128]{1,0:T(8,128)(2,1)}, u32[]{:T(128)}) parameter(0)
  %constant.1 = u32[]{:T(128)} constant(8)
  %constant.2 = u32[]{:T(128)} constant(1000)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.1), direction=LT
}

%window_body (p: (bf16[4,128], u32[])) -> (bf16[4,128], u32[]) {
  %p = (bf16[4,128]{1,0:T(8,128)(2,1)}, u32[]{:T(128)}) parameter(0)
  %x = bf16[4,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=0
  %cp = (bf16[4,128]{1,0:T(8,128)(2,1)}, bf16[4,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %y = bf16[4,128]{1,0:T(8,128)(2,1)} collective-permute-done(%cp)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %t = (bf16[4,128]{1,0:T(8,128)(2,1)}, u32[]{:T(128)}) tuple(%y, %i)
}

%shared_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %constant.3 = s32[]{:T(128)} constant(1)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %le = pred[]{:T(512)} compare(%i, %constant.3), direction=LE
}

%shared_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %r = f32[8]{0} all-reduce(%v), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%i, %r)
}

%scan_cond (p: (s32[], bf16[4,128], f32[8])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[4,128]{1,0}, f32[8]{0}) parameter(0)
  %constant.4 = s32[]{:T(128)} constant(3)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %constant.4), direction=LT
}

%scan_body (p: (s32[], bf16[4,128], f32[8])) -> (s32[], bf16[4,128], f32[8]) {
  %p = (s32[]{:T(128)}, bf16[4,128]{1,0}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %x = bf16[4,128]{1,0} get-tuple-element(%p), index=1
  %v = f32[8]{0} get-tuple-element(%p), index=2
  %zero = u32[]{:T(128)} constant(0)
  %wt = (bf16[4,128]{1,0}, u32[]{:T(128)}) tuple(%x, %zero)
  %w = (bf16[4,128]{1,0}, u32[]{:T(128)}) while(%wt), condition=%window_cond, body=%window_body
  %y = bf16[4,128]{1,0} get-tuple-element(%w), index=0
  %st = (s32[]{:T(128)}, f32[8]{0}) tuple(%i, %v)
  %s = (s32[]{:T(128)}, f32[8]{0}) while(%st), condition=%shared_cond, body=%shared_body
  %k = (s32[]{:T(128)}, f32[8]{0}) while(%st), condition=%shared_cond, body=%shared_body, backend_config={"known_trip_count":{"n":"5"}}
  %u = f32[8]{0} get-tuple-element(%s), index=1
  ROOT %t = (s32[]{:T(128)}, bf16[4,128]{1,0}, f32[8]{0}) tuple(%i, %y, %u)
}

ENTRY %main (x: bf16[4,128], v: f32[8]) -> bf16[4,128] {
  %x = bf16[4,128]{1,0} parameter(0)
  %v = f32[8]{0} parameter(1)
  %zero = s32[]{:T(128)} constant(0)
  %t = (s32[]{:T(128)}, bf16[4,128]{1,0}, f32[8]{0}) tuple(%zero, %x, %v)
  %loop = (s32[]{:T(128)}, bf16[4,128]{1,0}, f32[8]{0}) while(%t), condition=%scan_cond, body=%scan_body
  ROOT %out = bf16[4,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_trip_counts_multiply_along_the_nesting_of_a_tpu_like_module():
    found = hlo.collectives(TPU_LIKE)
    permute = [c for c in found if c.kind == "collective-permute"]
    assert [(c.runs, c.shapes, c.bytes) for c in permute] == [(3 * 8, (("bf16", (4, 128)),), 4 * 128 * 2)]
    # one all-reduce instruction, counted by each of its two callers: 3 x (2 + 5)
    assert [(c.kind, c.runs) for c in found if c.kind == "all-reduce"] == [("all-reduce", 3 * (2 + 5))]
    summary = hlo.summarize(found)
    assert summary["collective-permute"] == {"instructions": 1, "runs": 24, "bytes": 24 * 1024}
    assert summary["all-reduce"] == {"instructions": 1, "runs": 21, "bytes": 21 * 32}


RAGGED = """HloModule ragged

ENTRY %main (x: bf16[4096,2048], o: bf16[4096,2048], a: s32[16], b: s32[16]) -> (bf16[4096,2048], bf16[4096,2048]) {
  %x = bf16[4096,2048]{1,0} parameter(0)
  %o = bf16[4096,2048]{1,0} parameter(1)
  %a = s32[16]{0} parameter(2)
  %b = s32[16]{0} parameter(3)
  %r = bf16[4096,2048]{1,0:T(8,128)(2,1)} ragged-all-to-all(%x, %o, %a, %b, %a, /*index=5*/%b), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}
  %s = bf16[4096,2048]{1,0:T(8,128)(2,1)} ragged-all-to-all(%x, %o, %a, %b, %a, /*index=5*/%b), channel_id=2, replica_groups=[4,4]<=[16]
  ROOT %t = (bf16[4096,2048]{1,0}, bf16[4096,2048]{1,0}) tuple(%r, %s)
}
"""


def test_a_ragged_all_to_all_counts_its_buffer_over_its_group():
    """A ragged all-to-all's result is a worst-case buffer: what it moves under balanced routing is the buffer
    over its group (16 and, in iota notation, 4 chips); other collectives keep their whole result."""
    found = hlo.collectives(RAGGED)
    buffer = 4096 * 2048 * 2
    assert sorted((c.kind, c.bytes) for c in found) == [
        ("ragged-all-to-all", buffer // 16),
        ("ragged-all-to-all", buffer // 4),
    ]
    assert hlo.summarize(found)["ragged-all-to-all"] == {"instructions": 2, "runs": 2, "bytes": buffer * 5 // 16}
