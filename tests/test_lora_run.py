"""A LoRA run of the one-minute job (configs/train_cpu.yaml, adapters of rank 16 on every projection over the
frozen random base), shortened: it trains and publishes adapter versions through the whole system, the adapters
move and the base does not, and the final export is a PEFT adapter over the exported base, which loads back.
What such a run learns is `benchmarks/learning.py`'s to measure."""

import json

import numpy as np
from flax import nnx

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.jsonl import read_jsonl
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.models.lora import LoRA
from areal_jax.models.peft_io import ADAPTER_CONFIG, load_peft_adapter
from tests.test_async_rl import FAST

LORA = [
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.lora.targets=[q,k,v,o,gate,up,down]",
    "trainer.optimizer.lr=3e-3",
]


def test_a_lora_run_trains_adapters_over_the_frozen_base_and_exports_peft(tmp_path):
    cfg = load_experiment("configs/train_cpu.yaml", [*FAST, *LORA, f"output_dir={tmp_path}"])
    summary = run_async(cfg)
    assert summary.version == cfg.train_steps
    metrics = read_jsonl(summary.metrics_file)
    assert [m["train/version"] for m in metrics] == list(range(1, cfg.train_steps + 1))
    assert all(np.isfinite(m["train/loss"]) for m in metrics)
    assert any(m["train/grad_norm"] > 0 for m in metrics)  # a step whose groups all tie has no gradient

    config = json.loads((cfg.layout.hf_final / ADAPTER_CONFIG).read_text())
    assert summary.final_hf_checkpoint == str(cfg.layout.hf_final) and config["r"] == 16
    _, base = load_hf_checkpoint(config["base_model_name_or_path"])
    model = load_peft_adapter(summary.final_hf_checkpoint, base)
    assert model.config.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")
    b_matrices = [np.asarray(lora.b[...]) for _, lora in nnx.iter_graph(model) if isinstance(lora, LoRA)]
    assert len(b_matrices) == 7  # one adapter per target, its layers stacked on the leading axis
    for b in b_matrices:  # each B starts at zero: the updates moved it, in every layer
        assert b.shape[0] == cfg.model.num_layers and (np.abs(b.reshape(b.shape[0], -1)).max(axis=1) > 0).all()
