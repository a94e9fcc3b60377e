"""`areal-jax compile` on this CPU machine: a run's trainer and engine programs compiled for a Cloud TPU slice
(libtpu, no TPU), with the compile times and the compiler's per-chip memory beside the memory plan.

Default: the Qwen2.5-0.5B GSM8K GPU recipe's run at the model's full shape (its config.json from
`benchmarks/scale.py`) on `--topology` (v5p-8). `--quick`: 2 layers of width 128 and a 512-token vocabulary on
v5e-8, in under a minute. Prints `name: value unit` lines; the last is `ratio plan_agreement: X.XX`, the worst over
both sides' lines (resident state, largest program, total) of min(plan / compiler, compiler / plan) per chip.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from scale import SHAPES

import areal_jax  # noqa: F401  (its import leaves the absent TPU backend out: areal_jax/jax_platforms.py)

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
QUICK = [
    "model.hidden_size=128",
    "model.intermediate_size=320",
    "model.num_layers=2",
    "model.vocab_size=512",
    "model.max_position_embeddings=128",
    "model.remat=full",
    "model.scan_layers=true",
    "trainer.packing.rows=8",
    "trainer.packing.token_budget=384",
    "rollout.staleness.batch_prompts=1",
    "rollout.inference_share=1",
    "rollout.trainer_share=1",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model of width 128 on v5e-8")
    parser.add_argument("--topology", default=None, help="default: v5e-8 with --quick, else v5p-8")
    parser.add_argument("--config", default=str(ROOT / "configs/recipes/qwen25_05b_gsm8k_gpu.yaml"))
    args = parser.parse_args()
    from areal_jax.compile.agreement import agreements
    from areal_jax.compile.report import compile_for_slice
    from areal_jax.config import load_experiment

    with tempfile.TemporaryDirectory() as checkpoint:
        if args.quick:
            config, overrides, topology = str(ROOT / "configs/train_cpu.yaml"), QUICK, args.topology or "v5e-8"
        else:
            (Path(checkpoint) / "config.json").write_text(json.dumps(SHAPES["qwen25-0.5b"]))
            config, overrides = args.config, [f"hf_checkpoint={checkpoint}", "tokenizer=null"]
            topology = args.topology or "v5p-8"
        cfg = load_experiment(config, overrides)
        started = time.perf_counter()
        report = compile_for_slice(cfg, topology)
        seconds = time.perf_counter() - started
    print(f"topology: {report.tpu_slice.name} ({report.tpu_slice.topology_name})")
    worst = 1.0
    for side in report.sides:
        for program in side.programs:
            name = program.name.split(" (")[0].replace(" ", "_")
            print(f"{side.side}_{name}_compile: {program.seconds:.1f} s")
            print(f"{side.side}_{name}_temporaries: {program.temporaries / MIB:.2f} MiB")
        print(f"{side.side}_per_chip_compiler: {side.peak / MIB:.2f} MiB")
        print(f"{side.side}_per_chip_plan: {side.plan_total / MIB:.2f} MiB")
        for agreement in agreements(side):
            line = agreement.line.split(" (")[0].replace(" ", "_")
            print(f"{side.side}_{line}_agreement: {agreement.ratio:.2f} ratio")
            worst = min(worst, agreement.ratio)
    print(f"compile_total: {seconds:.1f} s")
    print(f"ratio plan_agreement: {worst:.2f}")


if __name__ == "__main__":
    main()
