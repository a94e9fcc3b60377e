"""Prompt datasets: jsonl or parquet rows read into typed `PromptRecord`s through a field mapping.

A `FieldMapping` names which field holds the prompt, the reference answer, the test cases and the id;
a field name may list alternatives (`"problem|Problem|question"`, the first present wins) and may reach
into nested or JSON-encoded objects with dots (`"metadata.func_name"`). `MAPPINGS` holds ready mappings
for GSM8K, DeepScaleR, AIME 2024/2025, AMC 2023, MATH-500 and DeepCoder. A malformed row (bad JSON,
missing field, wrong type) is reported with the file name and its 1-based line (row) number, and is
either refused (`MalformedRowError`) or skipped and counted, as `DatasetConfig.on_error` says.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from etils import epath

from areal_jax.configuration import Config, ConfigError, option

logger = logging.getLogger(__name__)

_MAX_LOGGED_SKIPS = 20


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: `answer` for math rows, `tests` (decoded JSON) for code rows."""

    id: str
    prompt: str
    answer: str | None
    tests: Any | None
    source: str
    metadata: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RowError:
    """Where a malformed row is and what is wrong with it."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class MalformedRowError(ValueError):
    """A row was refused; `file` and `line` (1-based) locate it."""

    def __init__(self, error: RowError):
        self.file, self.line = error.file, error.line
        super().__init__(str(error))


@dataclasses.dataclass(frozen=True)
class FieldMapping(Config):
    """Which row fields make a `PromptRecord`; empty strings mean "not present"."""

    prompt: str = option("prompt", doc="field of the prompt/question text")
    answer: str = option("answer", doc="field of the reference answer; empty means none")
    tests: str = option("", doc="field of the test cases (a JSON string, list or dict)")
    id: str = option("", doc="field of the row id; empty means <file stem>-<line>")
    answer_after: str = option("", doc="keep the text after the last occurrence of this marker (GSM8K: ####)")
    fn_name: str = option("", doc="field holding the function name of call-based tests (kept in metadata)")
    metadata: tuple[str, ...] = option((), doc="fields copied into the record's metadata when present")

    def validate(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt", "the prompt field name must not be empty")
        if not self.answer and not self.tests:
            raise ConfigError("answer", "a mapping needs an answer field, a tests field, or both")


MAPPINGS: dict[str, FieldMapping] = {
    "gsm8k": FieldMapping(prompt="question", answer="answer", answer_after="####"),
    "deepscaler": FieldMapping(prompt="problem", answer="answer", metadata=("solution",)),
    "aime24": FieldMapping(
        prompt="problem|Problem|question", answer="answer|Answer", id="id|ID", metadata=("solution|Solution", "url")
    ),
    "aime25": FieldMapping(prompt="problem|question", answer="answer", id="id|ID", metadata=("solution",)),
    "amc23": FieldMapping(prompt="question|problem", answer="answer", id="id|ID", metadata=("url",)),
    "math500": FieldMapping(
        prompt="problem", answer="answer", id="unique_id", metadata=("solution", "subject", "level")
    ),
    "deepcoder": FieldMapping(
        prompt="problem|question", answer="", tests="tests", id="id|task_id", fn_name="metadata.func_name|fn_name"
    ),
}


@dataclasses.dataclass(frozen=True)
class DatasetConfig(Config):
    """One prompt file and how to read it."""

    path: str = option(doc="a .jsonl or .parquet file: a local path or gs://bucket/... (read through etils.epath)")
    mapping: str = option("", doc=f"a ready mapping ({', '.join(MAPPINGS)}); empty means use `fields`")
    fields: FieldMapping = option(default_factory=FieldMapping, doc="the field mapping when `mapping` is empty")
    format: Literal["auto", "jsonl", "parquet"] = option("auto", doc="file format; auto goes by the suffix")
    on_error: Literal["raise", "skip"] = option("raise", doc="refuse the file at a malformed row, or skip it")
    source: str = option("", doc="the records' source tag; empty means the mapping name or the file stem")
    limit: int = option(0, ge=0, doc="stop after this many records; 0 reads all")

    def validate(self) -> None:
        if self.mapping and self.mapping not in MAPPINGS:
            raise ConfigError("mapping", f"got {self.mapping!r}; known: {', '.join(MAPPINGS)}")
        if self.format == "auto" and Path(self.path).suffix not in (".jsonl", ".parquet"):
            raise ConfigError("format", f"cannot tell the format of {self.path!r}; set jsonl or parquet")

    def field_mapping(self) -> FieldMapping:
        return MAPPINGS[self.mapping] if self.mapping else self.fields


class PromptDataset(Sequence[PromptRecord]):
    """The records of one file, plus the rows that were skipped as malformed."""

    def __init__(self, records: list[PromptRecord], skipped: list[RowError]):
        self.records = records
        self.skipped = tuple(skipped)

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, index: int) -> PromptRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptRecord]: ...

    def __getitem__(self, index: int | slice) -> PromptRecord | list[PromptRecord]:
        return self.records[index]


class _RowProblem(Exception):
    """Internal: a row is malformed; turned into a `RowError` with file and line by the reader."""


# ---------------------------------------------------------------------------------------------- readers


def _jsonl_rows(path: epath.Path) -> Iterator[tuple[int, dict[str, Any] | _RowProblem]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, _RowProblem(f"invalid JSON: {err.msg} at column {err.colno}")
                continue
            if not isinstance(row, dict):
                yield line_no, _RowProblem(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield line_no, row


def _parquet_rows(path: epath.Path) -> Iterator[tuple[int, dict[str, Any] | _RowProblem]]:
    import pyarrow.parquet as pq

    row_no = 0
    with path.open("rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                row_no += 1
                yield row_no, row


# ---------------------------------------------------------------------------------------------- mapping


def _lookup(row: Mapping[str, Any], spec: str) -> Any:
    """The value at `spec` ("a|b" alternatives, "a.b" nesting through dicts or JSON strings); None if absent."""
    for alternative in spec.split("|"):
        value: Any = row
        for part in alternative.split("."):
            if isinstance(value, str) and value.lstrip().startswith("{"):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    value = None
            value = value.get(part) if isinstance(value, Mapping) else None
            if value is None:
                break
        if value is not None:
            return value
    return None


def _text(row: Mapping[str, Any], spec: str, what: str) -> str:
    value = _lookup(row, spec)
    if value is None:
        raise _RowProblem(f"missing {what} field {spec!r}")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _RowProblem(f"{what} field {spec!r} must be text, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise _RowProblem(f"{what} field {spec!r} is empty")
    return text


def _tests(row: Mapping[str, Any], spec: str) -> Any:
    value = _lookup(row, spec)
    if value is None:
        raise _RowProblem(f"missing tests field {spec!r}")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise _RowProblem(f"tests field {spec!r} is not valid JSON: {err.msg}") from None
    if not isinstance(value, list | dict):
        raise _RowProblem(f"tests field {spec!r} must be a list or an object, got {type(value).__name__}")
    if not (value.get("inputs") if isinstance(value, dict) else value):
        raise _RowProblem(f"tests field {spec!r} has no test cases")
    return value


def to_record(row: Mapping[str, Any], fields: FieldMapping, source: str, default_id: str) -> PromptRecord:
    """Map one row to a `PromptRecord`; raises `_RowProblem` naming the offending field."""
    prompt = _text(row, fields.prompt, "prompt")
    answer = None
    if fields.answer:
        answer = _text(row, fields.answer, "answer")
        if fields.answer_after:
            if fields.answer_after not in answer:
                raise _RowProblem(f"answer has no {fields.answer_after!r} marker: {answer[-60:]!r}")
            answer = answer.rsplit(fields.answer_after, 1)[1].strip()
            if not answer:
                raise _RowProblem(f"answer is empty after {fields.answer_after!r}")
    tests = _tests(row, fields.tests) if fields.tests else None
    row_id = default_id
    if fields.id and (found := _lookup(row, fields.id)) is not None:
        row_id = str(found)
    metadata = {name.split("|")[0]: v for name in fields.metadata if (v := _lookup(row, name)) is not None}
    if fields.fn_name and (fn_name := _lookup(row, fields.fn_name)) is not None:
        metadata["fn_name"] = str(fn_name)
    return PromptRecord(row_id, prompt, answer, tests, source, metadata)


def load_prompts(config: DatasetConfig) -> PromptDataset:
    """Read `config.path` into a `PromptDataset`, refusing or skipping malformed rows as configured."""
    path = epath.Path(config.path)  # gs:// through gcsfs (requirements.txt)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {config.path!r} does not exist")
    fmt = config.format if config.format != "auto" else path.suffix.lstrip(".")
    rows = _jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path)
    fields = config.field_mapping()
    source = config.source or config.mapping or path.stem
    records: list[PromptRecord] = []
    skipped: list[RowError] = []
    for line, row in rows:
        try:
            if isinstance(row, _RowProblem):
                raise row
            records.append(to_record(row, fields, source, f"{path.stem}-{line}"))
        except _RowProblem as problem:
            error = RowError(config.path, line, str(problem))
            if config.on_error == "raise":
                raise MalformedRowError(error) from None
            skipped.append(error)
            if len(skipped) <= _MAX_LOGGED_SKIPS:
                logger.warning("skipping malformed row %s", error)
        if config.limit and len(records) >= config.limit:
            break
    if skipped:
        logger.warning("%s: skipped %d malformed rows, kept %d", path.name, len(skipped), len(records))
    return PromptDataset(records, skipped)
