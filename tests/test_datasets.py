"""Prompt datasets: ready mappings on sample files, parquet input, malformed rows refused or skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jax.configuration import ConfigError, from_dict
from areal_jax.data.datasets import (
    MAPPINGS,
    DatasetConfig,
    FieldMapping,
    MalformedRowError,
    PromptRecord,
    load_prompts,
)
from areal_jax.rewards.code import parse_tests

DATA = Path(__file__).parent / "data"


def test_gsm8k_answer_after_marker():
    ds = load_prompts(DatasetConfig(path=str(DATA / "gsm8k_sample.jsonl"), mapping="gsm8k"))
    assert [r.answer for r in ds] == ["29", "180", "15,000"]
    assert all(isinstance(r, PromptRecord) and r.source == "gsm8k" for r in ds)
    assert ds[0].id == "gsm8k_sample-1"
    assert ds[0].prompt.startswith("Mia has 3 boxes")
    assert ds.skipped == ()


def test_deepscaler_keeps_solution_in_metadata():
    ds = load_prompts(DatasetConfig(path=str(DATA / "deepscaler_sample.jsonl"), mapping="deepscaler"))
    assert [r.answer for r in ds] == ["5", "5\\sqrt{2}", "(1, \\infty)"]
    assert "Vieta" in ds[0].metadata["solution"]


def test_aime_alternative_field_names_and_numeric_answers():
    ds = load_prompts(DatasetConfig(path=str(DATA / "aime_sample.jsonl"), mapping="aime24"))
    assert [(r.id, r.answer) for r in ds] == [("2024-I-1", "1"), ("2024-I-2", "16")]
    assert ds[1].metadata["solution"].startswith("$2024")


def test_deepcoder_tests_decode_and_parse():
    ds = load_prompts(DatasetConfig(path=str(DATA / "deepcoder_sample.jsonl"), mapping="deepcoder"))
    assert [r.id for r in ds] == ["dc-stdin-1", "dc-func-1", "dc-taco-1"]
    assert ds[1].metadata["fn_name"] == "addAll"
    kinds = [[c.kind for c in parse_tests(r.tests, r.metadata.get("fn_name"))] for r in ds]
    assert kinds == [["stdin", "stdin"], ["call", "call"], ["call", "call"]]
    assert all(r.answer is None for r in ds)


def test_parquet_with_custom_mapping(tmp_path):
    table = pa.table(
        {
            "uid": ["a", "b", "c"],
            "problem": ["1 + 1?", None, "2 + 3?"],
            "final": ["2", "x", "5"],
            "level": [1, 2, 3],
        }
    )
    path = tmp_path / "math.parquet"
    pq.write_table(table, path)
    fields = FieldMapping(prompt="problem", answer="final", id="uid", metadata=("level",))
    cfg = DatasetConfig(path=str(path), fields=fields, on_error="skip", source="custom")
    ds = load_prompts(cfg)
    assert [(r.id, r.answer, r.metadata["level"]) for r in ds] == [("a", "2", 1), ("c", "5", 3)]
    assert len(ds.skipped) == 1 and ds.skipped[0].line == 2 and "prompt" in ds.skipped[0].message
    with pytest.raises(MalformedRowError, match=r"math\.parquet:2: missing prompt"):
        load_prompts(cfg.replace(on_error="raise"))


def test_malformed_row_refused_names_file_and_line():
    path = DATA / "malformed_sample.jsonl"
    with pytest.raises(MalformedRowError) as info:
        load_prompts(DatasetConfig(path=str(path), mapping="gsm8k"))
    assert info.value.line == 2
    assert info.value.file.endswith("malformed_sample.jsonl")
    assert "malformed_sample.jsonl:2: invalid JSON" in str(info.value)


def test_malformed_rows_skipped_are_counted_with_lines(caplog):
    ds = load_prompts(DatasetConfig(path=str(DATA / "malformed_sample.jsonl"), mapping="gsm8k", on_error="skip"))
    assert [r.answer for r in ds] == ["4", "9"]
    assert [e.line for e in ds.skipped] == [2, 3, 5, 6, 7]
    messages = [e.message for e in ds.skipped]
    assert "invalid JSON" in messages[0]
    assert "missing prompt field 'question'" in messages[1]
    assert "must be text, got list" in messages[2]
    assert "no '####' marker" in messages[3]
    assert "expected a JSON object" in messages[4]
    assert "skipped 5 malformed rows" in caplog.text


def test_bad_tests_json_is_a_malformed_row(tmp_path):
    path = tmp_path / "code.jsonl"
    rows = [{"problem": "p", "tests": json.dumps({"inputs": [], "outputs": []})}, {"problem": "q", "tests": "{oops"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(MalformedRowError, match=r"code\.jsonl:1: tests field 'tests' has no test cases"):
        load_prompts(DatasetConfig(path=str(path), mapping="deepcoder"))
    ds = load_prompts(DatasetConfig(path=str(path), mapping="deepcoder", on_error="skip"))
    assert len(ds) == 0 and [e.line for e in ds.skipped] == [1, 2]
    assert "not valid JSON" in ds.skipped[1].message


def test_limit_and_config_refusals(tmp_path):
    ds = load_prompts(DatasetConfig(path=str(DATA / "gsm8k_sample.jsonl"), mapping="gsm8k", limit=2))
    assert len(ds) == 2
    with pytest.raises(ConfigError, match="mapping: got 'gsm9k'"):
        DatasetConfig(path="x.jsonl", mapping="gsm9k")
    with pytest.raises(ConfigError, match="format"):
        DatasetConfig(path="x.csv")
    with pytest.raises(ConfigError, match="answer"):
        FieldMapping(prompt="q", answer="")
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_prompts(DatasetConfig(path=str(tmp_path / "nope.jsonl"), mapping="gsm8k"))
    cfg = from_dict(DatasetConfig, {"path": "a.jsonl", "fields": {"prompt": "q", "answer": "a"}, "on_error": "skip"})
    assert cfg.field_mapping().prompt == "q"


def test_every_ready_mapping_is_valid():
    assert set(MAPPINGS) >= {"gsm8k", "deepscaler", "aime24", "aime25", "amc23", "math500", "deepcoder"}


def test_a_dataset_on_a_bucket_reads_as_a_local_one(tmp_path, gcs):
    from areal_jax import storage
    from tests.gcs_emulator import BUCKET

    rows = [{"question": f"{i} + 1?", "answer": f"work #### {i + 1}"} for i in range(3)]
    local = tmp_path / "train.jsonl"
    local.write_text("".join(json.dumps(row) + "\n" for row in rows))
    remote = f"gs://{BUCKET}/{tmp_path.name}/train.jsonl"
    storage.upload(local, remote)
    from_bucket = load_prompts(DatasetConfig(path=remote, mapping="gsm8k"))
    from_disk = load_prompts(DatasetConfig(path=str(local), mapping="gsm8k"))
    assert [(r.prompt, r.answer) for r in from_bucket] == [(r.prompt, r.answer) for r in from_disk]
    assert [r.answer for r in from_bucket] == ["1", "2", "3"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(DatasetConfig(path=f"gs://{BUCKET}/{tmp_path.name}/missing.jsonl", mapping="gsm8k"))
