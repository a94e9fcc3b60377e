"""The paper's staleness ablation in miniature: the running-sums job (`configs/chain_sums_cpu.yaml`, with a
warm start) at max_head_offpolicyness eta in {0, 1, 2, 4, 8} with plain PPO (`trainer.ppo.decoupled=false`:
the ratio against the behaviour policy) and decoupled PPO (`trainer.ppo.decoupled=true`: clipped against
the proximal policy, weighted by pi_prox / pi_behav), and decoupled PPO with two of the rollout corrections
of `trainer.ppo.rollout_correction` (docs/objectives.md): sequence-level masked IS (MIS: a sequence whose
weight prod_t pi_prox / pi_behav is outside [1/2, 2] leaves the loss) and geometric-mean rejection (geo-RS: a
sequence whose mean per-token log weight is outside log [1/1.01, 1.01] leaves it; `-strict`: 1.001, verl's
suggestion for long answers).

Every run has the same seed, the same warm start (trained once, then copied into each run directory, whose
cache it is) and the same number of trained samples (`--steps` x the config's batch: 32 prompts x 8
samples). Per run: the final held-out pass@1 (sampled, as that job evaluates it), the mean staleness of
the trained samples, and the effective training throughput (trained samples per second of wall time
between the first and the last step, so compilation is left out). The runs go one after another in this process.

Prints a markdown table and `name: value unit` lines, writes a PNG (`--plot`, default
docs/img/staleness_ablation.png; `--quick`: a temporary file), and last `ratio
decoupled_vs_plain_accuracy_at_max_eta: X.XX`. `--quick`: eta in {0, 2}, 10 steps, a short warm start.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from areal_jax.compilation_cache import enable_compilation_cache
from areal_jax.config import load_experiment
from areal_jax.jobs.sft import run_warm_start
from areal_jax.jobs.train import run_async
from areal_jax.jsonl import read_jsonl
from areal_jax.reporting.metric_keys import is_evaluation
from areal_jax.sft_config import WARM_START_DIR
from areal_jax.system.assembly import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "chain_sums_cpu.yaml"
PLOT = ROOT / "docs" / "img" / "staleness_ablation.png"


_CORRECTION = "trainer.ppo.rollout_correction"
# objective name -> its overrides; the table's rows in this order at every eta
OBJECTIVES: dict[str, list[str]] = {
    "plain": ["trainer.ppo.decoupled=false"],
    "decoupled": ["trainer.ppo.decoupled=true"],
    "decoupled+seq-MIS": [
        "trainer.ppo.decoupled=true",
        f"{_CORRECTION}.is_level=sequence",
        f"{_CORRECTION}.is_mode=mask",
        f"{_CORRECTION}.is_high=2.0",
    ],
    "decoupled+geo-RS": [
        "trainer.ppo.decoupled=true",
        f"{_CORRECTION}.rs_level=geometric",
        f"{_CORRECTION}.rs_high=1.01",
    ],
    # verl's suggested bound, set for responses of thousands of tokens; these answers have 2-11
    "decoupled+geo-RS-strict": [
        "trainer.ppo.decoupled=true",
        f"{_CORRECTION}.rs_level=geometric",
        f"{_CORRECTION}.rs_high=1.001",
    ],
}


def run_one(base: list[str], output_dir: Path, warm_start: Path, eta: int, objective: str) -> dict[str, float]:
    cfg = load_experiment(
        CONFIG,
        [
            *base,
            f"output_dir={output_dir}",
            f"name=eta{eta}-{objective.replace('+', '-')}",
            f"rollout.staleness.max_head_offpolicyness={eta}",
            *OBJECTIVES[objective],
        ],
    )
    cfg.run_dir.mkdir(parents=True)
    shutil.copytree(warm_start, cfg.run_dir / WARM_START_DIR)  # the same settings: the run reuses it
    summary = run_async(cfg)
    lines = read_jsonl(summary.metrics_file)
    evaluations = {m["train/version"]: m["eval/pass@1"] for m in lines if is_evaluation(m)}
    metrics = [m for m in lines if not is_evaluation(m)]
    samples = sum(m["batch/sequences"] for m in metrics[1:])
    seconds = metrics[-1]["time/wall"] - metrics[0]["time/wall"]
    return {
        "eta": eta,
        "objective": objective,
        "accuracy_before": evaluations[0],
        "accuracy": evaluations[max(evaluations)],
        "staleness_mean": statistics.mean(m["rollout/staleness_mean"] for m in metrics),
        "staleness_max": max(m["rollout/staleness_max"] for m in metrics),
        "interruptions": summary.interruptions,
        "samples_per_s": samples / seconds if seconds > 0 else float("nan"),
        "iw_mean_stale": _stale_weight(metrics),
        "masked_frac": _mean_of(metrics, "correction/masked_frac"),
        "seq_rejected_frac": _mean_of(metrics, "correction/seq/rejected_frac"),
    }


def _mean_of(metrics: list[dict[str, float]], key: str) -> float:
    """The mean of a per-step statistic over the steps that log it (NaN when none does: no correction)."""
    values = [m[key] for m in metrics if key in m]
    return statistics.mean(values) if values else float("nan")


def _stale_weight(metrics: list[dict[str, float]]) -> float:
    """The mean behaviour weight (pi_prox / pi_behav; plain PPO: the ratio pi / pi_behav) of the tokens
    sampled 1 or more versions back, averaged over the steps that have them."""
    values = [
        m[f"staleness/{k}/iw_mean"]
        for m in metrics
        for k in ("1", "2", "3", ">=4")
        if m.get(f"staleness/{k}/n_tokens", 0) > 0 and f"staleness/{k}/iw_mean" in m
    ]
    return statistics.mean(values) if values else float("nan")


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| eta | objective | held-out pass@1 | mean staleness | max staleness | interruptions | trained samples/s "
        "| tokens masked | sequences rejected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['eta']} | {r['objective']} PPO | {r['accuracy']:.3f} | {r['staleness_mean']:.2f} | "
            f"{r['staleness_max']:.0f} | {r['interruptions']} | {r['samples_per_s']:.0f} | "
            f"{_fraction(r['masked_frac'])} | {_fraction(r['seq_rejected_frac'])} |"
        )
    return "\n".join(lines)


def _fraction(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"  # NaN: the objective logs no correction


def plot(rows: list[dict[str, float]], path: Path, start: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    accuracy_ax, throughput_ax = fig.subplots(1, 2)
    for objective, style in zip(OBJECTIVES, ("s--", "o-", "^-.", "v:", "d:"), strict=True):
        part = [r for r in rows if r["objective"] == objective]
        if not part:
            continue
        label = f"{objective} PPO"
        accuracy_ax.plot([r["eta"] for r in part], [r["accuracy"] for r in part], style, label=label)
        throughput_ax.plot([r["eta"] for r in part], [r["samples_per_s"] for r in part], style, label=label)
    accuracy_ax.axhline(start, color="gray", linestyle=":", label="starting policy (warm start)")
    accuracy_ax.set_ylabel("final held-out pass@1")
    throughput_ax.set_ylabel("trained samples / s")
    for ax in (accuracy_ax, throughput_ax):
        ax.set_xlabel("max staleness eta")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("staleness ablation (running sums, same seed and samples)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="eta in {0, 2}, 10 steps, a short warm start")
    parser.add_argument("--steps", type=int, default=150, help="trainer steps of each run")
    parser.add_argument(
        "--objectives",
        default=None,
        help=f"comma-separated, among {', '.join(OBJECTIVES)} (default: all; --quick: plain,decoupled)",
    )
    parser.add_argument(
        "--etas", default=None, help="comma-separated staleness bounds (default 0,1,2,4,8; --quick: 0,2)"
    )
    parser.add_argument("--plot", type=Path, default=None, help=f"the PNG (default {PLOT.relative_to(ROOT)})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    objectives = (args.objectives or ("plain,decoupled" if args.quick else ",".join(OBJECTIVES))).split(",")
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        parser.error(f"--objectives: unknown {unknown}; choose among {list(OBJECTIVES)}")
    default_etas = "0,2" if args.quick else "0,1,2,4,8"
    etas = tuple(int(e) for e in (args.etas or default_etas).split(","))
    steps = 10 if args.quick else args.steps
    output_dir = Path(tempfile.mkdtemp(prefix="staleness-ablation-"))
    base = [
        f"train_steps={steps}",
        f"eval.every_steps={steps}",
        "report.live=never",
        "report.plots=false",
        f"train_checkpoint.every_steps={steps}",
        "compilation_cache_dir=" + str(ROOT / "runs" / "xla_cache"),
    ]
    if args.quick:
        base += ["warm_start.steps=60", "dataset.heldout=64", "dataset.chain_sums.problems=2000"]
    warm_cfg = load_experiment(CONFIG, [*base, f"output_dir={output_dir}", "name=warm-start"])
    enable_compilation_cache(warm_cfg.compilation_cache_dir)
    started = time.perf_counter()
    run_warm_start(warm_cfg, build_tokenizer(warm_cfg))
    warm_start = warm_cfg.run_dir / WARM_START_DIR
    rows = []
    for eta in etas:
        for objective in objectives:
            rows.append(run_one(base, output_dir, warm_start, eta, objective))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    path = args.plot or (output_dir / "staleness_ablation.png" if args.quick else PLOT)
    plot(rows, path, rows[0]["accuracy_before"])
    print(f"plot: {path}")
    for r in rows:
        tag = f"eta{r['eta']}_{r['objective'].replace('+', '_').replace('-', '_')}"
        print(f"accuracy_{tag}: {r['accuracy']:.3f}")
        print(f"staleness_mean_{tag}: {r['staleness_mean']:.2f} versions")
        print(f"throughput_{tag}: {r['samples_per_s']:.1f} samples/s")
    print(f"wall_seconds: {time.perf_counter() - started:.1f} s")
    top = max(etas)
    at_top = {r["objective"]: r["accuracy"] for r in rows if r["eta"] == top}
    if "plain" in at_top and "decoupled" in at_top:
        print(f"ratio decoupled_vs_plain_accuracy_at_max_eta: {at_top['decoupled'] / max(at_top['plain'], 0.005):.2f}")


if __name__ == "__main__":
    main()
