"""The overrides that make a whole-system run of each CPU config short, written once: a small engine (8 slots,
prefill batches of 2: fewer programs to compile) and small packed micro-batches of one shape (rows x length),
so the suite's runs share their compiled programs through the session's compilation cache. Each new train
shape costs a cold compile once per session (~10-40 s on the 2-core machine) and its tracing and lowering
once per process, cache hit or not (~3-8 s). A test adds only what its own check needs (steps, batch size,
staleness bound, checkpoints, evaluation)."""

SHORT_TRAIN_CPU = [  # configs/train_cpu.yaml, the one-minute job
    "rollout.engine.max_slots=8",
    "rollout.engine.max_prefill_batch=2",
    "trainer.packing.token_budget=256",
    "trainer.packing.rows=4",
    "trainer.packing.min_row_length=64",  # every micro-batch 4 x 64: one train shape
    "trainer.packing.min_rows=4",
    "report.plots=false",
]

SHORT_CHAIN_SUMS = [  # configs/chain_sums_cpu.yaml, the README's main job: its warm start too
    "warm_start.steps=4",
    "warm_start.heldout_examples=8",
    "dataset.heldout=8",
    "rollout.staleness.batch_prompts=2",
    "rollout.workflow.n_samples=2",
    "rollout.engine.max_slots=8",
    "rollout.engine.max_prefill_batch=2",
    "rollout.staleness.max_concurrent=8",
    "trainer.packing.token_budget=512",
    "trainer.packing.rows=4",
    "trainer.packing.min_row_length=128",  # every micro-batch 4 x 128: one train shape
    "trainer.packing.min_rows=4",
]

NO_EVAL = ["dataset.heldout=0", "eval.every_steps=0"]  # every prompt trains; no held-out evaluation
