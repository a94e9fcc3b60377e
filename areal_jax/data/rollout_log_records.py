"""The rollout log's record format: one `Trajectory` as the bytes of one ArrayRecord record.

Format version 1: one msgpack map per record
  {"format": 1, "writer": str, "seq": int, "appended_at": float (unix time),
   "schema_version": int (Trajectory.schema_version),
   "token_ids" | "behav_logprobs" | "versions" | "loss_mask": {"dtype": "<i4", "shape": [T], "data": bytes},
   "prompt_length": int, "reward": float, "prompt_id": str, "group_id": int, "sample_index": int,
   "sequence_index": int, "num_sequences": int (schema 2; a schema-1 record is sequence 0 of 1),
   "reward_components": {str: float}, "timings": {str: float}, "metadata": {str: msgpack value},
   "routing": {array [T, Ym, K] uint8/uint16}, present only when the trajectory has routing (a mixture of experts;
   a record without it reads as routing None)}
Arrays are stored little-endian with their dtype. A reader refuses a newer format or schema version.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from areal_jax.data.trajectory import SCHEMA_VERSION, Trajectory

LOG_FORMAT_VERSION = 1
_ARRAY_FIELDS = ("token_ids", "behav_logprobs", "versions", "loss_mask")


class RecordFormatError(ValueError):
    """A record was written by a newer log format or trajectory schema than this reader understands."""


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.asarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": little.dtype.str, "shape": list(little.shape), "data": np.ascontiguousarray(little).tobytes()}


def _decode_array(value: dict[str, Any]) -> np.ndarray:
    array = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return array.astype(array.dtype.newbyteorder("="), copy=True)


def _plain(value: Any) -> Any:
    """msgpack fallback for NumPy scalars and small arrays in metadata."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot serialise a value of type {type(value).__name__} in a trajectory record")


def encode_record(trajectory: Trajectory, writer_id: str, seq: int, appended_at: float) -> bytes:
    """The record bytes of `trajectory` (format in the module docstring)."""
    record: dict[str, Any] = {
        "format": LOG_FORMAT_VERSION,
        "writer": writer_id,
        "seq": seq,
        "appended_at": appended_at,
        "schema_version": trajectory.schema_version,
        "prompt_length": int(trajectory.prompt_length),
        "reward": float(trajectory.reward),
        "prompt_id": trajectory.prompt_id,
        "group_id": int(trajectory.group_id),
        "sample_index": int(trajectory.sample_index),
        "sequence_index": int(trajectory.sequence_index),
        "num_sequences": int(trajectory.num_sequences),
        "reward_components": {k: float(v) for k, v in trajectory.reward_components.items()},
        "timings": {k: float(v) for k, v in trajectory.timings.items()},
        "metadata": dict(trajectory.metadata),
    }
    for name in _ARRAY_FIELDS:
        record[name] = _encode_array(getattr(trajectory, name))
    if trajectory.routing is not None:
        record["routing"] = _encode_array(trajectory.routing)
    return msgpack.packb(record, default=_plain, use_bin_type=True)


def decode_record(data: bytes) -> tuple[str, int, float, Trajectory]:
    """(writer id, record seq, append time, trajectory) of record bytes written by `encode_record`."""
    record = msgpack.unpackb(data, raw=False)
    if not isinstance(record, dict) or "format" not in record:
        raise ValueError(f"not a rollout-log record (decoded a {type(record).__name__})")
    if record["format"] > LOG_FORMAT_VERSION:
        raise RecordFormatError(
            f"record format {record['format']} is newer than this reader's {LOG_FORMAT_VERSION}; upgrade the reader"
        )
    if record["schema_version"] > SCHEMA_VERSION:
        raise RecordFormatError(
            f"trajectory schema {record['schema_version']} is newer than this reader's {SCHEMA_VERSION}"
        )
    arrays = {name: _decode_array(record[name]) for name in _ARRAY_FIELDS}
    trajectory = Trajectory(
        **arrays,
        prompt_length=record["prompt_length"],
        reward=record["reward"],
        prompt_id=record["prompt_id"],
        group_id=record["group_id"],
        sample_index=record["sample_index"],
        sequence_index=record.get("sequence_index", 0),
        num_sequences=record.get("num_sequences", 1),
        reward_components=record["reward_components"],
        timings=record["timings"],
        metadata=record["metadata"],
        schema_version=record["schema_version"],
        routing=_decode_array(record["routing"]) if "routing" in record else None,
    )
    return record["writer"], record["seq"], record["appended_at"], trajectory
