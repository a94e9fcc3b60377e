"""The experiment config: every section of a run in one typed tree, loaded from YAML plus overrides."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from areal_jax import storage
from areal_jax.configuration import Config, ConfigError, load, option
from areal_jax.data.packing import PackingConfig
from areal_jax.data.pipeline import PipelineConfig
from areal_jax.data.tasks import TaskDataConfig
from areal_jax.eval_config import EvalConfig
from areal_jax.models.config import ModelConfig
from areal_jax.profiling import ProfileConfig
from areal_jax.rollout.config import RolloutConfig
from areal_jax.rollout.rewards import RewardConfig
from areal_jax.run_layout import RunLayout
from areal_jax.sft_config import WarmStartConfig
from areal_jax.sharding import MeshConfig
from areal_jax.system_config import ClusterConfig, DistributedConfig, ReportConfig
from areal_jax.trainer.checkpoint import CheckpointConfig
from areal_jax.trainer.config import TrainerConfig


@dataclasses.dataclass(frozen=True)
class GenerationConfig(Config):
    """Sampling settings of a generation run."""

    max_new_tokens: int = option(32, ge=1, doc="tokens generated per prompt at most")
    temperature: float = option(1.0, ge=0, doc="softmax temperature; 0 = greedy")
    num_prompts: int = option(8, ge=1, doc="prompts drawn from the task")
    samples_per_prompt: int = option(2, ge=1, doc="completions per prompt")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Config):
    """A whole run: where the model comes from, how devices are arranged, what to do."""

    name: str = option("demo", doc="run name; outputs go to <output_dir>/<name>")
    output_dir: str = option("runs", doc="root directory of run outputs: a local path or gs://bucket/path")
    local_copy_dir: str = option(
        "~/.cache/areal-jax/runs",
        doc="where a run whose output_dir is gs:// keeps the local copy of its records (metrics, logs, "
        "TensorBoard, plots, evaluations), uploaded as they change",
    )
    local_copy_upload_s: float = option(
        30.0,
        gt=0,
        doc="a gs:// run uploads its changed records this often (and before each checkpoint, and at the end)",
    )
    seed: int = option(0, ge=0, doc="seed of parameter init, data order and sampling")
    tokenizer: str | None = option(
        None, doc="'char' (synthetic tasks) or a directory with tokenizer.json; null = hf_checkpoint's, else 'char'"
    )
    hf_checkpoint: str | None = option(None, doc="HF checkpoint directory to start from; null = random init")
    model: ModelConfig = option(default_factory=ModelConfig, doc="decoder architecture")
    mesh: MeshConfig = option(default_factory=MeshConfig, doc="device mesh (the demo's, and each side's shape)")
    generation: GenerationConfig = option(default_factory=GenerationConfig, doc="sampling of `demo`")
    train_steps: int = option(20, ge=1, doc="trainer steps of `train` (fewer when dataset.epochs run out first)")
    dataset: TaskDataConfig = option(default_factory=TaskDataConfig, doc="the prompts and their order")
    reward: RewardConfig = option(default_factory=RewardConfig, doc="how a completion is scored")
    warm_start: WarmStartConfig = option(
        default_factory=WarmStartConfig,
        doc="a supervised fit of the random init to the task's answers before RL, cached in <run>/warm_start",
    )
    trainer: TrainerConfig = option(default_factory=TrainerConfig, doc="the PPO trainer")
    rollout: RolloutConfig = option(default_factory=RolloutConfig, doc="the rollout side")
    pipeline: PipelineConfig = option(
        default_factory=PipelineConfig, doc="rollout log -> trainer batches (staleness filter, grouping, prefetch)"
    )
    train_checkpoint: CheckpointConfig = option(default_factory=CheckpointConfig, doc="training checkpoints")
    report: ReportConfig = option(
        default_factory=ReportConfig, doc="what a run shows and writes: live display, TensorBoard, plots, W&B"
    )
    profile: ProfileConfig = option(default_factory=ProfileConfig, doc="an XProf trace over some trainer steps")
    eval: EvalConfig = option(default_factory=EvalConfig, doc="`areal-jax eval`, and held-out evals during `train`")
    cluster: ClusterConfig = option(
        default_factory=ClusterConfig, doc="rollout servers and trainer as separate processes (launch/rollout/trainer)"
    )
    distributed: DistributedConfig = option(
        default_factory=DistributedConfig,
        doc="jax.distributed for a role (trainer, rollout server) over several processes or hosts",
    )
    compilation_cache_dir: str | None = option(
        "auto",
        doc="persistent XLA compilation cache shared by runs (local or gs://): a rerun or resume loads its "
        "compiled programs instead of compiling them (minutes at real size); auto = $JAX_COMPILATION_CACHE_DIR "
        "when set, else ~/.cache/areal-jax/xla_cache; null = areal-jax sets none (JAX itself still reads "
        "$JAX_COMPILATION_CACHE_DIR: unset it too for no cache)",
    )

    def validate(self) -> None:
        rollout, sampling = self.rollout, self.rollout.workflow.sampling
        if sampling.temperature == 0:
            raise ConfigError(
                "rollout.workflow.sampling.temperature",
                "is 0 (greedy); RL needs sampled answers and their log-probs (the trainer scores at this "
                "temperature); greedy decoding is for eval.temperature",
            )
        for key, value, source, expected in (
            ("group_size", self.pipeline.group_size, "rollout.workflow.n_samples", rollout.workflow.n_samples),
            (
                "groups_per_batch",
                self.pipeline.groups_per_batch,
                "rollout.staleness.batch_prompts",
                rollout.staleness.batch_prompts,
            ),
        ):
            if value is not None and value != expected:
                raise ConfigError(f"pipeline.{key}", f"value {value} differs from {source}={expected}; leave it null")
        eta = rollout.staleness.max_head_offpolicyness
        if self.cluster.direct_store_every > eta + 1:
            # a restarted server starts from the newest stored version, up to direct_store_every - 1 behind the
            # trainer, and admits against it: beyond eta + 1 behind it could admit nothing while the trainer
            # waits for its groups, and no new version (so no direct offer) would ever come
            raise ConfigError(
                "cluster.direct_store_every",
                f"value {self.cluster.direct_store_every} exceeds rollout.staleness.max_head_offpolicyness + 1 = "
                f"{eta + 1}: a restarted rollout server, starting from the newest stored version, could wait "
                "forever for the trainer",
            )
        if not rollout.engine.fits_sample(self.dataset.max_prompt_tokens, sampling.max_new_tokens):
            raise ConfigError(
                "dataset.max_prompt_tokens",
                f"value {self.dataset.max_prompt_tokens} + rollout.workflow.sampling.max_new_tokens="
                f"{sampling.max_new_tokens} exceeds rollout.engine.max_length={rollout.engine.max_length}; "
                "lower one of the first two or raise the last",
            )
        if self.trainer.advantage.overlong_buffer and self.rollout.workflow.kind == "multi_turn":
            raise ConfigError(
                "trainer.advantage.overlong_buffer",
                f"is {self.trainer.advantage.overlong_buffer} but rollout.workflow.kind is multi_turn, whose "
                "responses hold the environment's turns too, so their length is not the model's; set it to 0",
            )
        if self.rollout.workflow.kind == "external" and self.eval.every_steps and self.dataset.heldout:
            raise ConfigError(
                "eval.every_steps",
                f"is {self.eval.every_steps} but rollout.workflow.kind is external: the run has no agent of its "
                "own to evaluate the held-out prompts with; set it (or dataset.heldout) to 0",
            )
        longest, what = self.longest_sample()
        budget = self.trainer.packing.token_budget  # auto is chosen per platform to fit the longest sample
        if budget != "auto" and longest > (row := self.trainer.packing.row_length):
            raise ConfigError(
                "trainer.packing.token_budget",
                f"a packed row holds token_budget / rows = {self.trainer.packing.token_budget} / "
                f"{self.trainer.packing.rows} = {row} tokens, but the longest sample is {what} = {longest}; "
                "raise trainer.packing.token_budget or lower trainer.packing.rows",
            )

    def packing_on(self, platform: str) -> PackingConfig:
        """`trainer.packing` with `token_budget: auto` chosen for `platform` and this run's longest sample."""
        return self.trainer.packing.resolved(platform, self.longest_sample()[0])

    def longest_sample(self) -> tuple[int, str]:
        """The longest possible trajectory in tokens and the keys it comes from."""
        if self.rollout.workflow.kind in ("multi_turn", "agent", "external"):
            return self.rollout.engine.max_length, f"rollout.engine.max_length ({self.rollout.workflow.kind})"
        sampling = self.rollout.workflow.sampling
        return (
            self.dataset.max_prompt_tokens + sampling.max_new_tokens,
            "dataset.max_prompt_tokens + rollout.workflow.sampling.max_new_tokens",
        )

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline section with the group size and batch size of the rollout side filled in."""
        return self.pipeline.replace(
            group_size=self.rollout.workflow.n_samples, groups_per_batch=self.rollout.staleness.batch_prompts
        )

    @property
    def run_location(self) -> str:
        """The run directory: a local path, or a gs:// URL (what crosses between processes and hosts lives
        here: checkpoints, weight versions, the rollout log, control files, the marker and config)."""
        return storage.join(self.output_dir, self.name)

    @property
    def layout(self) -> RunLayout:
        """Every path of this run (`areal_jax.run_layout`)."""
        return RunLayout(self.run_location, self.run_dir)

    @property
    def run_dir(self) -> Path:
        """Where this process writes the run's records: the run directory itself, or for a gs:// run its
        local copy below `local_copy_dir` (uploaded by `system.run_mirror`)."""
        if storage.is_remote(self.output_dir):
            return Path(self.local_copy_dir).expanduser() / self.run_location.replace("://", "/", 1)
        return Path(self.output_dir) / self.name


def load_experiment(path: str | Path | None = None, overrides: Iterable[str] = ()) -> ExperimentConfig:
    """Read an experiment YAML (optional) and apply `section.key=value` overrides."""
    return load(ExperimentConfig, path, overrides)
