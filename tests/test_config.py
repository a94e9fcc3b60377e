"""Config loading: YAML + dotted overrides; each kind of bad input is refused naming the key."""

import dataclasses

import pytest

from areal_jax.config import ExperimentConfig, load_experiment
from areal_jax.configuration import ConfigError, describe, from_dict, load, read_yaml, to_dict, to_yaml


def test_yaml_and_overrides_build_typed_frozen_tree(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nmodel:\n  num_layers: 3\n  rope_scaling:\n    factor: 4\n")
    cfg = load_experiment(path, ["model.num_layers=4", "generation.temperature=1e-1", "mesh.tensor=2"])
    assert cfg.name == "x" and cfg.model.num_layers == 4 and cfg.mesh.tensor == 2
    assert cfg.generation.temperature == pytest.approx(0.1) and isinstance(cfg.generation.temperature, float)
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 4.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "y"  # type: ignore[misc]


def test_yaml_round_trip(tmp_path):
    cfg = load_experiment(None, ["model.head_dim=16", "hf_checkpoint=/tmp/ckpt", "model.rope_scaling={factor: 2.0}"])
    path = tmp_path / "back.yaml"
    path.write_text(to_yaml(cfg))
    assert load_experiment(path) == cfg
    assert to_dict(cfg)["model"]["head_dim"] == 16


def test_null_resets_optional_section():
    cfg = load_experiment(None, ["model.rope_scaling={factor: 2.0}", "model.rope_scaling=null"])
    assert cfg.model.rope_scaling is None


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("model.num_layer=3", "model.num_layer", "did you mean 'num_layers'"),
        ("modle.num_layers=3", "modle", "did you mean 'model'"),
        ("model.num_layers=three", "model.num_layers", "expected int"),
        ("model.num_layers=2.5", "model.num_layers", "expected int"),
        ("model.qk_norm=maybe", "model.qk_norm", "expected bool"),
        ("model.num_layers=0", "model.num_layers", "allowed: >= 1"),
        ("generation.temperature=-1", "generation.temperature", "allowed: >= 0"),
        ("model.rope_theta=0", "model.rope_theta", "allowed: > 0"),
        ("model.family=lama", "model.family", "did you mean 'llama'"),
        ("model.param_dtype=fp16", "model.param_dtype", "allowed: 'float32', 'bfloat16'"),
        ("model.num_kv_heads=3", "model.num_kv_heads", "must divide num_heads=4"),
        ("model.rope_scaling.low_freq_factor=9", "model.rope_scaling.high_freq_factor", "greater than"),
        ("mesh.tensor=0", "mesh.tensor", "value 0 is not allowed"),
        ("name.first=x", "name", "not a section; it has no key 'first'"),
        ("model", "model", "section.key=value"),
        ("model.rope_scaling=3", "model.rope_scaling", "expected"),
    ],
)
def test_bad_override_names_the_key(override, key, fragment):
    overrides = [override]
    if override.startswith("model.rope_scaling.low"):
        overrides = ["model.rope_scaling={factor: 2.0}", override]
    with pytest.raises(ConfigError) as info:
        load_experiment(None, overrides)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")
    assert fragment in str(info.value)


def test_bad_yaml_file_entries(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: 64\n  vocabsize: 10\n")
    with pytest.raises(ConfigError, match=r"model\.vocabsize: unknown key.*did you mean 'vocab_size'"):
        load_experiment(path)
    path.write_text("model: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"model: got \[1, 2\].*expected a mapping"):
        load_experiment(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        read_yaml(path)
    path.write_text("model: {num_layers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(path)


def test_required_fields_and_describe():
    @dataclasses.dataclass(frozen=True)
    class Needs(ExperimentConfig.__mro__[1]):  # the Config base
        size: int

    with pytest.raises(ConfigError, match="size: required key is missing"):
        from_dict(Needs, {})
    lines = describe(ExperimentConfig)
    assert any(line.startswith("model.num_layers (int, default 2, >= 1): decoder layers") for line in lines)
    assert load(ExperimentConfig) == ExperimentConfig()


def test_choices_are_checked_on_direct_construction_too():
    from areal_jax.models.config import ModelConfig

    with pytest.raises(ConfigError, match=r"family: got 'mistral'; allowed: 'qwen2', 'qwen3', 'llama'"):
        ModelConfig(family="mistral")


@pytest.mark.parametrize(
    "overrides, key, named",
    [
        (
            ["dataset.max_prompt_tokens=900", "rollout.workflow.sampling.max_new_tokens=200"],
            "dataset.max_prompt_tokens",
            ("rollout.workflow.sampling.max_new_tokens=200", "rollout.engine.max_length=1024"),
        ),
        (
            ["trainer.packing.token_budget=4096", "trainer.packing.rows=8"],
            "trainer.packing.token_budget",
            ("trainer.packing.rows", "dataset.max_prompt_tokens + rollout.workflow.sampling.max_new_tokens = 768"),
        ),
        (
            [
                "rollout.workflow.kind=multi_turn",
                "rollout.engine.max_length=2048",
                "trainer.packing.token_budget=8192",
                "trainer.packing.rows=16",
            ],
            "trainer.packing.token_budget",
            ("rollout.engine.max_length (multi_turn) = 2048", "= 512 tokens"),
        ),
        (["pipeline.group_size=3"], "pipeline.group_size", ("rollout.workflow.n_samples=4",)),
        (["pipeline.groups_per_batch=2"], "pipeline.groups_per_batch", ("rollout.staleness.batch_prompts=8",)),
        (["rollout.workflow.sampling.temperature=0"], "rollout.workflow.sampling.temperature", ("eval.temperature",)),
        (["reward.kind=mathh"], "reward.kind", ("'package.module:function'",)),
        (["dataset.files=[{path: a.jsonl}, {path: a.jsonl}]"], "dataset.files[1].path", ("listed twice",)),
    ],
)
def test_cross_section_errors_at_load_time_name_both_keys(overrides, key, named):
    with pytest.raises(ConfigError) as info:
        load_experiment(None, overrides)
    assert info.value.key == key
    for fragment in named:
        assert fragment in str(info.value)


def test_a_config_file_builds_on_a_base_file(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\nmodel:\n  hidden_size: 32\n  num_layers: 3\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nname: child\nmodel:\n  hidden_size: 48\n")
    cfg = load_experiment(tmp_path / "child.yaml", ["model.num_heads=6"])
    assert (cfg.name, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == ("child", 48, 3, 6)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="comes back to itself"):
        load_experiment(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_experiment(tmp_path / "missing.yaml")


def test_a_removed_key_is_ignored_with_a_warning_and_an_unknown_one_still_refused(tmp_path, caplog):
    """An older run's config.yaml lists every key it had; one a section has since removed (`REMOVED_KEYS`)
    loads with a warning, so the run can still resume; a key that never existed is refused as before."""
    old = tmp_path / "config.yaml"
    old.write_text("rollout:\n  log:\n    max_records: 64\n    fsync: false\npipeline:\n  prefetch_batches: 2\n")
    with caplog.at_level("WARNING"):
        cfg = load_experiment(str(old))
    assert cfg.rollout.log.fsync is False  # the keys beside it are read
    assert "'max_records' of RolloutLogConfig is ignored" in caplog.text
    assert "'prefetch_batches' of PipelineConfig is ignored" in caplog.text
    old.write_text("rollout:\n  log:\n    max_recordz: 64\n")
    with pytest.raises(ConfigError, match=r"rollout\.log\.max_recordz: unknown key"):
        load_experiment(str(old))
