"""Schema inference from the first records of an input, when the answer is unambiguous.

Python ints become ``int_dtype`` (int64 by default: JSON has no integer widths), or
``uint64`` when one is in [2**63, 2**64); an integer beyond that is refused, never made a
float. Floats become ``float_dtype`` (float64); numpy values keep their dtype; lists become variable-length arrays (``int64[]``,
``float64[,3]``); rows of one numpy array (npy/npz) become fixed-shape fields. Anything
that does not decide one spec (mixed kinds, only empty lists, a field missing from some
records, nested objects) raises ConfigError asking for ``--field NAME:SPEC``. Records are
then projected onto the schema's fields (JSON int lists become arrays of the field dtype;
JSON ``true``/``false`` for a number field, an integer out of the field's range, or a
missing field raise ConfigError naming the field).
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
    negative: bool = False  # a Python number below zero


def _ambiguous(name: str, why: str) -> ConfigError:
    return ConfigError(
        f"schema inference: field {name!r} is ambiguous ({why}, expected one clear type: "
        f"pass --field {name}:SPEC, e.g. --field {name}:int32[])"
    )


_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64_MAX = (1 << 64) - 1


def _python_dtype(name: str, leaves: list[Any], int_dtype: str, float_dtype: str) -> str:
    """The dtype of Python numbers: ``bool``; ints as ``int_dtype``, or ``uint64`` when one
    is in [2**63, 2**64); floats (ints among them) as ``float_dtype``. Raises ConfigError
    for an integer no 64-bit type holds, and for an integral float beyond 2**63 among ints
    (a JSON integer that a parser turned into a float)."""
    kinds = {type(v) for v in leaves}
    if kinds == {bool}:
        return "bool"
    if bool in kinds or not kinds <= {int, float}:
        raise _ambiguous(name, f"values of types {sorted(k.__name__ for k in kinds)}")
    ints = [v for v in leaves if type(v) is int]
    if ints and (min(ints) < _INT64[0] or max(ints) > _UINT64_MAX):
        bad = min(ints) if min(ints) < _INT64[0] else max(ints)
        raise ConfigError(
            f"schema inference: field {name!r} value {bad} does not fit a 64-bit integer "
            f"(expected int64 or uint64 values)"
        )
    if float in kinds:
        if ints and any(abs(v) >= 2.0**63 and v == int(v) for v in leaves if type(v) is float):
            raise _ambiguous(name, "ints mixed with integral floats beyond 2**63")
        return float_dtype
    return "uint64" if ints and max(ints) > _INT64[1] else int_dtype


def _guess(name: str, value: Any, int_dtype: str, float_dtype: str) -> _Guess:
    if isinstance(value, str):
        return _Guess("str", "", (), False)
    if isinstance(value, bytes | bytearray):
        return _Guess("bytes", "", (), False)
    if isinstance(value, bool | int | float | list):
        try:
            objects = np.asarray(value, dtype=object)  # exact Python numbers, any size
            shape, leaves = objects.shape, objects.ravel().tolist()
            if any(isinstance(v, list) for v in leaves):
                raise ValueError
        except ValueError:
            raise _ambiguous(name, "ragged nested lists") from None
        dtype = _python_dtype(name, leaves, int_dtype, float_dtype) if leaves else ""
        negative = any(type(v) is not bool and v < 0 for v in leaves)
        return _Guess("array", dtype, shape, True, negative)
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
        floats = [d for d in dtypes if np.dtype(d).kind == "f"]
        if floats:
            return floats[0]  # ints mixed with floats
        if "uint64" in dtypes and not any(g.negative for g in guesses):
            return "uint64"  # non-negative ints, some beyond int64
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
    """The schema's fields of a record (others are ignored). An empty list has no dtype of
    its own, so it gets the field's. Raises ConfigError naming a missing field and the
    fields the record has (a misspelt ``--field`` shows at once)."""
    out = {}
    for name, field_ in fields.items():
        if name not in record:
            raise ConfigError(
                f"field {name!r} missing from the record (its fields: {sorted(record)}, "
                f"expected every schema field)"
            )
        value = record[name]
        if isinstance(value, list) and field_.kind == "array":
            value = _list_array(value, field_)
        elif type(value) is bool or type(value) is int:
            _check_python_number(value, field_)
        out[name] = value
    return out


def _check_python_number(value: int, field_: Field) -> None:
    """Refuse a JSON ``true``/``false`` for a number field, and name an integer that does
    not fit the field's integer dtype (numpy would make an object or float array of it)."""
    dtype = field_.dtype
    if field_.kind != "array" or dtype.kind == "b":
        return
    if type(value) is bool:
        raise ConfigError(
            f"field {field_.name!r}: JSON {str(value).lower()} (expected a number: {field_.spec})"
        )
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise ConfigError(
                f"field {field_.name!r}: value {value} does not fit {dtype.name} "
                f"(expected {info.min}..{info.max})"
            )


def _list_array(value: list[Any], field_: Field) -> Any:
    """A JSON list as an array of the field's dtype when that changes no value; else as is
    (the writer then names the value that does not fit)."""
    if not value:
        return np.zeros((0, *field_.inner_shape), field_.dtype) if field_.is_variable else value
    code = _TYPECODES.get(field_.dtype)
    if code is not None and type(value[0]) is int:  # 1-D ints: one C loop, no min/max pass
        try:
            array = np.frombuffer(typed_array(code, value), field_.dtype)
        except (OverflowError, TypeError):
            pass  # a float, a nested list or an out-of-range value: the checked path names it
        else:
            _refuse_bools(value, array, field_)
            return array
    try:
        array = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ConfigError(f"field {field_.name!r}: {e} (expected {field_.spec})") from None
    target = field_.dtype
    if array.size == 0:  # e.g. [[]]: no value to check; the writer judges the shape
        return array.astype(target)
    if target.kind != "b":
        _refuse_bools(value, array, field_)
    if array.dtype.kind == "f" and target.kind in "iu":
        fraction = array != np.round(array)
        at = np.argmax(fraction) if fraction.any() else np.argmax(np.abs(array))
        bad = array.flat[int(at)]
        raise ConfigError(
            f"field {field_.name!r}: value {bad} does not fit {target.name} (a float, or "
            f"a JSON integer beyond 64 bits; expected {field_.spec})"
        )
    if array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if info.min <= array.min() and array.max() <= info.max:
            return array.astype(target)
    return array


def _refuse_bools(value: list[Any], array: np.ndarray, field_: Field) -> None:
    """Refuse a JSON true/false among numbers: Python and numpy read them as 1 and 0, so
    only the values 0 and 1 are looked at (the rest of a long list costs one numpy pass)."""
    if array.dtype.kind == "b":
        found = True
    elif array.dtype.kind not in "iuf":
        return
    else:
        zero_one = _zero_or_one(array)
        if array.ndim == 1 and len(value) == len(array):
            found = any(type(value[i]) is bool for i in np.flatnonzero(zero_one).tolist())
        else:
            found = bool(zero_one.any()) and _holds_bool(value)
    if found:
        raise ConfigError(
            f"field {field_.name!r}: JSON true/false (expected numbers: {field_.spec})"
        )


def _zero_or_one(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind in "iu":  # one compare: negatives read as unsigned are large
        return array.view(f"u{array.dtype.itemsize}") <= 1
    return (array == 0) | (array == 1)


def _holds_bool(value: list[Any]) -> bool:
    return any(type(v) is bool or (type(v) is list and _holds_bool(v)) for v in value)


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
