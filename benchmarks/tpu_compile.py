"""`areal-jax compile` on this CPU machine: a run's trainer and engine programs compiled for a Cloud TPU slice
(libtpu, no TPU), with the compile times and the compiler's per-chip memory beside the memory plan.

Default: the Qwen2.5-0.5B GSM8K GPU recipe's run at the model's full shape (its config.json from
`benchmarks/scale.py`) on `--topology` (v5p-8), 2 + 2 chips (its 3:1 shares give the rollout 3 of 4 chips, which
`areal-jax compile` refuses: XLA:TPU's all-reduce groups must divide the slice). `--quick`: 2 layers of width 128
and a 512-token vocabulary on v5e-8, in under a minute. `--recipe NAME`: one of the `_tpu` recipes (`RECIPES`, each
on its slice) at full depth, or at `--layers N` (the same widths, fewer layers); it adds the recipe's step: per-chip
memory, the roofline step time and tokens/s bound, the MFU bound and the collective bytes (docs/tpu.md's recipe
table). Prints `name: value unit` lines; the last is `ratio plan_agreement: X.XX`, the worst over both sides' lines
(resident state, largest program, total) of min(plan / compiler, compiler / plan) per chip.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from scale import SHAPES

import areal_jax  # noqa: F401  (its import leaves the absent TPU backend out: areal_jax/jax_platforms.py)

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 2**20, 2**30
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
EVEN_SHARES = ["rollout.inference_share=1", "rollout.trainer_share=1"]
# the `_tpu` recipes and the slice each is sized for (tests/test_tpu_recipes.py holds the same table)
RECIPES = {
    "r1_distill_qwen_1p5b_deepscaler_tpu": "v5p-8",
    "r1_distill_qwen_1p5b_deepscaler_tpu_v6e": "v6e-8",
    "qwen25_05b_gsm8k_tpu": "v5e-8",
    "deepcoder_code_tpu": "v5p-16",
    "deepcoder_14b_code_tpu": "v5p-64",
    "qwen3_30b_a3b_deepscaler_tpu": "v5p-64",
    "qwen3_5_35b_a3b_deepscaler_tpu": "v5p-128",
    "qwen3_5_27b_deepscaler_tpu": "v5p-128",
}


def shallow_checkpoint(config: str, layers: int, directory: Path) -> Path:
    """A directory with the recipe's checkpoint config.json (configs/sizing's copy) at `layers` layers: the first
    `layers` of a hybrid's `layer_types` (keep the pattern whole: Qwen3.5's full-attention layer is every 4th), in
    a multimodal checkpoint's `text_config` where it has one."""
    from areal_jax.config import load_experiment
    from areal_jax.planning.architecture import config_json

    source = config_json(load_experiment(config, []))
    assert source is not None and source.is_file(), source
    hf = json.loads(source.read_text())
    text = hf.get("text_config", hf)
    text["num_hidden_layers"] = layers
    if "max_window_layers" in text:
        text["max_window_layers"] = min(text["max_window_layers"], layers)
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def recipe_step(cfg: Any, report: Any) -> dict[str, float]:
    """A training step and a decode step by the compiled programs' rooflines: a step is `ppo_minibatches`
    mini-batches, each a proximal pass, the gradient program and the AdamW apply at the largest bucket (every
    sample as long as the run allows). MFU bound: the model's FLOPs of the trained tokens (forward and backward,
    3x the forward; not remat's recompute, not the proximal pass) over the chips' peak for the step's roofline."""
    from areal_jax.planning.architecture import architecture

    trainer, engine = report.trainer, report.inference
    minibatches = cfg.trainer.ppo_minibatches
    roofs = [trainer.roofline(p) for p in trainer.programs]
    gradient = next(p for p in trainer.programs if p.name.startswith("gradient"))
    step_s = minibatches * sum(r["roofline_s"] for r in roofs)
    tokens = minibatches * gradient.tokens
    backward_passes = 3 + (1 if architecture(cfg).remat != "none" else 0)  # as `trainer_programs` counts
    model_flops = minibatches * gradient.flops * 3 / backward_passes  # the gradient's FLOPs without the recompute
    decode = next(p for p in reversed(engine.programs) if p.name.startswith("decode"))
    decode_roof = engine.roofline(decode)
    return {
        "trainer_step_roofline": step_s,
        "trainer_tokens_per_s_per_chip": tokens / trainer.chips / step_s,
        "trainer_mfu_bound": model_flops / (trainer.chips * trainer.chip.bf16_flops * step_s),
        "trainer_collective_bytes_per_step": minibatches * sum(r["collective_bytes_per_chip"] for r in roofs),
        "decode_step_roofline": decode_roof["roofline_s"],
        "decode_tokens_per_s_per_chip": decode_roof["tokens_per_s_per_chip"],
        "decode_mfu_bound": decode.flops / (engine.chips * engine.chip.bf16_flops * decode_roof["roofline_s"]),
        "decode_collective_bytes": decode_roof["collective_bytes_per_chip"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model of width 128 on v5e-8")
    parser.add_argument("--topology", default=None, help="default: v5e-8 with --quick, the recipe's, else v5p-8")
    parser.add_argument("--config", default=str(ROOT / "configs/recipes/qwen25_05b_gsm8k_gpu.yaml"))
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="a `_tpu` recipe on its slice")
    parser.add_argument("--layers", type=int, default=None, help="with --recipe: this many layers, same widths")
    args = parser.parse_args()
    from areal_jax.compile.agreement import agreements
    from areal_jax.compile.report import compile_for_slice
    from areal_jax.config import load_experiment

    with tempfile.TemporaryDirectory() as checkpoint:
        if args.quick:
            config, overrides, topology = str(ROOT / "configs/train_cpu.yaml"), QUICK, args.topology or "v5e-8"
        elif args.recipe:
            config, topology = str(ROOT / f"configs/recipes/{args.recipe}.yaml"), args.topology or RECIPES[args.recipe]
            overrides = []
            if args.layers is not None:
                overrides = [f"hf_checkpoint={shallow_checkpoint(config, args.layers, Path(checkpoint))}"]
        else:
            (Path(checkpoint) / "config.json").write_text(json.dumps(SHAPES["qwen25-0.5b"]))
            config, overrides = args.config, [f"hf_checkpoint={checkpoint}", "tokenizer=null", *EVEN_SHARES]
            topology = args.topology or "v5p-8"
        cfg = load_experiment(config, overrides)
        started = time.perf_counter()
        report = compile_for_slice(cfg, topology)
        seconds = time.perf_counter() - started
        step = recipe_step(cfg, report) if args.recipe else {}  # reads the (shallow) checkpoint's config.json
    if args.recipe:  # what `areal-jax compile RECIPE --topology SLICE` prints
        print("\n".join(report.lines()))
    print(f"topology: {report.tpu_slice.name} ({report.tpu_slice.topology_name})")
    worst = 1.0
    for side in report.sides:
        for program in side.programs:
            name = program.name.split(" (")[0].replace(" ", "_")
            print(f"{side.side}_{name}_compile: {program.seconds:.1f} s")
            print(f"{side.side}_{name}_temporaries: {program.temporaries / MIB:.2f} MiB")
        print(f"{side.side}_per_chip_compiler: {side.peak / MIB:.2f} MiB")
        print(f"{side.side}_per_chip_plan: {side.plan_total / MIB:.2f} MiB")
        print(f"{side.side}_fits: {int(report.fits(side))} bool")
        for agreement in agreements(side):
            line = agreement.line.split(" (")[0].replace(" ", "_")
            print(f"{side.side}_{line}_agreement: {agreement.ratio:.2f} ratio")
            worst = min(worst, agreement.ratio)
    if args.recipe:
        # "bytes" first: "collective_bytes_per_step" also holds "per_s"
        units = {"bytes": "GB", "roofline": "s", "per_s": "tokens/s", "mfu": "ratio"}
        for key, value in step.items():
            unit = next(u for part, u in units.items() if part in key)
            print(f"{key}: {value / 1e9 if unit == 'GB' else value:.4g} {unit}")
    print(f"compile_total: {seconds:.1f} s")
    print(f"ratio plan_agreement: {worst:.2f}")


if __name__ == "__main__":
    main()
