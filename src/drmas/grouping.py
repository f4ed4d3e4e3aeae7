"""Key columns to dense integer codes: the machinery under the advantage math.

``drmas.algos`` reduces over groups with ``np.bincount``, which needs each row's group as
an integer in [0, n). The keys come as the stages hold them (numpy arrays of ids or agent
names, Python lists, Arrow columns read from Parquet, dictionary-encoded or not). Strings
are hashed by Arrow in C++, and the layouts that trajectory files have (keys in long runs,
small dictionaries) hash as few strings as they can. Kept apart from the math so that
``algos.py`` reads as the algorithm.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["code_names", "combine_codes", "factorize", "key_at"]


def factorize(keys: Any) -> tuple[np.ndarray, int]:
    """Map a key column to dense int64 codes in [0, n) and return (codes, n).

    Accepts what the stages hold: numpy arrays (integers, strings or objects), Python
    lists, and Arrow arrays or chunked arrays, plain or dictionary-encoded (as Parquet
    gives them with ``read_dictionary``). Strings are hashed by Arrow in C++, which is an
    order of magnitude faster than sorting them with ``np.unique``.
    """
    if _is_arrow(keys):
        return _factorize_arrow(keys)
    array = np.asarray(keys)
    if array.ndim != 1:
        raise ValueError(f"a key column must be 1-D, got shape {array.shape}")
    if array.dtype.kind in "iub":
        uniques, codes = np.unique(array, return_inverse=True)
        return codes.astype(np.int64, copy=False), len(uniques)
    return _factorize_arrow(_numpy_strings_to_arrow(array))


def _numpy_strings_to_arrow(array: np.ndarray) -> Any:
    """An Arrow array with the keys of a numpy string column, partitioned alike.

    Converting numpy's UTF-32 strings to Arrow UTF-8 one by one costs more than the rest
    of the advantage step. ASCII keys (ids, agent names) skip it: their code points, one
    byte each, are the rows of a fixed-width binary array built over the same buffer
    layout (NUL padding cannot make two different numpy strings equal: numpy drops
    trailing NULs). Other keys are converted.
    """
    import pyarrow as pa  # noqa: PLC0415 - only string keys need Arrow's hash table

    width = array.dtype.itemsize // 4 if array.dtype.kind == "U" else 0
    if width:
        points = np.ascontiguousarray(array).view(np.uint32).reshape(len(array), width)  # [N, width]
        if not len(array) or int(points.max()) < 128:
            data = points.astype(np.uint8)  # [N, width], row-major: one key per row
            return pa.Array.from_buffers(pa.binary(width), len(array), [None, pa.py_buffer(data)])
    return pa.array(array, type=pa.string())


def _is_arrow(obj: Any) -> bool:
    return type(obj).__module__.startswith("pyarrow")


def _factorize_arrow(column: Any) -> tuple[np.ndarray, int]:
    """Codes of an Arrow key column, hashing as few strings as the layout allows.

    - Dictionary-encoded with small dictionaries (agent names): unify the dictionaries
      and read the indices; no string is hashed twice.
    - Keys in long runs (trajectory files keep an episode's and a prompt's rows together):
      find the runs with a cheap scan and hash one string per run.
    - Otherwise hash every row in C++ (Arrow's hash table).
    """
    import pyarrow as pa  # noqa: PLC0415

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    nulls = sum(chunk.null_count for chunk in chunks)
    if nulls:
        raise ValueError(f"a key column has {nulls} null value(s)")
    rows = sum(len(chunk) for chunk in chunks)
    if rows == 0:
        return np.zeros(0, dtype=np.int64), 0
    if pa.types.is_dictionary(chunks[0].type):
        if sum(len(chunk.dictionary) for chunk in chunks) <= rows // 4:
            unified = pa.chunked_array(chunks).unify_dictionaries()
            return _indices(unified.chunks), len(unified.chunk(0).dictionary)
        value_type = chunks[0].type.value_type
    else:
        value_type = chunks[0].type
    if not _has_long_runs(chunks[0]):
        encoded = pa.chunked_array(chunks).cast(value_type).dictionary_encode()
        return _indices(encoded.chunks), max(len(c.dictionary) for c in encoded.chunks)
    runs = [_runs(chunk) for chunk in chunks]
    encoded = pa.chunked_array([values for values, _ in runs], type=value_type).dictionary_encode()
    lengths = np.concatenate([lengths for _, lengths in runs])
    return np.repeat(_indices(encoded.chunks), lengths), max(len(c.dictionary) for c in encoded.chunks)


def _indices(chunks: list[Any]) -> np.ndarray:
    arrays = [chunk.indices.to_numpy(zero_copy_only=False) for chunk in chunks]
    return np.concatenate(arrays).astype(np.int64, copy=False)


def _has_long_runs(chunk: Any, sample: int = 4096) -> bool:
    """Whether the first rows come in runs of 4 or more on average."""
    _, lengths = _runs(chunk.slice(0, sample))
    return len(lengths) * 4 <= min(len(chunk), sample)


def _runs(chunk: Any) -> tuple[Any, np.ndarray]:
    """(one value per run of equal keys, run lengths) of one Arrow chunk."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    if pa.types.is_dictionary(chunk.type):
        indices = chunk.indices.to_numpy(zero_copy_only=False)
        starts = np.flatnonzero(np.r_[True, indices[1:] != indices[:-1]]) if len(indices) else indices
        lengths = np.diff(np.r_[starts, len(indices)])
        return chunk.dictionary.take(pa.array(indices[starts])), lengths
    encoded = pc.run_end_encode(chunk)
    ends = encoded.run_ends.to_numpy(zero_copy_only=False)
    return encoded.values, np.diff(np.r_[0, ends])


def combine_codes(major: np.ndarray, minor: np.ndarray, n_minor: int) -> tuple[np.ndarray, int]:
    """Codes of the pair (major, minor) without a sort: major * n_minor + minor.

    Unused pairs leave empty bins, which cost memory only; when the product would be much
    larger than the data, the codes are compacted instead.
    """
    n_major = int(major.max()) + 1 if len(major) else 0
    combined = major * n_minor + minor  # [N]
    if n_major * n_minor <= 4 * len(major) + 1024:
        return combined, n_major * n_minor
    uniques, codes = np.unique(combined, return_inverse=True)
    return codes.astype(np.int64, copy=False), len(uniques)


def code_names(keys: Any, codes: np.ndarray, n_codes: int) -> list[str]:
    """The key of each code, read from the first row that has it."""
    first_row = np.full(n_codes, -1, dtype=np.int64)
    first_row[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)
    if _is_arrow(keys):
        return [str(keys[int(r)].as_py()) if r >= 0 else "" for r in first_row]
    keys = np.asarray(keys)
    return [str(keys[r]) if r >= 0 else "" for r in first_row]


def key_at(keys: Any, row: int) -> Any:
    """The key of one row, as a Python value, whatever kind of column holds it."""
    return keys[row].as_py() if _is_arrow(keys) else keys[row]
