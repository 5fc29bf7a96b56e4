"""What one step of a `Loader` reads, row by row: a look at a batch before training.

`peek_step` asks a loader's `StepPicker` what its pipeline asks (``pick``, then ``fill``
into fresh host buffers), so the rows it lists are exactly those the loader yields at that
step, before any host or device transform. Each row comes with its source, its record
and the values of one field cut to the record's length (a fixed-shape field of several
dimensions, such as an image, has a shape but no length); byte-level values (a ``str``
field, uint8 tokens) also come back as text, and so do tokens when a ``decode`` function
(a tokenizer's) is given. No jax: it reads host arrays only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from roxxel.errors import ConfigError, check_int
from roxxel.format.dataset import Dataset
from roxxel.loader.host import RowSpec
from roxxel.loader.steps import MixturePicker, SinglePicker, StepPicker
from roxxel.protocols import Source
from roxxel.sampling.mixture import Mixture
from roxxel.sources.records import Records
from roxxel.sources.windows import TokenWindows

__all__ = ["Decode", "PeekRow", "peek_step", "shown_field", "source_name", "text_of"]

PeekRow = dict[str, Any]
"""One row of a step: ``row``, ``source`` (name), ``record`` (index in that source: a window
index for token windows), ``length`` (a variable-length field's record length, a fixed
field's number of values, 1 for a scalar; None for a fixed shape of several dimensions,
e.g. ``uint8[3,64,64]``, whose first dimension is no length), ``field``, ``values``
(numpy, a variable-length field's cut to ``length``) and ``text`` (str, or None)."""

Decode = Callable[[list[int]], str]
"""Token ids -> text, e.g. a tokenizer's ``decode``."""

_LENGTH = ".length"


def peek_step(
    picker: StepPicker,
    step: int,
    num_rows: int | None = None,
    *,
    field: str | None = None,
    decode: Decode | None = None,
) -> list[PeekRow]:
    """The rows `picker` fills at `step` (the first `num_rows`, or all), one dict each:
    rows of the global batch, whatever this process's devices hold.

    Padding rows (past the end of a finite stream) are left out; a step past the end
    gives ``[]``. `field` defaults to the first variable-length field, else the first one.
    Costs one read of those rows. Shares the picker's step cache with a running pipeline
    thread: its entries are pure values of the step, so either thread may fill it.

    Raises:
        ConfigError: a negative step, ``num_rows`` < 1, or a field the batch does not have.
    """
    step = check_int("peek: step", step, low=0, high=(1 << 63) - 1)
    batch_size = picker.batch_size_at(step)
    count = batch_size
    if num_rows is not None:
        count = min(check_int("peek: rows", num_rows, low=1), batch_size)
    pick = picker.pick(step, np.arange(count, dtype=np.int64))
    if pick is None:
        return []
    spec = picker.row_spec_at(step, {})
    name = shown_field(spec, field)
    host = {n: np.zeros((count, *shape), dtype) for n, shape, dtype in spec.fields}
    picker.fill(pick, host)
    names, sources = _sources(picker)
    lengths = host.get(name + _LENGTH)
    rows = []
    for i in range(pick.num_read):
        source_id = int(pick.source_ids[i])
        values = host[name][i]
        # an image's first dimension (its channels, or its height) is no length
        length = values.size if values.ndim < 2 else None
        if lengths is not None:
            length = int(lengths[i])
            values = values[:length]
        binary = _is_binary(sources[source_id], name)
        text = None if binary else text_of(values, decode)
        rows.append(
            {
                "row": i,
                "source": names[source_id],
                "record": int(pick.records[i]),
                "length": length,
                "field": name,
                "values": values,
                "text": text,
            }
        )
    return rows


def shown_field(spec: RowSpec, field: str | None) -> str:
    """`field`, checked against the batch's fields; by default the first variable-length
    field (the one with a ``"<name>.length"`` beside it), else the first field.

    >>> spec = RowSpec.of({"id": ((), "int64"), "tokens": ((8,), "int32"),
    ...                    "tokens.length": ((), "int64")})
    >>> shown_field(spec, None), shown_field(spec, "id")
    ('tokens', 'id')
    """
    lengths = {n + _LENGTH for n in spec.names}
    names = [n for n in spec.names if n not in lengths]
    if field is None:
        variable = [n for n in names if n + _LENGTH in spec.names]
        return (variable or names)[0]
    if field not in names:
        raise ConfigError(f"peek: unknown field ({field!r}, expected one of {names})")
    return field


def text_of(values: np.ndarray, decode: Decode | None = None) -> str | None:
    """`values` as text: UTF-8 for uint8 (byte-level) values, `decode` for other integer
    tokens; None for anything else (floats, images, several dimensions).

    >>> text_of(np.frombuffer(b"hi \\xe2\\x9c\\x93", np.uint8)), text_of(np.arange(3))
    ('hi ✓', None)
    >>> text_of(np.arange(3), decode=lambda ids: "-".join(map(str, ids)))
    '0-1-2'
    """
    if values.ndim != 1:
        return None
    if values.dtype == np.uint8:
        return values.tobytes().decode("utf-8", errors="replace")
    if decode is not None and values.dtype.kind in "iu":
        return decode(values.tolist())
    return None


def _sources(picker: StepPicker) -> tuple[Sequence[str], Sequence[Source]]:
    """Name and source of each source id of `picker`."""
    if isinstance(picker, MixturePicker):
        mixture, sources = picker.mixture, picker.sources
        if isinstance(mixture, Mixture):
            return mixture.names, sources
        return [f"source {i}" for i in range(len(sources))], sources
    if isinstance(picker, SinglePicker):
        return [source_name(picker.source)], [picker.source]
    raise ConfigError(
        f"peek: unknown step picker ({type(picker).__name__}, expected a loader's own)"
    )


def source_name(source: Source) -> str:
    """A single source's name: its dataset's folder name (``.`` names the folder it is),
    or the last part of its URL; else its type's name."""
    if isinstance(source, Records | TokenWindows) and isinstance(source.dataset, Dataset):
        return source.dataset.name
    return type(source).__name__


def _is_binary(source: Source, name: str) -> bool:
    """Whether `name` is a ``bytes`` field of a records source: uint8 codes, not text."""
    return isinstance(source, Records) and any(
        f.name == name and f.kind == "bytes" for f in source.fields
    )
