"""The Arrow schemas of the store's tables, and the check every reader and writer runs.

One row of ``trajectories.parquet`` is one LLM call by one agent (docs/architecture.md §4);
``batch.parquet`` is the same rows with the advantage stage's columns added.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["BATCH_SCHEMA", "TRAJECTORY_SCHEMA", "SchemaError", "check_table"]

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("uid", pa.string(), nullable=False),  # prompt group (GRPO group)
        pa.field("traj_uid", pa.string(), nullable=False),  # episode
        pa.field("sample_idx", pa.int32(), nullable=False),  # index of the episode in its group
        pa.field("data_source", pa.string(), nullable=False),
        pa.field("env_step", pa.int32(), nullable=False),  # 1-based turn of the episode
        pa.field("call_idx", pa.int32(), nullable=False),  # order of the call in its episode
        pa.field("agent", pa.string(), nullable=False),
        pa.field("wg", pa.string(), nullable=False),  # worker group that generated the call
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("is_valid", pa.bool_(), nullable=False),  # output well-formed for its role
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length
        pa.field("reward", pa.float32(), nullable=False),  # the episode's task reward
        pa.field("success", pa.bool_(), nullable=False),  # the episode solved the task
    ]
)

BATCH_SCHEMA = pa.schema(
    list(TRAJECTORY_SCHEMA)
    + [
        pa.field("score", pa.float32(), nullable=False),  # reward - penalty * (1 - is_valid)
        pa.field("group_id", pa.string(), nullable=False),  # the normalisation group
        pa.field("advantage", pa.float32(), nullable=False),
    ]
)


class SchemaError(ValueError):
    """A table that does not match its schema; the message names every bad column."""


def check_table(table: pa.Table, schema: pa.Schema, source: str) -> pa.Table:
    """Return ``table`` with exactly ``schema``'s columns, in order, or raise SchemaError.

    Dictionary-encoded strings (as Parquet readers may return them) count as strings; extra
    columns are dropped; a missing column, another type or a null in a non-nullable column
    is an error that names the column and the file.
    """
    problems = []
    for field in schema:
        if field.name not in table.column_names:
            problems.append(f"column {field.name!r} is missing (expected {field.type})")
            continue
        actual = table.schema.field(field.name).type
        if not _same_type(actual, field.type):
            problems.append(f"column {field.name!r} has type {actual}, expected {field.type}")
        elif not field.nullable and table.column(field.name).null_count:
            count = table.column(field.name).null_count
            problems.append(f"column {field.name!r} has {count} null value(s)")
        elif pa.types.is_list(field.type) and _has_null_items(table.column(field.name)):
            problems.append(f"column {field.name!r} has null items inside its lists")
    if problems:
        raise SchemaError(f"{source}: " + "; ".join(problems))
    return table.select(schema.names)


def _same_type(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_dictionary(actual):
        actual = actual.value_type
    return actual == expected


def _has_null_items(column: pa.ChunkedArray) -> bool:
    return any(chunk.flatten().null_count for chunk in column.chunks)
