"""Trainer throughput with bucketed packing (dynamic batching) vs fixed-count micro-batches of padded
sequences, both through the real jitted train step, on one of two workloads.

`--workload lognormal` (default): long-tailed (lognormal) response lengths. Both sides run `Trainer.step`
(proximal log-prob pass + one PPO update with gradient accumulation over the micro-batches) on the same
batches of trajectories from the same initial weights:
  dynamic: the default planner, the least-padding bucket under a cap of `--rows` x `--row-length` tokens
           (rows `--rows` * 2^j, row lengths up to `--row-length`, sequences first-fit-decreasing);
  fixed:   `fixed_count_plan`, `--rows` consecutive sequences per micro-batch, one per row, each padded to the
           longest (rounded up to `--length-multiple`); the step's micro-batches are stacked for the scan, so
           they share the step's longest padded length.
The last line is `ratio dynamic_vs_fixed: X.XX` (loss tokens per second of step wall time).

`--workload issue`: issue 14's loop workload on its 2.9M-parameter Qwen2-shaped policy: 8 prompts x 8
samples of 6 prompt + 64 new tokens (64 sequences of 70 tokens), all on-policy (eta = 0). Side by side:
  before: the default `PackingConfig`'s old fixed shape (rows of token_budget / rows tokens, first-fit-
          decreasing, `rows` rows per micro-batch) with the recomputed proximal pass;
  buckets: the default planner with the recomputed proximal pass;
  after:  the default planner with `prox_logp_method: loglinear` (no proximal forward pass).
The last line is `ratio after_vs_before: X.XX` (step time before / after).

Every distinct batch shape is compiled in a warm-up step first; the timed steps (the sides alternating batch
by batch) then reuse the programs. Prints `name: value unit` lines.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from areal_jax.data.packing import PackingConfig, PackPlan, first_fit_decreasing, fixed_count_plan
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer.batching import Planner, build_batch
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.trainer import Trainer

MODEL = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
)

ISSUE_MODEL = ModelConfig(
    family="qwen2",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def lognormal_batches(
    steps: int, sequences: int, max_tokens: int, median_response: float, sigma: float, seed: int
) -> list[list[Trajectory]]:
    """Batches of random trajectories of at most `max_tokens` tokens: prompts of 16..48 tokens, lognormal
    responses, groups of 4 samples."""
    rng = np.random.default_rng(seed)
    batches = []
    for step in range(steps):
        batch = []
        for i in range(sequences):
            prompt = int(rng.integers(16, 49))
            response = int(np.clip(rng.lognormal(np.log(median_response), sigma), 4, max_tokens - prompt))
            length = prompt + response
            loss_mask = np.arange(length) >= prompt
            batch.append(
                Trajectory(
                    token_ids=rng.integers(0, MODEL.vocab_size, length).astype(np.int32),
                    behav_logprobs=np.where(loss_mask, -rng.uniform(3.0, 9.0, length), 0.0).astype(np.float32),
                    versions=np.where(loss_mask, 0, -1).astype(np.int32),
                    loss_mask=loss_mask,
                    prompt_length=prompt,
                    reward=float(rng.integers(0, 2)),
                    prompt_id=f"s{step}p{i // 4}",
                    group_id=i // 4,
                    sample_index=i % 4,
                )
            )
        batches.append(batch)
    return batches


def warmed_up_trainer(
    model: Decoder, config: TrainerConfig, planner: Planner | None, batches: Sequence[list[Trajectory]]
) -> tuple[Trainer, int]:
    """A trainer that has run one step on each distinct batch shape (so every program is compiled)."""
    trainer = Trainer(model, config, make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1)), planner=planner, temperature=1.0)
    seen = set()
    for batch in batches:
        shape = build_batch(batch, config, planner).minibatches[0].shape
        if shape not in seen:
            seen.add(shape)
            trainer.step(batch)
    return trainer, len(seen)


def report(name: str, shapes: int, stats_list: Sequence[dict[str, float]]) -> float:
    """Print one side's totals over its timed steps; return its throughput (loss tokens/s)."""
    total = {key: sum(stats[key] for stats in stats_list) for key in stats_list[0]}
    steps = len(stats_list)
    throughput = total["train/loss_tokens"] / total["train/step_time"]
    print(f"{name}_shapes_compiled: {shapes} shapes")
    print(f"{name}_microbatches: {total['batch/microbatches'] / steps:.1f} per step")
    print(f"{name}_pack_efficiency: {total['batch/tokens'] / total['batch/capacity']:.3f} real/slots")
    print(f"{name}_step_time: {total['train/step_time'] / steps:.3f} s")
    print(f"{name}_throughput: {throughput:.1f} loss tokens/s")
    return throughput


def issue_batches(steps: int, seed: int) -> list[list[Trajectory]]:
    """Issue 14's batches: 8 prompts x 8 samples, 6 prompt tokens + exactly 64 new ones, sampled on-policy."""
    rng = np.random.default_rng(seed)
    loss_mask = np.arange(70) >= 6
    return [
        [
            Trajectory(
                token_ids=rng.integers(0, ISSUE_MODEL.vocab_size, 70).astype(np.int32),
                behav_logprobs=np.where(loss_mask, -rng.uniform(1.0, 5.0, 70), 0.0).astype(np.float32),
                versions=np.where(loss_mask, 0, -1).astype(np.int32),
                loss_mask=loss_mask,
                prompt_length=6,
                reward=float(rng.integers(0, 2)),
                prompt_id=f"s{step}p{i // 8}",
                group_id=i // 8,
                sample_index=i % 8,
            )
            for i in range(64)
        ]
        for step in range(steps)
    ]


def fixed_shape_plan(lengths: np.ndarray, config: PackingConfig) -> PackPlan:
    """The packing before buckets: first-fit-decreasing into rows of token_budget / rows, `rows` per micro-batch."""
    lengths_N = np.asarray(lengths, np.int64)
    placement = first_fit_decreasing(lengths_N, config.row_length)
    return PackPlan(
        lengths_N=lengths_N,
        microbatch_N=placement.row_N // config.rows,
        row_N=placement.row_N % config.rows,
        offset_N=placement.offset_N,
        segment_N=placement.segment_N,
        shapes=((config.rows, config.row_length),) * -(-placement.num_rows // config.rows),
    )


def run_issue_workload(steps: int) -> None:
    batches = issue_batches(steps, seed=0)
    model = Decoder(ISSUE_MODEL, nnx.Rngs(0))
    base = TrainerConfig(optimizer=OptimizerConfig(lr=1e-5))
    loglinear = base.replace(ppo=base.ppo.replace(prox_logp_method="loglinear"))
    sides = {
        "before": warmed_up_trainer(model, base, functools.partial(fixed_shape_plan, config=base.packing), batches),
        "buckets": warmed_up_trainer(model, base, None, batches),
        "after": warmed_up_trainer(model, loglinear, None, batches),
    }
    stats = {name: [] for name in sides}
    for batch in batches:  # interleaved, so load changes on a shared machine hit every side alike
        for name, (trainer, _) in sides.items():
            stats[name].append(trainer.step(batch))
    print(f"parameters: {ISSUE_MODEL.num_params() / 1e6:.2f} M")
    print("sequences_per_step: 64 sequences of 70 tokens")
    times = {}
    for name, (_, shapes) in sides.items():
        report(name, shapes, stats[name])
        times[name] = float(np.median([step["train/step_time"] for step in stats[name]]))
        print(f"{name}_step_time_median: {times[name]:.3f} s")
    print(f"ratio after_vs_before: {times['before'] / times['after']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="lognormal: 3 timed steps of 32 sequences; issue: 1 step")
    parser.add_argument("--workload", choices=("lognormal", "issue"), default="lognormal", help="see above")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--sequences", type=int, default=64, help="lognormal: trajectories per step")
    parser.add_argument("--rows", type=int, default=4, help="lognormal: rows per micro-batch (both sides)")
    parser.add_argument("--row-length", type=int, default=512, help="lognormal: longest row = longest sequence")
    parser.add_argument("--length-multiple", type=int, default=128, help="fixed side: padded lengths round up to this")
    parser.add_argument("--median-response", type=float, default=96.0, help="lognormal: median response length")
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of response lengths")
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}, {jax.device_count()} devices)")
    if args.workload == "issue":
        run_issue_workload(1 if args.quick else args.steps)
        return
    steps, sequences = (3, 32) if args.quick else (args.steps, args.sequences)

    batches = lognormal_batches(steps, sequences, args.row_length + 1, args.median_response, args.sigma, seed=0)
    lengths = np.concatenate([[t.length - 1 for t in batch] for batch in batches])
    responses = np.concatenate([[t.num_loss_tokens for t in batch] for batch in batches])
    config = TrainerConfig(
        optimizer=OptimizerConfig(lr=1e-5),
        packing=PackingConfig(token_budget=args.rows * args.row_length, rows=args.rows),
    )
    fixed = functools.partial(fixed_count_plan, seqs_per_microbatch=args.rows, length_multiple=args.length_multiple)
    unstacked = [fixed(np.asarray([t.length - 1 for t in batch])) for batch in batches]

    print(f"parameters: {MODEL.num_params() / 1e6:.2f} M")
    print(f"sequences_per_step: {sequences} sequences")
    print(f"response_length_median: {np.median(responses):.0f} tokens")
    print(f"response_length_p99: {np.percentile(responses, 99):.0f} tokens")
    print(f"sequence_length_max: {lengths.max()} tokens")
    print(
        "fixed_own_length_pack_efficiency: "
        f"{lengths.sum() / sum(plan.capacity for plan in unstacked):.3f} real/slots "
        "(if each fixed micro-batch kept its own padded length)"
    )

    model = Decoder(MODEL, nnx.Rngs(0))
    dynamic, dynamic_shapes = warmed_up_trainer(model, config, None, batches)
    fixed_count, fixed_shapes = warmed_up_trainer(model, config, fixed, batches)
    dynamic_stats, fixed_stats = [], []
    for batch in batches:  # interleaved, so load changes on a shared machine hit both sides alike
        dynamic_stats.append(dynamic.step(batch))
        fixed_stats.append(fixed_count.step(batch))
    ratio = report("dynamic", dynamic_shapes, dynamic_stats) / report("fixed", fixed_shapes, fixed_stats)
    print(f"ratio dynamic_vs_fixed: {ratio:.2f}")


if __name__ == "__main__":
    main()
