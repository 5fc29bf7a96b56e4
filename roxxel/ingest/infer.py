"""Schema inference from the first records of an input, when the answer is unambiguous.

Python ints become ``int_dtype`` (int64 by default: JSON has no integer widths), or
``uint64`` when one is in [2**63, 2**64); an integer beyond that is refused, never made a
float. Floats become ``float_dtype`` (float64); numpy values keep their dtype; lists become variable-length arrays (``int64[]``,
``float64[,3]``); rows of one numpy array (npy/npz) become fixed-shape fields. Anything
that does not decide one spec (mixed kinds, only empty lists, a field missing from some
records, nested objects) raises ConfigError naming the sample it shows in and asking for
``--field NAME:SPEC``, with an example for every field; so does a null (no spec holds one:
the field is to be left out, or filled). Records are then projected onto the schema's
fields (JSON int lists become arrays of the field dtype; JSON ``true``/``false`` for a
number field, an integer out of the field's range, or a missing field raise ConfigError
naming the field).
"""

from __future__ import annotations

import functools
from array import array as typed_array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from roxxel.errors import ConfigError
from roxxel.format.schema import MAX_FIELD_NAME, MAX_RANK, Field, ragged_lists
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


_Kind = Literal["ambiguous", "convert", "ragged", "missing", "null", "range", "deep", "empty"]


class _Unclear(ValueError):
    """Why no one spec fits a field: ``why`` (what was found), the sample that shows it
    (``at``; None: the value guessed, placed by the caller), and ``kind``: "ambiguous"
    (--field decides), "convert" (values no one spec takes: --map makes them one),
    "ragged" (nested lists of different lengths), "missing" (from some records), "null"
    (no type holds one), "range" (no 64-bit integer holds it), "deep" (more dimensions
    than a field has) or "empty" (only empty inner lists: no dimension of 0 is taken)."""

    def __init__(self, why: str, at: int | None = None, kind: _Kind = "ambiguous") -> None:
        super().__init__(why)
        self.why, self.at, self.kind = why, at, kind


_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64_MAX = (1 << 64) - 1


def _python_dtype(leaves: list[Any], int_dtype: str, float_dtype: str) -> str:
    """The dtype of Python numbers: ``bool``; ints as ``int_dtype``, or ``uint64`` when one
    is in [2**63, 2**64); floats (ints among them) as ``float_dtype``. Raises _Unclear
    for an integer no 64-bit type holds, and for an integral float beyond 2**63 among ints
    (a JSON integer that a parser turned into a float)."""
    kinds = {type(v) for v in leaves}
    if kinds == {bool}:
        return "bool"
    if bool in kinds or not kinds <= {int, float}:
        raise _Unclear(f"values of types {sorted(k.__name__ for k in kinds)}", kind="convert")
    ints = [v for v in leaves if type(v) is int]
    if ints and (min(ints) < _INT64[0] or max(ints) > _UINT64_MAX):
        bad = min(ints) if min(ints) < _INT64[0] else max(ints)
        raise _Unclear(f"value {bad} does not fit a 64-bit integer", kind="range")
    if float in kinds:
        if ints and any(abs(v) >= 2.0**63 and v == int(v) for v in leaves if type(v) is float):
            raise _Unclear("ints mixed with integral floats beyond 2**63")
        return float_dtype
    return "uint64" if ints and max(ints) > _INT64[1] else int_dtype


def _guess(value: Any, int_dtype: str, float_dtype: str) -> _Guess:
    if isinstance(value, str):
        return _Guess("str", "", (), False)
    if isinstance(value, bytes | bytearray):
        return _Guess("bytes", "", (), False)
    if isinstance(value, bool | int | float | list):
        depth = _depth(value)
        if depth > MAX_RANK:  # before numpy: past its 64 dimensions it says "inhomogeneous"
            raise _Unclear(f"lists nested {depth} deep", kind="deep")
        try:
            objects = np.asarray(value, dtype=object)  # exact Python numbers, any size
            shape, leaves = objects.shape, objects.ravel().tolist()
            if any(isinstance(v, list) for v in leaves):
                raise ValueError
        except ValueError:
            raise _Unclear("inner lists of different lengths", kind="ragged") from None
        dtype = _python_dtype(leaves, int_dtype, float_dtype) if leaves else ""
        negative = any(type(v) is not bool and v < 0 for v in leaves)
        return _Guess("array", dtype, shape, True, negative)
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind not in "biuf":
            raise _Unclear(f"numpy dtype {value.dtype}", kind="convert")
        if value.ndim > MAX_RANK:
            raise _Unclear(f"arrays of {value.ndim} dimensions", kind="deep")
        return _Guess("array", value.dtype.name, np.shape(value), False)
    raise _Unclear(f"a {type(value).__name__} value", kind="convert")


def _depth(value: Any) -> int:
    """How deep lists nest along their first items (a field's dimensions), without numpy.

    >>> _depth(3), _depth([]), _depth([[]]), _depth([[[1, 2]], [[3, 4]]])
    (0, 1, 2, 3)
    """
    depth = 0
    while isinstance(value, list):
        depth += 1
        if not value:
            break
        value = value[0]
    return depth


def _word(guess: _Guess) -> str:
    """A guessed value's kind in words, for a message (not "array" for a JSON number)."""
    if guess.kind != "array":
        return "string" if guess.kind == "str" else guess.kind
    if guess.shape:
        return "list" if guess.from_python else "array"
    return "bool" if guess.dtype == "bool" else "number"


def _first_unlike(keys: list[Any]) -> int:
    """The index of the first key unlike the first one's (0 when all are alike).

    >>> _first_unlike(["str", "str", "array"])
    2
    """
    return next((i for i, k in enumerate(keys) if k != keys[0]), 0)


def _merge_dtype(guesses: list[_Guess]) -> str:
    dtypes = {g.dtype for g in guesses if g.dtype}
    if not dtypes:
        hollow = [i for i, g in enumerate(guesses) if 0 in g.shape[1:]]
        if hollow:  # [[]]: an inner length of 0, which no spec takes
            raise _Unclear(
                "only empty inner lists (e.g. [[]]) in the first records", hollow[0], "empty"
            )
        raise _Unclear("only empty lists in the first records", 0)
    if len(dtypes) == 1:
        return dtypes.pop()
    if all(g.from_python for g in guesses) and "bool" not in dtypes:
        floats = [d for d in dtypes if np.dtype(d).kind == "f"]
        if floats:
            return floats[0]  # ints mixed with floats
        if "uint64" in dtypes and not any(g.negative for g in guesses):
            return "uint64"  # non-negative ints, some beyond int64
    first = next(g.dtype for g in guesses if g.dtype)
    at = next(i for i, g in enumerate(guesses) if g.dtype and g.dtype != first)
    # Python numbers no one dtype holds (bools among numbers, negatives with ints past
    # int64) need converting; numpy values of several dtypes take a --field one exactly
    kind: _Kind = "convert" if all(g.from_python for g in guesses) else "ambiguous"
    raise _Unclear(f"dtypes {sorted(dtypes)}", at, kind)


def _merge_shape(guesses: list[_Guess], fixed_arrays: bool) -> str:
    shapes = {g.shape for g in guesses}
    ranks = {len(s) for s in shapes}
    if len(ranks) > 1:
        at = _first_unlike([len(g.shape) for g in guesses])
        raise _Unclear(f"ranks {sorted(ranks)}", at, "convert")
    rank = ranks.pop()
    if rank == 0:
        return ""
    if fixed_arrays and len(shapes) == 1:
        return "[" + ",".join(str(d) for d in shapes.pop()) + "]"
    inner = {s[1:] for s in shapes}
    if len(inner) > 1:
        at = _first_unlike([g.shape[1:] for g in guesses])
        raise _Unclear(f"inner shapes {sorted(inner)} differ between records", at, "ragged")
    return "[" + ",".join([""] + [str(d) for d in inner.pop()]) + "]"


def _field_spec(values: list[Any], fixed_arrays: bool, int_dtype: str, float_dtype: str) -> str:
    """The one spec of a field's sample values; raises _Unclear naming the sample."""
    nulls = [i for i, v in enumerate(values) if v is None]
    if nulls:
        raise _Unclear("null", nulls[0], "null")
    guesses = []
    for i, value in enumerate(values):
        try:
            guesses.append(_guess(value, int_dtype, float_dtype))
        except _Unclear as e:
            e.at = i
            raise
    kinds = {g.kind for g in guesses}
    if len(kinds) > 1:
        words = sorted({_word(g) for g in guesses})
        at = _first_unlike([g.kind for g in guesses])
        raise _Unclear(f"mixed kinds {words}", at, "convert")
    kind = kinds.pop()
    if kind != "array":
        return kind
    return _merge_dtype(guesses) + _merge_shape(guesses, fixed_arrays)


def _example(values: list[Any], int_dtype: str, float_dtype: str) -> str:
    """A spec for the first value that has one (a hint's example), else ``SPEC``. Empty
    inner lists (``[[]]``) give no inner length, and no spec takes 0: the first other
    value's spec, else one with ``N`` in its place (a placeholder the hint explains).

    >>> _example([None, "a", 1], "int64", "float64"), _example([[], [1.5]], "int64", "float64")
    ('str', 'int64[]')
    >>> _example([[[]], [[1.5]]], "int64", "float64"), _example([[[]]], "int64", "float64")
    ('float64[,1]', 'int64[,N]')
    """
    hollow = ""
    for value in values:
        try:
            guess = _guess(value, int_dtype, float_dtype)
        except _Unclear:
            continue
        if guess.kind != "array":
            return guess.kind
        dtype = guess.dtype or int_dtype
        if not guess.shape:
            return dtype
        inner = guess.shape[1:]
        spec = dtype + "[" + ",".join([""] + [str(d) if d else "N" for d in inner]) + "]"
        if 0 not in inner:
            return spec
        hollow = hollow or spec
    return hollow or "SPEC"


def infer_schema(
    records: Iterable[Record],
    *,
    fixed_arrays: bool = False,
    int_dtype: str = "int64",
    float_dtype: str = "float64",
    given: Mapping[str, str] | None = None,
    where: Callable[[int], str] | None = None,
) -> dict[str, str]:
    """Infer ``{name: spec}`` from sample records (field order of the first record).

    Args:
        records: a few records (say the first 100); at least one.
        fixed_arrays: arrays of equal shape in every sample are fixed-shape fields (true for
            rows of one numpy array; false for lists and per-row arrays of varying length).
        int_dtype: dtype for Python ints; float_dtype: dtype for Python floats.
        given: the specs of fields the pack makes itself (token ids, pixels): ``--field``
            gives the whole schema, so a hint's example lists them first.
        where: the place of sample i in its input (``file:line``), for messages.

    Raises ConfigError when there is no record or any field is ambiguous, naming the sample
    it shows in and with a ``--field`` example for every field.

    >>> infer_schema([{"tokens": [1, 2], "label": 3, "text": "a"}, {"tokens": [4], "label": 5, "text": "b"}])
    {'tokens': 'int64[]', 'label': 'int64', 'text': 'str'}
    """
    samples = list(records)
    if not samples:
        raise ConfigError("schema inference: no records to infer from (expected --field NAME:SPEC)")

    def place(i: int) -> str:
        return f"{where(i)}: " if where is not None else f"sample {i}: "

    _check_names(samples, place)
    names = list(samples[0])
    if not names and not given:  # `{}` (where the pack makes no field itself: an image or
        # token pack infers only the fields besides its own): refused naming its place
        raise ConfigError(
            f"{place(0)}schema inference: the record has no fields (expected at least one "
            "field to infer the schema from: drop such records with --map, or pass --field "
            "NAME:SPEC for the other records' fields with --skip-bad to skip them)"
        )
    specs: dict[str, str | _Unclear] = {}
    for name in names:
        values = [r[name] for r in samples if name in r]
        try:
            specs[name] = _field_spec(values, fixed_arrays, int_dtype, float_dtype)
        except _Unclear as e:
            specs[name] = e
    unclear = _missing(samples, names) or next(
        ((n, e) for n, e in specs.items() if isinstance(e, _Unclear)), None
    )
    if unclear is None:
        return {n: s for n, s in specs.items() if isinstance(s, str)}
    name, e = unclear
    flags = {**(given or {}), **{n: s if isinstance(s, str) else "SPEC" for n, s in specs.items()}}
    flags[name] = _example([r[name] for r in samples if name in r], int_dtype, float_dtype)
    at = e.at or 0
    raise ConfigError(f"{place(at)}schema inference: field {name!r} {_refusal(name, e, flags)}")


def _check_names(samples: list[Record], place: Callable[[int], str]) -> None:
    """Refuse a field name no schema takes (a space, ``:``, a leading ``-``, non-ASCII, a
    newline: `Field.parse`'s rule), naming the first sample holding it: neither --field
    nor --schema can give it, so the hint is --map (``name`` shown as its repr)."""
    seen: set[str] = set()
    for i, record in enumerate(samples):
        for name in record:
            if name in seen:
                continue
            try:
                Field.parse(name, "str")
            except ConfigError:
                raise ConfigError(
                    f"{place(i)}schema inference: field {name!r} has a name no schema takes "
                    f"(expected [A-Za-z_][A-Za-z0-9_.-]*, at most {MAX_FIELD_NAME} characters:"
                    " rename it with --map, or leave it out: pass --field NAME:SPEC for the "
                    "other fields)"
                ) from None
            seen.add(name)


def _missing(samples: list[Record], names: list[str]) -> tuple[str, _Unclear] | None:
    """The first field some sample lacks (or has beyond the first's), with that sample."""
    for i, record in enumerate(samples):
        if list(record) != names and set(record) != set(names):
            missing = sorted(set(names) ^ set(record))
            return missing[0], _Unclear("present in some records only", i, "missing")
    return None


def _refusal(name: str, e: _Unclear, flags: dict[str, str]) -> str:
    """What is wrong with field ``name`` and how to pack it: ``--field`` for every field in
    ``flags`` (the whole schema, ``name`` as its example spec)."""
    if e.kind == "range":
        return f"{e.why} (expected int64 or uint64 values)"
    if e.kind == "null":
        others = " ".join(f"--field {n}:{s}" for n, s in flags.items() if n != name)
        return (
            "is null (expected a value: no field type holds a null; leave the field out (pass "
            f"--field NAME:SPEC for the others{', e.g. ' + others if others else ''}), or fill "
            "its nulls with --map)"
        )
    example = " ".join(f"--field {n}:{s}" for n, s in flags.items())
    more = " and the other fields" if len(flags) > 1 else ""
    skip = f"or pass --field {name}:SPEC{more} with --skip-bad to skip the records"
    if e.kind == "missing":  # --field alone fails on the first record without it
        return (
            f"is missing from some records (expected it in every record: fill it in with "
            f"--map, or leave it out (pass --field NAME:SPEC for the others), {skip} without "
            f"it, e.g. {example})"
        )
    if e.kind == "deep":
        return (
            f"holds {e.why} (expected at most {MAX_RANK} dimensions: flatten or reshape them "
            f"with --map, {skip} holding them, e.g. {example})"
        )
    if e.kind == "empty":
        return (
            f"holds {e.why} (expected inner lists of 1..2**32 values, and values to take a "
            f"dtype from: pad or flatten them with --map, {skip} holding them, e.g. {example},"
            " N the inner lists' length)"
        )
    if e.kind == "ragged":
        return (
            f"holds ragged nested lists ({e.why}, expected inner lists of one length: only a "
            f"field's first dimension varies; pad or flatten them with --map, {skip} holding "
            f"them, e.g. {example})"
        )
    if e.kind == "convert":  # no --field spec takes them all
        return (
            f"is ambiguous ({e.why}, expected values of one type in every record: convert "
            f"them to one with --map, {skip} unlike it, e.g. {example})"
        )
    return (
        f"is ambiguous ({e.why}, expected one clear type: pass --field {name}:SPEC{more}, "
        f"e.g. {example})"
    )


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
    except ValueError:  # ragged nested lists: numpy's words are "inhomogeneous shape"
        depth = _depth(value)
        if depth > MAX_RANK:  # past numpy's 64 dimensions, not ragged
            raise ConfigError(
                f"field {field_.name!r} holds lists nested {depth} deep (expected "
                f"{field_.spec}: at most {MAX_RANK} dimensions)"
            ) from None
        raise ConfigError(ragged_lists(field_)) from None
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
