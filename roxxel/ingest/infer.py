"""Schema inference from the first records of an input, when the answer is unambiguous.

Python ints become ``int_dtype`` (int64 by default) and floats ``float_dtype`` (float64);
numpy values keep their dtype; lists become variable-length arrays (``int64[]``,
``float64[,3]``); rows of one numpy array (npy/npz) become fixed-shape fields. Anything
that does not decide one spec (mixed kinds, only empty lists, a field missing from some
records, nested objects) raises ConfigError asking for ``--field NAME:SPEC``. Records are
then projected onto the schema's fields (JSON int lists become arrays of the field dtype).
"""

from __future__ import annotations

import functools
from array import array as typed_array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from roxxel.errors import ConfigError
from roxxel.format.schema import Field
from roxxel.ingest.units import Record

__all__ = ["infer_schema", "max_record_bytes", "project_record"]

# array.array typecodes of the integer dtypes: it converts a list of ints in one C loop and
# raises on a float or an out-of-range value, where numpy would need min/max and a cast.
_TYPECODES = {
    np.dtype(f"{k}{typed_array(c).itemsize}"): c
    for k, c in zip("iuiuiuiu", "bBhHiIqQ", strict=True)
}


@dataclass(frozen=True, slots=True)
class _Guess:
    kind: str  # "str" | "bytes" | "array"
    dtype: str  # numpy dtype name, "" when unknown (empty list)
    shape: tuple[int, ...]
    from_python: bool  # built from Python numbers: the dtype may widen (int + float)


def _ambiguous(name: str, why: str) -> ConfigError:
    return ConfigError(
        f"schema inference: field {name!r} is ambiguous ({why}, expected one clear type: "
        f"pass --field {name}:SPEC, e.g. --field {name}:int32[])"
    )


def _python_dtype(array: np.ndarray, int_dtype: str, float_dtype: str) -> str:
    kind = array.dtype.kind
    return {"b": "bool", "i": int_dtype, "u": int_dtype, "f": float_dtype}.get(kind, "")


def _guess(name: str, value: Any, int_dtype: str, float_dtype: str) -> _Guess:
    if isinstance(value, str):
        return _Guess("str", "", (), False)
    if isinstance(value, bytes | bytearray):
        return _Guess("bytes", "", (), False)
    if isinstance(value, bool | int | float | list):
        try:
            array = np.asarray(value)
        except ValueError:
            raise _ambiguous(name, "ragged nested lists") from None
        dtype = _python_dtype(array, int_dtype, float_dtype) if array.size else ""
        if array.size and not dtype:
            raise _ambiguous(name, f"a list of {array.dtype} values")
        return _Guess("array", dtype, array.shape, True)
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind not in "biuf":
            raise _ambiguous(name, f"numpy dtype {value.dtype}")
        return _Guess("array", value.dtype.name, np.shape(value), False)
    raise _ambiguous(name, f"a {type(value).__name__} value")


def _merge_dtype(name: str, guesses: list[_Guess]) -> str:
    dtypes = {g.dtype for g in guesses if g.dtype}
    if not dtypes:
        raise _ambiguous(name, "only empty lists in the first records")
    if len(dtypes) == 1:
        return dtypes.pop()
    if all(g.from_python for g in guesses) and "bool" not in dtypes:
        return max(dtypes, key=lambda d: np.dtype(d).kind == "f")  # ints mixed with floats
    raise _ambiguous(name, f"dtypes {sorted(dtypes)}")


def _merge_shape(name: str, guesses: list[_Guess], fixed_arrays: bool) -> str:
    shapes = {g.shape for g in guesses}
    ranks = {len(s) for s in shapes}
    if len(ranks) > 1:
        raise _ambiguous(name, f"ranks {sorted(ranks)}")
    rank = ranks.pop()
    if rank == 0:
        return ""
    if fixed_arrays and len(shapes) == 1:
        return "[" + ",".join(str(d) for d in shapes.pop()) + "]"
    inner = {s[1:] for s in shapes}
    if len(inner) > 1:
        raise _ambiguous(name, f"inner shapes {sorted(inner)} differ")
    return "[" + ",".join([""] + [str(d) for d in inner.pop()]) + "]"


def _merge(name: str, guesses: list[_Guess], fixed_arrays: bool) -> str:
    kinds = {g.kind for g in guesses}
    if len(kinds) > 1:
        raise _ambiguous(name, f"mixed kinds {sorted(kinds)}")
    kind = kinds.pop()
    if kind != "array":
        return kind
    return _merge_dtype(name, guesses) + _merge_shape(name, guesses, fixed_arrays)


def infer_schema(
    records: Iterable[Record],
    *,
    fixed_arrays: bool = False,
    int_dtype: str = "int64",
    float_dtype: str = "float64",
) -> dict[str, str]:
    """Infer ``{name: spec}`` from sample records (field order of the first record).

    Args:
        records: a few records (say the first 100); at least one.
        fixed_arrays: arrays of equal shape in every sample are fixed-shape fields (true for
            rows of one numpy array; false for lists and per-row arrays of varying length).
        int_dtype: dtype for Python ints; float_dtype: dtype for Python floats.

    Raises ConfigError when there is no record or any field is ambiguous.

    >>> infer_schema([{"tokens": [1, 2], "label": 3, "text": "a"}, {"tokens": [4], "label": 5, "text": "b"}])
    {'tokens': 'int64[]', 'label': 'int64', 'text': 'str'}
    """
    samples = list(records)
    if not samples:
        raise ConfigError("schema inference: no records to infer from (expected --field NAME:SPEC)")
    names = list(samples[0])
    for i, record in enumerate(samples):
        if list(record) != names and set(record) != set(names):
            missing = sorted(set(names) ^ set(record))
            raise _ambiguous(missing[0], f"present in some records only (sample {i})")
    spec: dict[str, str] = {}
    for name in names:
        if any(r[name] is None for r in samples):
            raise _ambiguous(name, "null values")
        guesses = [_guess(name, r[name], int_dtype, float_dtype) for r in samples]
        spec[name] = _merge(name, guesses, fixed_arrays)
    return spec


def project_record(record: Record, fields: dict[str, Field]) -> Record:
    """The schema's fields of a record (others are ignored; a missing one fails in the
    writer). An empty list has no dtype of its own, so it gets the field's."""
    out = {}
    for name, field_ in fields.items():
        if name not in record:
            continue
        value = record[name]
        if isinstance(value, list) and field_.kind == "array":
            value = _list_array(value, field_)
        out[name] = value
    return out


def _list_array(value: list[Any], field_: Field) -> Any:
    """A JSON list as an array of the field's dtype when that changes no value; else as is
    (the writer then names the value that does not fit)."""
    if not value:
        return np.zeros((0, *field_.inner_shape), field_.dtype) if field_.is_variable else value
    code = _TYPECODES.get(field_.dtype)
    if code is not None and type(value[0]) is int:  # 1-D ints: one C loop, no min/max pass
        try:
            return np.frombuffer(typed_array(code, value), field_.dtype)
        except (OverflowError, TypeError):
            pass  # a float, a nested list or an out-of-range value: the checked path names it
    try:
        array = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ConfigError(f"field {field_.name!r}: {e} (expected {field_.spec})") from None
    target = field_.dtype
    if array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if info.min <= array.min() and array.max() <= info.max:
            return array.astype(target)
    return array


@functools.cache
def _fixed_bytes(field_: Field) -> int:
    return field_.unit_bytes


def max_record_bytes(record: Record, fields: dict[str, Field]) -> int | None:
    """At least the bytes a projected record adds to a shard (a str counts 4 per character),
    or None when only the writer can tell (a list, a missing field)."""
    total = 0
    for name, field_ in fields.items():
        value = record.get(name)
        if field_.kind == "str" and isinstance(value, str):
            total += 4 * len(value)
        elif field_.kind == "bytes" and isinstance(value, bytes):
            total += len(value)
        elif field_.kind == "array" and not field_.is_variable and value is not None:
            total += _fixed_bytes(field_)
        elif field_.kind == "array" and isinstance(value, np.ndarray):
            total += value.size * field_.dtype.itemsize
        else:
            return None
    return total
