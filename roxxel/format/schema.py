"""Fields and schemas: what a record holds, spelled as short strings, and records -> bytes.

A field spec is ``dtype`` (a scalar), ``dtype[d0,d1,...]`` (a fixed shape),
``dtype[]`` or ``dtype[,d1,...]`` (a variable leading dimension), ``bytes`` or ``str``.
Dtypes come from a fixed allow-list; nothing else (no object dtypes, no pickle) exists.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from roxxel.errors import ConfigError

__all__ = ["CODECS", "Codec", "Field", "Ragged", "Schema", "parse_codec"]

NUMERIC_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
)
CODECS = ("none", "zstd")
MAX_FIELD_NAME = 128
MAX_RANK = 8
MAX_DIM = 1 << 32
MAX_UNIT_BYTES = 1 << 40  # one fixed-shape record, or one element of a variable one
_SPEC = re.compile(r"^([a-z0-9]+)(?:\[([0-9,]*)\])?$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")

Kind = Literal["array", "bytes", "str"]


def numpy_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype for an allow-listed dtype name."""
    if name == "bfloat16":
        import ml_dtypes  # optional weight: loaded only for bfloat16 fields

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


@dataclass(frozen=True, slots=True)
class Codec:
    """How a field's record bytes are stored: raw (``none``) or zstd at a level."""

    name: Literal["none", "zstd"] = "none"
    level: int = 3

    @property
    def spec(self) -> str:
        return "none" if self.name == "none" else f"zstd:{self.level}"


def parse_codec(spec: str | Codec, where: str = "codec") -> Codec:
    """Parse ``"none"``, ``"zstd"`` or ``"zstd:LEVEL"`` (LEVEL in 1..22).

    >>> parse_codec("zstd:5")
    Codec(name='zstd', level=5)
    """
    if isinstance(spec, Codec):
        return spec
    name, _, level = str(spec).partition(":")
    if name == "none" and not level:
        return Codec()
    if name == "zstd":
        if not level:
            return Codec("zstd")
        if level.isdigit() and 1 <= int(level) <= 22:
            return Codec("zstd", int(level))
    raise ConfigError(f"{where}: unknown codec ({spec!r}, expected none, zstd or zstd:1..22)")


@dataclass(frozen=True, slots=True)
class Field:
    """One named field of a record: a dtype and a shape whose leading dim may be variable.

    ``shape`` holds ``None`` for the variable leading dimension. ``bytes`` and ``str``
    fields are variable-length uint8 data (``str`` is UTF-8). Derived once, at
    construction (every batch read asks for them):

    Attributes:
        inner_shape: the shape of one element along the variable dimension (or the whole
            fixed shape).
        unit_bytes: bytes of one element along the variable dimension, or of a whole fixed
            record.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]
    kind: Kind = "array"
    inner_shape: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    unit_bytes: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims = self.shape[1:] if self.is_variable else self.shape
        inner = tuple(int(d) for d in dims if d is not None)
        object.__setattr__(self, "inner_shape", inner)
        object.__setattr__(self, "unit_bytes", self.dtype.itemsize * math.prod(inner))

    @classmethod
    def parse(cls, name: str, spec: str) -> Field:
        """Parse one field spec such as ``"int32[]"`` or ``"uint8[3,64,64]"``.

        >>> Field.parse("tokens", "int32[]").shape
        (None,)
        """
        if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_FIELD_NAME:
            raise ConfigError(f"field {name!r}: bad name (expected [A-Za-z_][A-Za-z0-9_.-]*)")
        if spec in ("bytes", "str"):
            return cls(name, np.dtype(np.uint8), (None,), spec)
        match = _SPEC.match(spec) if isinstance(spec, str) else None
        if match is None or match.group(1) not in NUMERIC_DTYPES:
            raise ConfigError(
                f"field {name!r}: bad spec ({spec!r}, expected one of {', '.join(NUMERIC_DTYPES)},"
                " bytes or str, optionally with a shape like [3,64,64], [] or [,4])"
            )
        field = cls(name, numpy_dtype(match.group(1)), _parse_shape(name, match.group(2)))
        if field.unit_bytes > MAX_UNIT_BYTES:
            what = "an element" if field.is_variable else "a record"
            raise ConfigError(
                f"field {name!r}: {what} of {spec} is too large ({field.unit_bytes} bytes,"
                f" expected at most {MAX_UNIT_BYTES} = 2**40)"
            )
        return field

    @property
    def is_variable(self) -> bool:
        return bool(self.shape) and self.shape[0] is None

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """The shape of a fixed-shape field's record (ConfigError for a variable field)."""
        if self.is_variable:
            raise ConfigError(f"field {self.name!r}: variable-length ({self.spec}), no fixed shape")
        return self.inner_shape

    @property
    def spec(self) -> str:
        if self.kind != "array":
            return self.kind
        name = "bfloat16" if self.dtype.name == "bfloat16" else self.dtype.name
        if not self.shape:
            return name
        return f"{name}[{','.join('' if d is None else str(d) for d in self.shape)}]"

    def to_bytes(self, value: Any, where: str) -> memoryview:
        """Check one value against this field and return its raw little-endian bytes.

        Raises ConfigError when the value has the wrong type or shape, or when a value
        would change on conversion (70000 into uint16, 0.5 into int32): never a silent cast.
        """
        if self.kind == "str":
            if not isinstance(value, str):
                raise ConfigError(f"{where}: field {self.name!r} wants str ({_type_word(value)})")
            return memoryview(value.encode("utf-8"))
        if self.kind == "bytes":
            if isinstance(value, bytes | bytearray | memoryview):
                return memoryview(value).cast("B")
            if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
                return _raw(value)
            raise ConfigError(f"{where}: field {self.name!r} wants bytes ({_type_word(value)})")
        array = _exact_cast(_as_array(value, self, where), self, where)
        self._check_shape(array.shape, where)
        return _raw(array)

    def batch_to_bytes(self, values: Any, num: int, where: str) -> memoryview:
        """Check ``num`` fixed-shape values stacked as one array; return their raw bytes."""
        array = _exact_cast(_as_array(values, self, where), self, where)
        if array.shape != (num, *self.shape):
            raise ConfigError(
                f"{where}: field {self.name!r} batch of shape {array.shape}"
                f" (expected ({num}, ...) of {self.spec})"
            )
        return _raw(array)

    def ragged_to_bytes(self, ragged: Ragged, num: int, where: str) -> tuple[memoryview, list[int]]:
        """Check ``num`` variable-length records given as one `Ragged`; return their bytes
        back to back (a view when ``values`` already has the field's dtype) and each size."""
        if self.kind != "array" or not isinstance(ragged, Ragged):
            raise ConfigError(f"{where}: field {self.name!r} takes Ragged values ({self.spec})")
        values = _exact_cast(np.asarray(ragged.values), self, where)
        lengths = np.asarray(ragged.lengths)
        ok = lengths.dtype.kind in "iu" and lengths.shape == (num,) and (lengths >= 0).all()
        if not ok or int(lengths.sum()) != len(values) or values.shape[1:] != self.inner_shape:
            raise ConfigError(
                f"{where}: field {self.name!r} Ragged of {len(values)} elements {values.shape[1:]}"
                f" with lengths {lengths.shape} (expected {num} lengths >= 0 summing to it)"
            )
        return _raw(values), (lengths.astype(np.int64) * self.unit_bytes).tolist()

    def records_to_bytes(self, values: Any, first: int, where: str) -> list[memoryview]:
        """Check the values of records ``first``.. of a variable-length field; return each
        one's raw bytes (views of the given arrays where they already fit exactly)."""
        dims, dtype, inner = len(self.shape), self.dtype, self.inner_shape
        arrays = list(values)
        exact = (
            self.kind == "array"
            and dtype != np.bool_
            and all(
                type(a) is np.ndarray
                and a.ndim == dims
                and a.dtype == dtype
                and a.shape[1:] == inner
                and a.flags.c_contiguous
                for a in arrays
            )
        )
        if exact:
            return [memoryview(a) for a in arrays]  # pyright: ignore[reportArgumentType]
        return [self.to_bytes(v, f"{where}: record {first + i}") for i, v in enumerate(arrays)]

    def _check_shape(self, shape: tuple[int, ...], where: str) -> None:
        expected = self.shape
        ok = len(shape) == len(expected) and all(
            e is None or e == s for e, s in zip(expected, shape, strict=True)
        )
        if not ok:
            raise ConfigError(
                f"{where}: field {self.name!r} has shape {shape} (expected {self.spec})"
            )


def _as_array(value: Any, field: Field, where: str) -> np.ndarray:
    """``np.asarray(value)``, or ConfigError for nested lists of different lengths (numpy's
    words: "setting an array element with a sequence ... inhomogeneous shape")."""
    try:
        return np.asarray(value)
    except ValueError:
        raise ConfigError(f"{where}: {ragged_lists(field)}") from None


def ragged_lists(field: Field) -> str:
    """The refusal of ragged nested lists (``[[1, 2], [3]]``) for ``field``."""
    return (
        f"field {field.name!r} holds ragged nested lists (inner lists of different "
        f"lengths, expected {field.spec}: only a field's first dimension varies, its inner "
        f"lists are all of one length)"
    )


def _type_word(value: Any) -> str:
    """A value's type in words: ``null`` for None (a JSON null), else its type's name."""
    return "null" if value is None else type(value).__name__


def _raw(array: np.ndarray) -> memoryview:
    """The bytes of an array, C order, as a flat memoryview (works for empty arrays too)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # pyright: ignore[reportArgumentType]


def _parse_shape(name: str, dims: str | None) -> tuple[int | None, ...]:
    if dims is None:
        return ()
    parts = dims.split(",")
    shape: list[int | None] = []
    for i, part in enumerate(parts):
        if part == "" and i == 0:
            shape.append(None)
        elif part.isdigit() and 0 < int(part) <= MAX_DIM:
            shape.append(int(part))
        else:
            raise ConfigError(
                f"field {name!r}: bad dimension {part!r} in [{dims}] (expected 1..2**32)"
            )
    if len(shape) > MAX_RANK:
        raise ConfigError(f"field {name!r}: rank {len(shape)} (expected at most {MAX_RANK})")
    return tuple(shape)


def _is_float(dtype: np.dtype) -> bool:
    # bfloat16 (ml_dtypes) has kind "V"; test the cheap kind before the costly name.
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name == "bfloat16")


# what a value whose dtype no number field takes is, in words (not numpy's '<U2')
_KIND_WORDS = {"U": "string", "S": "bytes", "O": "object", "M": "datetime", "m": "timedelta"}


def _kind_words(array: np.ndarray) -> str:
    """``_KIND_WORDS`` of an array's dtype; ``null`` for an object array holding a None (a
    JSON null, which numpy holds as an object)."""
    if array.dtype.kind == "O" and any(v is None for v in array.flat):
        return "null"
    return _KIND_WORDS.get(array.dtype.kind, array.dtype.name)


def _exact_cast(array: np.ndarray, field: Field, where: str) -> np.ndarray:
    target = field.dtype
    if array.dtype == target == np.bool_:  # a bool viewed from other bytes: store 0 or 1 (R18)
        as_bytes = array.view(np.uint8)
        return as_bytes != 0 if as_bytes.max(initial=0) > 1 else array
    if array.dtype == target:
        return array
    if array.size == 0 and array.dtype.kind in "biuf":  # [] parses as float64: no value changes
        return array.astype(target)
    src = array.dtype
    if not (src.kind in "biu" or _is_float(src)) or (target.kind in "biu" and _is_float(src)):
        raise ConfigError(
            f"{where}: field {field.name!r} got {_kind_words(array)} values (expected {field.spec})"
        )
    if _is_float(target) and _is_float(src):
        return _float_cast(array, field, where)
    with np.errstate(all="ignore"):
        cast = array.astype(target)
        same = np.array_equal(cast.astype(src), array)
        same = same and np.array_equal(cast.astype(np.float64) < 0, array.astype(np.float64) < 0)
    if not same:
        bad = array.flat[int(np.argmax(cast.astype(src) != array))] if array.size else array
        raise ConfigError(f"{where}: field {field.name!r} value {bad} does not fit {target.name}")
    return cast


def _float_cast(array: np.ndarray, field: Field, where: str) -> np.ndarray:
    """A float cast that may round (the precision the user asked for) but never overflow: a
    finite value that becomes +-inf is refused; an inf or nan given stays what it is."""
    with np.errstate(over="ignore"):
        cast = array.astype(field.dtype)
    if field.dtype.itemsize > array.dtype.itemsize or np.isfinite(cast).all():
        return cast
    overflow = ~np.isfinite(cast) & np.isfinite(array)
    if overflow.any():
        bad = array.flat[int(np.argmax(overflow))]
        raise ConfigError(
            f"{where}: field {field.name!r} value {bad} does not fit {field.dtype.name} "
            f"(overflows to inf, expected a finite value within {field.dtype.name}'s range)"
        )
    return cast


@dataclass(frozen=True, slots=True)
class Ragged:
    """Many variable-length records of one field as one array, for ``write_batch``.

    ``values`` holds the records back to back along the variable dimension and
    ``lengths`` each record's length in elements: the layout tokenized corpora usually
    come in (Megatron ``.bin/.idx``, Arrow list arrays), written with one copy.

    >>> Ragged(np.arange(5), np.array([2, 0, 3])).lengths.tolist()
    [2, 0, 3]
    """

    values: Any
    lengths: Any

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True, slots=True)
class Schema:
    """An ordered set of fields. Parse with ``Schema.parse({"tokens": "int32[]", ...})``."""

    fields: tuple[Field, ...]

    @classmethod
    def parse(cls, specs: Mapping[str, str] | Schema) -> Schema:
        """Build a schema from ``{name: spec}``.

        >>> Schema.parse({"tokens": "int32[]", "label": "int64"}).to_json()
        {'tokens': 'int32[]', 'label': 'int64'}
        """
        if isinstance(specs, Schema):
            return specs
        if not isinstance(specs, Mapping) or not specs:
            raise ConfigError(f"schema: expected a non-empty mapping of name -> spec ({specs!r})")
        return cls(tuple(Field.parse(name, spec) for name, spec in specs.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def to_json(self) -> dict[str, str]:
        return {f.name: f.spec for f in self.fields}

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def select(self, names: Sequence[str] | None) -> tuple[Field, ...]:
        """The fields with these names, in the order given (all fields for None)."""
        if names is None:
            return self.fields
        names = list(names)  # an iterator is read once, here
        by_name = {f.name: f for f in self.fields}
        unknown = [n for n in names if not isinstance(n, str) or n not in by_name]
        if unknown:
            raise ConfigError(
                f"schema: unknown fields {unknown} (expected some of {list(by_name)})"
            )
        return tuple(by_name[n] for n in names)
