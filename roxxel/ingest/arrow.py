"""Arrow-family inputs: Parquet, Arrow IPC / Feather files and streams, HF ``save_to_disk``.

pyarrow is an optional extra, imported only when one of these readers runs. A Parquet piece
is a range of row groups and an Arrow IPC file piece a range of record batches; an Arrow
stream (what ``datasets.Dataset.save_to_disk`` writes) is one piece. A Hugging Face dataset
directory is read from its ``state.json`` and Arrow files alone, without ``datasets``.
Nulls are refused (a null would otherwise become NaN or a missing value silently).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from roxxel.errors import ConfigError, load_json
from roxxel.ingest.units import (
    BadRecords,
    Block,
    Input,
    InputKind,
    Piece,
    ReadOptions,
    Record,
    check_range,
    not_a_regular_file,
    row_pieces,
)

__all__ = [
    "ARROW",
    "HF",
    "PARQUET",
    "arrow_pieces",
    "arrow_schema",
    "check_image_columns",
    "hf_class_names",
    "hf_files",
    "parquet_pieces",
    "parquet_schema",
    "read_arrow",
    "read_arrow_blocks",
    "read_parquet",
    "read_parquet_blocks",
]


def _pyarrow() -> ModuleType:
    try:
        import pyarrow  # optional extra: only these readers need it
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            "pyarrow is not installed (needed for parquet/arrow/hf inputs: pip install roxxel[arrow])"
        ) from None
    return pyarrow


def parquet_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """Ranges of row groups of about ``unit_bytes`` file bytes."""
    pa = _pyarrow()
    try:
        num_groups = pa.parquet.ParquetFile(path).metadata.num_row_groups
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not a readable Parquet file ({e})") from None
    return row_pieces(path, "parquet", num_groups, unit_bytes)


def read_parquet(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield one record per row of the piece's row groups, with the row number in the file."""
    for block in read_parquet_blocks(piece, opts, bad):
        yield from block.records()


def read_parquet_blocks(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[Block]:
    """The rows of `read_parquet` as one `Block` per record batch (rows with a null: an
    error, or skipped and counted in ``bad`` with ``opts.skip_bad``)."""
    pa = _pyarrow()
    reader = pa.parquet.ParquetFile(piece.path)
    meta = reader.metadata
    check_range(piece, meta.num_row_groups, "row group")
    first = sum(meta.row_group(g).num_rows for g in range(piece.start))
    names = _wanted(reader.schema_arrow.names, opts, piece.path)
    for g in range(piece.start, piece.stop):
        for batch in reader.read_row_group(g, columns=names).to_batches():
            yield from _batch_blocks(pa, batch, piece, first, opts, bad)
            first += batch.num_rows


def _open_file(pa: ModuleType, path: str) -> Any:
    """An Arrow IPC file reader, or None when the file is an IPC stream."""
    try:
        return pa.ipc.open_file(pa.memory_map(path))
    except pa.ArrowInvalid:
        return None


def arrow_pieces(path: str, unit_bytes: int) -> list[Piece]:
    """Ranges of record batches of an IPC file; one piece for an IPC stream."""
    pa = _pyarrow()
    reader = _open_file(pa, path)
    if reader is None:
        return [Piece(path, "arrow", 0, 1, os.path.getsize(path))]
    return row_pieces(path, "arrow", reader.num_record_batches, unit_bytes)


def read_arrow(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[tuple[Record, int]]:
    """Yield one record per row, with the row number in the file."""
    for block in read_arrow_blocks(piece, opts, bad):
        yield from block.records()


def read_arrow_blocks(piece: Piece, opts: ReadOptions, bad: BadRecords) -> Iterator[Block]:
    """The rows of `read_arrow` as one `Block` per record batch (nulls as in
    `read_parquet_blocks`)."""
    pa = _pyarrow()
    reader = _open_file(pa, piece.path)
    first = 0
    if reader is None:
        try:
            batches = iter(pa.ipc.open_stream(pa.memory_map(piece.path)))
        except pa.ArrowInvalid as e:
            raise ConfigError(f"{piece.path}: not an Arrow IPC file or stream ({e})") from None
    else:
        check_range(piece, reader.num_record_batches, "record batch")
        first = sum(reader.get_batch(b).num_rows for b in range(piece.start))
        batches = (reader.get_batch(b) for b in range(piece.start, piece.stop))
    for batch in batches:
        names = _wanted(batch.schema.names, opts, piece.path)
        yield from _batch_blocks(
            pa, batch if names is None else batch.select(names), piece, first, opts, bad
        )
        first += batch.num_rows


def _wanted(names: list[str], opts: ReadOptions, path: str) -> list[str] | None:
    """The columns of ``names`` to read (``opts.columns``), or None for all; a ConfigError
    naming the file's columns when one asked for is not among them."""
    if opts.columns is None:
        return None
    for name in opts.columns:
        if name not in names:
            raise ConfigError(_missing(path, name, names))
    return [n for n in names if n in opts.columns]


def _missing(path: str, name: str, names: list[str]) -> str:
    return (
        f"{path}: row 0: field {name!r} missing from the record (its fields:"
        f" {sorted(names)}, expected every field the pack reads)"
    )


def check_image_columns(inputs: list[Input], field: str) -> None:
    """Refuse, before any schema is made, a Parquet / Arrow / HF input without the image
    column ``field``, or whose ``field`` column holds no image bytes (not binary, nor an HF
    ``Image`` struct): the message is the one its first row would get. Inputs of other
    kinds pass."""
    tables = [i for i in inputs if i.kind in ("parquet", "arrow")]
    if not tables:
        return
    pa = _pyarrow()
    for item in tables:
        path = item.path
        try:
            read = pa.parquet.read_schema if item.kind == "parquet" else _ipc_schema_of(pa)
            schema = read(path)
        except (pa.ArrowException, OSError):
            continue  # not readable: its reader says why
        if field not in schema.names:
            raise ConfigError(_missing(path, field, schema.names), path=path)
        t = schema.field(field).type
        if not _holds_images(pa, t):
            what = _spec(pa, t) or str(t)
            raise ConfigError(
                f"{path}: row 0: field {field!r}: not a decodable image ({what}, expected "
                f"image bytes)",
                path=path,
            )


def _ipc_schema_of(pa: ModuleType) -> Any:
    def read(path: str) -> Any:
        reader = _open_file(pa, path)
        return reader.schema if reader is not None else _stream_schema(pa, path)

    return read


def _holds_images(pa: ModuleType, t: Any) -> bool:
    """Whether a column of type ``t`` may hold image bytes: binary, or an HF ``Image``
    struct (bytes, or the path of a file)."""
    types = pa.types
    if types.is_dictionary(t):
        t = t.value_type
    if types.is_binary(t) or types.is_large_binary(t):
        return True
    return types.is_struct(t) and any(
        t.field(i).name in ("bytes", "path") for i in range(t.num_fields)
    )


def _batch_blocks(
    pa: ModuleType, batch: Any, piece: Piece, first: int, opts: ReadOptions, bad: BadRecords
) -> Iterator[Block]:
    """A record batch as blocks: one, or with ``opts.skip_bad`` one per run of rows no
    record can hold (`_flaws`: each skipped row counted in ``bad``). Raises ConfigError
    naming the file, field and row of the first such row otherwise. Dictionary-encoded
    columns (a pandas categorical) are read as their values."""
    if any(pa.types.is_dictionary(t) for t in batch.schema.types):
        batch = pa.RecordBatch.from_arrays(
            [c.dictionary_decode() if pa.types.is_dictionary(c.type) else c for c in batch.columns],
            names=batch.schema.names,
        )
    flaws = [
        (name, rows, what)
        for name, col in zip(batch.schema.names, batch.columns, strict=True)
        for rows, what in _flaws(pa, col)
    ]
    if not flaws:
        yield _batch_block(pa, batch, piece, first)
        return

    def told(row: int) -> str:
        name, _, what = next(flaw for flaw in flaws if flaw[1][row])
        return f"{piece.path}: row {first + row}: field {name!r}: {what}"

    flawed = np.logical_or.reduce([rows for _, rows, _ in flaws])
    if not opts.skip_bad:
        row = int(np.argmax(flawed))
        raise ConfigError(told(row), path=piece.path, offset=first + row)
    for row in np.flatnonzero(flawed).tolist():
        bad.add(told(row))
    edges = np.flatnonzero(np.diff(np.concatenate([[1], flawed, [1]]).astype(np.int8)))
    for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        yield _batch_block(pa, batch.slice(start, stop - start), piece, first + start)


def _flaws(pa: ModuleType, col: Any) -> Iterator[tuple[np.ndarray, str]]:
    """The rows of a column no record can hold, as a mask, with what is wrong with them:
    nulls, and in a string column bytes that are not UTF-8 (writers that skip the check
    leave them)."""
    nulls = _null_rows(pa, col)
    if nulls is not None:
        yield nulls, "null (expected a value in every row)"
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        invalid = _invalid_utf8_rows(pa, col)
        if invalid is not None:
            yield invalid, "invalid UTF-8 (expected text in a string column)"


def _invalid_utf8_rows(pa: ModuleType, col: Any) -> np.ndarray | None:
    """Which rows of a string column are not UTF-8; None when all are (Arrow's own check,
    in C, before any row is looked at in Python)."""
    try:
        col.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    raw = col.view(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())
    rows = np.zeros(len(col), dtype=bool)
    for i, value in enumerate(raw.to_pylist()):
        try:
            if value is not None:
                value.decode()
        except UnicodeDecodeError:
            rows[i] = True
    return rows if rows.any() else None


def _null_rows(pa: ModuleType, col: Any) -> np.ndarray | None:
    """Which rows of a column hold a null, themselves or in their list; None when none."""
    rows = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
    types, t = pa.types, col.type
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        values = col.values  # the whole child, without the slice's offset
        if values.null_count:
            inner = values.is_null().to_numpy(zero_copy_only=False)
            if types.is_fixed_size_list(t):
                size, at = t.list_size, col.offset * t.list_size
                in_list = inner[at : at + len(col) * size].reshape(len(col), size).any(axis=1)
            else:
                counts = np.concatenate([[0], np.cumsum(inner)])
                offsets = col.offsets.to_numpy()
                in_list = counts[offsets[1:]] > counts[offsets[:-1]]
            rows = in_list if rows is None else rows | in_list
    return rows


def _batch_block(pa: ModuleType, batch: Any, piece: Piece, first: int) -> Block:
    """A record batch (without nulls) as a `Block`: lists of numbers as their values and
    lengths, numbers and fixed-size lists as arrays, any other column as `_column`'s
    per-row values."""
    columns: dict[str, Any] = {}
    lengths: dict[str, np.ndarray] = {}
    for i, name in enumerate(batch.schema.names):
        col = batch.column(i)
        if _is_number_list(pa, col):
            offsets = col.offsets.to_numpy()
            flat = col.values.to_numpy(zero_copy_only=False)
            columns[name] = flat[int(offsets[0]) : int(offsets[-1])]
            lengths[name] = np.diff(offsets)
        elif (nested := _nested_values(pa, col)) is not None:
            columns[name], lengths[name] = nested
        else:
            columns[name] = _column(pa, col, f"{piece.path}: field {name!r}")
    return Block(piece, first, batch.num_rows, columns, lengths)


def _is_list(pa: ModuleType, t: Any) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _nested_values(pa: ModuleType, col: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A list of (lists or fixed-size lists of) numbers whose inner levels all have one
    length (an HF ``ArrayND``, a ``list<fixed_size_list<T, k>>``) as its values, shaped
    (elements, *inner), and each row's length; None for any other column (ragged inner
    lists, nulls), which then goes record by record."""
    if not _is_list(pa, col.type):
        return None
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    child, dims = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])), []
    while _is_list(pa, child.type) or pa.types.is_fixed_size_list(child.type):
        if pa.types.is_fixed_size_list(child.type):
            dims.append(child.type.list_size)
            child = child.flatten()  # honours the slice's offset
            continue
        inner = child.offsets.to_numpy()
        sizes = np.unique(np.diff(inner))
        if len(sizes) != 1 or child.null_count:
            return None  # ragged, empty or null inner lists: no one shape
        dims.append(int(sizes[0]))
        child = child.values.slice(int(inner[0]), int(inner[-1] - inner[0]))
    if not dims or not _is_number(pa, child.type) or child.null_count:
        return None
    return child.to_numpy(zero_copy_only=False).reshape(-1, *dims), lengths


def _is_number(pa: ModuleType, t: Any) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_number_list(pa: ModuleType, col: Any) -> bool:
    types = pa.types
    if not (types.is_list(col.type) or types.is_large_list(col.type)):
        return False
    child = col.type.value_type
    return (types.is_integer(child) or types.is_floating(child)) and col.values.null_count == 0


def _leaf(pa: ModuleType, t: Any) -> Any:
    """The element type under any nesting of lists."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t


def _fixed_rows(pa: ModuleType, col: Any) -> np.ndarray | None:
    """A column of (nested) fixed-size lists of numbers as one (rows, *dims) array of the
    element type, or None for any other column."""
    dims, values = [], col
    while pa.types.is_fixed_size_list(values.type):
        dims.append(values.type.list_size)
        values = values.flatten()  # honours the slice's offset
    if not dims or not _is_number(pa, values.type):
        return None
    return values.to_numpy(zero_copy_only=False).reshape(len(col), *dims)


def _column(pa: ModuleType, col: Any, where: str) -> Any:
    """Per-row values of one column without nulls: numpy scalars or rows of one array,
    1-D views, arrays of the element type, str or bytes."""
    t = col.type
    types = pa.types
    if _is_number(pa, t):
        return col.to_numpy(zero_copy_only=False)
    if (
        types.is_string(t)
        or types.is_large_string(t)
        or types.is_binary(t)
        or types.is_large_binary(t)
    ):
        return col.to_pylist()
    if _is_number_list(pa, col):
        offsets = col.offsets.to_numpy()
        flat = col.values.to_numpy(zero_copy_only=False)
        return [flat[a:b] for a, b in itertools.pairwise(offsets.tolist())]
    fixed = _fixed_rows(pa, col)
    if fixed is not None:
        return fixed
    leaf = _leaf(pa, t)
    if _is_number(pa, leaf):  # lists of lists: each row as an array of the element type
        dtype = np.dtype(leaf.to_pandas_dtype())
        return [np.asarray(v, dtype) for v in col.to_pylist()]
    if types.is_struct(t):  # an HF Image column ({bytes, path}): per-row dicts, for --image-size
        return col.to_pylist()
    raise ConfigError(
        f"{where}: Arrow type {t} (expected numbers, lists of numbers, string or binary)"
    )


def _spec(pa: ModuleType, t: Any) -> str | None:
    """The roxxel field spec that holds an Arrow type exactly, or None.

    list<T> -> ``T[]``, fixed_size_list<T, k> -> ``T[k]``, nested fixed-size lists ->
    ``T[k1,k2]``, list<fixed_size_list<T, k>> -> ``T[,k]``.
    """
    types = pa.types
    if types.is_dictionary(t):
        t = t.value_type
    if types.is_string(t) or types.is_large_string(t):
        return "str"
    if types.is_binary(t) or types.is_large_binary(t):
        return "bytes"
    dims: list[str] = []
    if types.is_list(t) or types.is_large_list(t):
        dims, t = [""], t.value_type
    while types.is_fixed_size_list(t):
        dims, t = [*dims, str(t.list_size)], t.value_type
    if not _is_number(pa, t):
        return None
    dtype = np.dtype(t.to_pandas_dtype()).name
    return f"{dtype}[{','.join(dims)}]" if dims else dtype


_HF_ARRAY = "ARROW:extension:name"


def _hf_array_spec(field: Any) -> str | None:
    """An HF ``ArrayND`` feature's spec from its extension metadata (shape and dtype), as
    written by ``datasets`` (stored as nested lists, read here without ``datasets``)."""
    meta = field.metadata or {}
    name = meta.get(_HF_ARRAY.encode(), b"").decode("utf-8", "replace")
    if not (name.startswith("datasets.") and name.endswith("DExtensionType")):
        return None
    try:
        shape, dtype = json.loads(meta[b"ARROW:extension:metadata"])
        dims = ["" if d is None else str(int(d)) for d in shape]
    except (KeyError, ValueError, TypeError):
        return None
    return f"{dtype}[{','.join(dims)}]"


def parquet_schema(path: str) -> dict[str, str] | None:
    """``{name: spec}`` from a Parquet file's own schema (see `arrow_schema`)."""
    pa = _pyarrow()
    try:
        return _specs(pa, pa.parquet.read_schema(path))
    except (pa.ArrowException, OSError):
        return None


def arrow_schema(path: str) -> dict[str, str] | None:
    """``{name: spec}`` from an Arrow file's or stream's own schema, types kept exactly (a
    float32 column is ``float32``, a fixed-size list ``float32[4]``); None when a column has
    a type no spec holds (the records are then sampled, and the error names the field)."""
    pa = _pyarrow()
    try:
        reader = _open_file(pa, path)
        return _specs(pa, reader.schema if reader is not None else _stream_schema(pa, path))
    except (pa.ArrowException, OSError):
        return None


def _specs(pa: ModuleType, schema: Any) -> dict[str, str] | None:
    spec: dict[str, str] = {}
    for field in schema:
        found = _hf_array_spec(field) or _spec(pa, field.type)
        if found is None:
            return None
        spec[field.name] = found
    return spec


def _stream_schema(pa: ModuleType, path: str) -> Any:
    with pa.ipc.open_stream(pa.memory_map(path)) as reader:
        return reader.schema


def hf_files(directory: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` dataset directory, in dataset order."""
    state_path = os.path.join(directory, "state.json")
    if os.path.exists(os.path.join(directory, "dataset_dict.json")):
        splits = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        raise ConfigError(
            f"{directory}: a DatasetDict with splits {splits} (expected one split: pass {directory}/<split>)"
        )
    _check_regular(state_path, "the HF dataset state file")
    try:
        with open(state_path, "rb") as f:
            state = load_json(f.read(), state_path, ConfigError)
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{state_path}: unreadable HF dataset state ({e!r}, expected _data_files)",
            path=state_path,
        ) from None
    bad = [n for n in names if not isinstance(n, str) or os.path.basename(n) != n or n[:1] in ".~"]
    if bad:
        raise ConfigError(
            f"{state_path}: data file names {bad} (expected plain file names in {directory})",
            path=state_path,
        )
    files = [os.path.join(directory, n) for n in names]
    if state.get("_indices_data_files"):
        raise ConfigError(
            f"{directory}: dataset has an indices mapping (expected none: call "
            f".flatten_indices() before save_to_disk)"
        )
    for path in files:
        _check_regular(path, f"an Arrow data file of {directory}")
    return files


def _check_regular(path: str, expected: str) -> None:
    """Raise ConfigError when ``path`` is there but no regular file (links followed): a
    FIFO would block ``open`` forever. A missing file passes (its reader says so)."""
    what = not_a_regular_file(path)
    if what is not None:
        raise ConfigError(f"{path}: not a regular file ({what}, expected {expected})", path=path)


def hf_class_names(directories: list[str], label_field: str) -> tuple[str, dict[str, int]]:
    """The label column of HF ``save_to_disk`` directories and ``{name: label}`` of its
    ``ClassLabel`` names, from each ``dataset_info.json``'s features: the ``ClassLabel``
    named ``label_field``, else the one ``ClassLabel`` feature; ``(label_field, {})`` when
    there is none, or when its column is not a column of a directory's Arrow data (the
    metadata would name a label column the dataset lacks). Raises ConfigError for a
    dataset_info.json that is not JSON (or no regular file), or directories whose labels
    differ."""
    found: tuple[str, dict[str, int]] | None = None
    first = ""
    for directory in directories:
        info_path = os.path.join(directory, "dataset_info.json")
        _check_regular(info_path, "the HF dataset info file, or none")
        if not os.path.isfile(info_path):
            continue
        with open(info_path, "rb") as f:
            info = load_json(f.read(), info_path, ConfigError)
        labels = _class_labels(info.get("features") if isinstance(info, dict) else None)
        if label_field in labels:
            name = label_field
        elif len(labels) == 1:
            (name,) = labels
        else:
            continue
        if name not in _hf_columns(directory):
            return label_field, {}
        names = labels[name]
        this = (name, {n: i for i, n in enumerate(names)})
        if found is not None and this != found:
            raise ConfigError(
                f"{info_path}: ClassLabel {name!r} {names} (expected the labels of {first}: "
                f"{found[0]!r} {list(found[1])})",
                path=info_path,
            )
        found, first = this, info_path
    return found or (label_field, {})


def _hf_columns(directory: str) -> set[str]:
    """The columns every Arrow data file of an HF ``save_to_disk`` directory has (from
    their schemas, as `check_image_columns` reads them); none for a file that does not
    read (its reader says why)."""
    pa = _pyarrow()
    read = _ipc_schema_of(pa)
    columns: set[str] | None = None
    for path in hf_files(directory):
        try:
            names = set(read(path).names)
        except (pa.ArrowException, OSError):
            return set()
        columns = names if columns is None else columns & names
    return columns or set()


def _class_labels(features: object) -> dict[str, list[str]]:
    """``{column: names}`` of the top-level ``ClassLabel`` features with distinct string
    names (``datasets`` writes ``{"_type": "ClassLabel", "names": [...]}``)."""
    if not isinstance(features, dict):
        return {}
    out: dict[str, list[str]] = {}
    for column, feature in features.items():
        if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
            continue
        names = feature.get("names")
        if (
            isinstance(names, list)
            and names
            and all(isinstance(n, str) for n in names)
            and len(set(names)) == len(names)
        ):
            out[column] = names
    return out


def is_hf_dir(path: str) -> bool:
    """Whether a directory is a ``save_to_disk`` dataset (or a DatasetDict of them)."""
    return any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))


def hf_inputs(path: str) -> list[Input]:
    """An HF dataset directory's Arrow files; a file given as ``hf`` is one Arrow input."""
    if os.path.isdir(path):
        return [Input(f, "arrow") for f in hf_files(path)]
    return [Input(path, "arrow")]


PARQUET = InputKind(
    "parquet",
    (".parquet", ".pq"),
    parquet_pieces,
    read_parquet,
    read_parquet_blocks,
    schema=parquet_schema,
)
ARROW = InputKind(
    "arrow",
    (".arrow", ".feather", ".ipc"),
    arrow_pieces,
    read_arrow,
    read_arrow_blocks,
    schema=arrow_schema,
)
HF = InputKind(
    "hf",
    (),
    arrow_pieces,
    read_arrow,
    read_arrow_blocks,
    resolve=hf_inputs,
    claims_directory=is_hf_dir,
    schema=arrow_schema,
)
