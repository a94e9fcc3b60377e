"""The trainer's mixture-of-experts terms of one micro-batch: the routers' load-balancing loss (HF's
`load_balancing_loss_func`, weighted by `model.moe.router_aux_loss_coef`) and how the trainer's routing compares
with the rollout's (routing replay, docs/moe.md).

Statistics (`objectives/stats.py`'s key rule), over the micro-batch's loss positions (each position's input
token, whose experts shape the trained log-prob):
  moe/routing_differs/layer{i}  share of tokens the trainer computed through other experts than the rollout
                                recorded, in the i-th sparse layer (0 with `trainer.moe.routing_replay: rollout`)
  moe/router_differs/layer{i}   share whose trainer top-k differs from the recorded experts (what replay overrides;
                                equal to the above without replay)
  moe/routing_differs/mean, moe/router_differs/mean   the same over all sparse layers
  moe/aux_loss                  the load-balancing loss before its coefficient (a loss part: summed over micro-batches)
Legend: B rows, L row length, Ym sparse layers, K experts per token, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.models.moe import RouterOutput, load_balancing_loss


def _differs(a_YmxBxLxK: jax.Array, b_YmxBxLxK: jax.Array) -> jax.Array:
    """[Ym, B, L] bool: the two expert sets differ (order within the top-k does not matter)."""
    return jnp.any(jnp.sort(a_YmxBxLxK, axis=-1) != jnp.sort(b_YmxBxLxK, axis=-1), axis=-1)


def moe_terms(
    router: RouterOutput,
    recorded_BxLxYmxK: jax.Array | None,
    loss_mask_BxL: jax.Array,
    segment_ids_BxL: jax.Array,
    loss_share: jax.Array,
    aux_loss_coef: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the loss term coef * aux * `loss_share`, statistics). `router` fields are [Ym, B, L, ...]; `loss_share` is
    this micro-batch's share of its update's loss tokens, so the micro-batches' terms sum to the update's. The aux
    loss counts the experts each token was computed with, over every real (non-padding) token of every sparse
    layer, as HF concatenates the layers' router logits."""
    real_YmxBxL = jnp.broadcast_to(segment_ids_BxL > 0, router.used.shape[:-1])
    aux = load_balancing_loss(router.logits, router.used, real_YmxBxL)
    stats = {"moe/aux_loss": aux * loss_share}
    if recorded_BxLxYmxK is not None:
        recorded_YmxBxLxK = jnp.moveaxis(recorded_BxLxYmxK.astype(jnp.int32), 2, 0)
        mask_BxL = loss_mask_BxL.astype(jnp.float32)
        tokens = jnp.sum(mask_BxL)
        for name, experts in (("routing_differs", router.used), ("router_differs", router.experts)):
            differs_Ym = jnp.einsum("ybl,bl->y", _differs(experts, recorded_YmxBxLxK).astype(jnp.float32), mask_BxL)
            share_Ym = differs_Ym / jnp.maximum(tokens, 1.0)
            stats |= {f"moe/{name}/layer{i}": share_Ym[i] for i in range(share_Ym.shape[0])}
            stats |= {f"moe/{name}/mean": jnp.mean(share_Ym), f"moe/{name}/n_tokens": tokens}
    return aux_loss_coef * aux * loss_share, stats
