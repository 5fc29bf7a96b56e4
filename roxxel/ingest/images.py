"""Images at pack time: ``roxxel pack photos/ --image-size 64x64``.

Inputs: image files (an ImageFolder-style tree: ``root/<class>/.../file.jpg``, labels from
the class folder names sorted), or a column of image bytes in Parquet / Arrow / an HF
``save_to_disk`` dataset (an HF ``Image`` column is a ``{bytes, path}`` struct). Pack
workers decode with Pillow (imported only then: the extra ``roxxel[images]``), turn it as
its EXIF orientation says (``ImageOps.exif_transpose``, as HF datasets does; Pillow's
warnings about a corrupt EXIF block hidden), convert to RGB (16-bit integers, either byte
order, by their high byte), center-crop to the target's aspect ratio and resize
(``ImageOps.fit``; or, with ``pad``, resize inside and pad with black: ``ImageOps.pad``),
and store ``uint8[3,H,W]`` (``[H,W,3]`` with ``channels_last``);
``keep_encoded`` stores the file's bytes after checking they decode. An image that does not
decode (or is refused: a decompression bomb, floats, a path that does not open) is named
(file, or file and row) and skipped with --skip-bad.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from roxxel.errors import ConfigError
from roxxel.ingest.arrow import check_image_columns, hf_class_names, is_hf_dir
from roxxel.ingest.units import (
    BadRecords,
    Input,
    InputKind,
    Piece,
    ReadOptions,
    Record,
    special_file_kind,
)

__all__ = [
    "IMAGE",
    "IMAGE_EXTENSIONS",
    "ImageConfig",
    "decode_image",
    "folder_labels",
    "image_folder_inputs",
    "image_records",
    "parse_image_size",
    "passed_over_in_image_folder",
    "pillow",
    "read_image_file",
    "table_images",
]

EXTRA = "pip install 'roxxel[images]'"
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".jfif",  # a JPEG as Windows saves it: Pillow opens it by its bytes, like any JPEG
    ".png",
    ".bmp",
    ".gif",
    ".webp",
    ".tif",
    ".tiff",
)
MAX_SIDE = 1 << 14
MAX_IMAGE_FILE_BYTES = 1 << 30  # an Image struct's path holding more is refused
_IN_MEMORY = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")
Located = tuple[Record, Piece, int]
SIXTEEN_BIT_MAX = 0xFFFF


class _Refused(ValueError):
    """An image value refused by a rule of ours, not Pillow's: its message is whole."""


def pillow() -> ModuleType:
    """``PIL.Image``; raises ConfigError naming the extra when Pillow is missing."""
    try:
        import PIL.Image  # optional extra: only image packs need it
    except ImportError:
        raise ConfigError(
            f"--image-size: Pillow is not installed (expected the extra: {EXTRA})"
        ) from None
    return PIL.Image


def parse_image_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (or one number for a square) as (height, width).

    >>> parse_image_size("64x48"), parse_image_size("32")
    ((64, 48), (32, 32))
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    sides = (int(match[1]), int(match[2] or match[1])) if match else None
    if sides is None or not all(0 < s <= MAX_SIDE for s in sides):
        raise ConfigError(
            f"--image-size {text!r}: not a size (expected HEIGHTxWIDTH like 64x64, sides in "
            f"[1, {MAX_SIDE}])"
        )
    return sides


def _folder_prefix(directory: str) -> str:
    """What the normalised path of a file under ``directory`` starts with: the normalised
    directory and a separator, or nothing for the working directory (``.``, ``./``,
    ``cat/..``), whose files normalise to ``cat/a.png``.

    >>> _folder_prefix("photos/"), _folder_prefix("./cat/.."), _folder_prefix("/")
    ('photos/', '', '/')
    """
    norm = os.path.normpath(directory)
    if norm == os.curdir:
        return ""
    return norm if norm.endswith(os.sep) else norm + os.sep


def folder_labels(directories: list[str], files: list[str]) -> dict[str, int]:
    """``{class folder: label}`` for image files under ImageFolder-style directories.

    A file's class is the first folder below the directory argument that holds it; labels
    number the class names sorted (the same name under two arguments is one class). Files
    directly in an argument, or named alone, have no class: then no file may have one.
    Raises ConfigError for such a mix. Work per file: string operations only (a tree of a
    million images is planned in seconds).
    """
    roots = [_folder_prefix(d) for d in directories]
    classes: dict[str, str] = {}
    unlabelled: list[str] = []
    for path in files:
        norm = os.path.normpath(path)
        root = next((r for r in roots if norm.startswith(r)), None)
        name, sep, _ = ("", "", "") if root is None else norm[len(root) :].partition(os.sep)
        if root is None or not sep:
            unlabelled.append(path)
        else:
            classes[root + name] = name
    if classes and unlabelled:
        raise ConfigError(
            f"{unlabelled[0]}: an image outside any class folder (expected every image in "
            f"root/<class>/, like {next(iter(classes))}/)",
            path=unlabelled[0],
        )
    names = sorted(set(classes.values()))
    return {folder: names.index(name) for folder, name in sorted(classes.items())}


def passed_over_in_image_folder(path: str, what: str) -> str:
    """The line that lists a file an image folder passes over, ``what`` it is.

    >>> passed_over_in_image_folder("t/README.txt", "a text file")[:44]
    't/README.txt: a text file in an image folder'
    """
    return f"{path}: {what} in an image folder (expected an image: {', '.join(IMAGE_EXTENSIONS)})"


def image_folder_inputs(
    directories: list[str], inputs: list[Input], skipped: list[str]
) -> list[Input]:
    """The inputs of an image pack: in a directory argument that holds image files (an image
    folder), the other files (``README.txt``, ``labels.jsonl``) are passed over, each
    described in ``skipped`` (as the walk describes those of unknown extensions:
    `passed_over_in_image_folder`). Other inputs are kept. Work per file: string
    operations only.

    >>> skipped = []
    >>> found = [Input("photos/a/x.jpg", "image"), Input("photos/notes.txt", "text")]
    >>> [i.path for i in image_folder_inputs(["photos"], found, skipped)], len(skipped)
    (['photos/a/x.jpg'], 1)
    """
    roots = [_folder_prefix(d) for d in directories]
    norms = [os.path.normpath(i.path) for i in inputs]
    images = [n for n, i in zip(norms, inputs, strict=True) if i.kind == IMAGE.name]
    folders = tuple(r for r in roots if any(n.startswith(r) for n in images))
    kept: list[Input] = []
    for norm, item in zip(norms, inputs, strict=True):
        if item.kind == IMAGE.name or not norm.startswith(folders):
            kept.append(item)
        else:
            skipped.append(passed_over_in_image_folder(item.path, f"a {item.kind} file"))
    return kept


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """How a pack turns images into arrays: plain values (they travel to workers as JSON).

    Attributes:
        height, width: the stored size.
        field: the image field (input and output).
        channels_last: store ``[H,W,3]`` instead of ``[3,H,W]``.
        pad: fit inside the size and pad with black instead of covering it and cropping.
        keep_encoded: store the encoded bytes (checked to decode) instead of pixels.
        classes: ``{class folder: label}`` for image files; the label goes to ``label_field``.
        class_names: ``{name: label}`` of the ``ClassLabel`` column ``label_field`` of an HF
            dataset (its values are read, not made): for the metadata alone.
    """

    height: int
    width: int
    field: str = "image"
    channels_last: bool = False
    pad: bool = False
    keep_encoded: bool = False
    classes: dict[str, int] = dataclasses.field(default_factory=dict)
    label_field: str = "label"
    class_names: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ImageConfig:
        return cls(**doc)

    @property
    def spec(self) -> str:
        """The image field's schema spec."""
        if self.keep_encoded:
            return "bytes"
        shape = (self.height, self.width, 3) if self.channels_last else (3, self.height, self.width)
        return f"uint8[{','.join(map(str, shape))}]"

    def metadata(self) -> dict[str, Any]:
        """What the manifest records about how the images were made."""
        names = {os.path.basename(f): label for f, label in self.classes.items()}
        names = names or self.class_names
        pixels = not self.keep_encoded
        return {
            "field": self.field,
            "spec": self.spec,
            "size": [self.height, self.width] if pixels else None,
            "fit": ("pad" if self.pad else "crop") if pixels else None,
            "channels_last": self.channels_last if pixels else None,
            "keep_encoded": self.keep_encoded,
            "labels": dict(sorted(names.items(), key=lambda kv: kv[1])),
            "label_field": self.label_field if names else None,
        }


def table_images(
    config: ImageConfig, inputs: list[Input], directories: list[str], mapped: bool
) -> ImageConfig:
    """``config`` checked against its Parquet / Arrow / HF inputs, before any schema is
    made: the image column is there and may hold image bytes (unless ``mapped``: a --map
    function makes the records; see `check_image_columns`). Without class folders, it
    takes the ``ClassLabel`` names of the HF dataset ``directories`` (`hf_class_names`:
    only of a column their Arrow data has) for its metadata; not when ``mapped``: the
    function may drop or rewrite the label column."""
    if mapped:
        return config
    check_image_columns(inputs, config.field)
    hf = [d for d in directories if is_hf_dir(d)]
    if config.classes or not hf:
        return config
    label_field, names = hf_class_names(hf, config.label_field)
    if not names or label_field == config.field:
        return config
    return dataclasses.replace(config, label_field=label_field, class_names=names)


def decode_image(data: bytes, config: ImageConfig) -> np.ndarray:
    """Pixels of an encoded image, turned as its EXIF orientation says (Pillow's
    ``ImageOps.exif_transpose``, as HF datasets decodes), RGB (see ``_rgb``), fit to the
    size: Pillow's ``ImageOps.fit`` (center crop to the aspect ratio, then a bilinear
    resize), or ``ImageOps.pad`` (resize inside, pad with black) with ``config.pad``.

    Pillow's warnings about what it passes over (a corrupt EXIF block) are hidden
    (`_pillow_warnings_hidden`: not thread-safe; a pack decodes in one thread per process).
    Raises OSError / ValueError (Pillow's) when the bytes do not decode, ValueError for
    pixels without a known range (``_rgb``), ``DecompressionBombError`` for a size over
    Pillow's limit.
    """
    image_mod = pillow()
    ops = importlib.import_module("PIL.ImageOps")
    size, method = (config.width, config.height), image_mod.Resampling.BILINEAR
    with _pillow_warnings_hidden(), image_mod.open(io.BytesIO(data)) as img:
        img.load()
        ops.exif_transpose(img, in_place=True)  # in place: no copy without an orientation
        rgb = _rgb(img, image_mod)
        fitted = ops.pad(rgb, size, method) if config.pad else ops.fit(rgb, size, method)
    pixels = np.asarray(fitted, dtype=np.uint8)
    return pixels if config.channels_last else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _rgb(img: Any, image_mod: ModuleType) -> Any:
    """An image as RGB: 8-bit modes as Pillow converts them (a transparency, dropped, is
    taken out of ``img.info`` first: no warning for a palette's alphas); 16-bit integers (modes
    ``I;16``, ``I;16L``, ``I;16B``, ``I;16N``: either byte order, and ``I`` with values in
    [0, 65535]: older Pillows open a 16-bit PNG as ``I``) by their high byte, ``v >> 8``, as
    Pillow reads a 16-bit RGB PNG itself.

    Raises ``_Refused`` (a ValueError) for floats (``F``) and ``I`` values outside
    [0, 65535]: their white is unknown, and ``convert`` would clip them at 255.
    """
    if img.mode == "RGB":
        return img  # convert would copy it
    if img.mode.startswith("I;16"):
        # numpy reads each byte order as its values (``>u2`` for I;16B); Pillow's
        # getextrema refuses I;16B, and a 16-bit value needs no range check
        return _high_bytes(np.asarray(img), image_mod)
    if img.mode not in ("I", "F"):
        # RGB has no transparency, and convert reads it only to warn ("Palette images with
        # Transparency expressed in bytes...") or keep it: the pixels are the same without
        img.info.pop("transparency", None)
        return img.convert("RGB")
    low, high = img.getextrema()
    if img.mode == "F" or low < 0 or high > SIXTEEN_BIT_MAX:
        raise _Refused(
            f"an image of mode {img.mode!r} (values in [{low}, {high}], expected 8-bit modes or "
            f"integers in [0, {SIXTEEN_BIT_MAX}]: the white of other values is unknown)"
        )
    return _high_bytes(np.asarray(img), image_mod)


def _high_bytes(values: np.ndarray, image_mod: ModuleType) -> Any:
    """RGB of 16-bit gray values (any integer dtype, either byte order): ``v >> 8``."""
    return image_mod.fromarray((values >> 8).astype(np.uint8)).convert("RGB")


@contextlib.contextmanager
def _pillow_warnings_hidden() -> Iterator[None]:
    """Pillow's ``UserWarning`` s ignored inside: what it passes over in a file it still
    decodes ("Tag data larger than file. Skipping tag 274", "Corrupt EXIF data") would reach
    a pack's stderr as raw Python warning lines, once per worker. So is its
    ``DecompressionBombWarning`` (a RuntimeWarning) for an image between once and twice
    ``MAX_IMAGE_PIXELS``, which Pillow decodes: over twice it raises, and the pack names
    the image. Not thread-safe: Python's ``warnings.catch_warnings`` swaps the process's
    filters."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        warnings.filterwarnings("ignore", category=pillow().DecompressionBombWarning)
        yield


def _check_decodes(data: bytes) -> None:
    with _pillow_warnings_hidden(), pillow().open(io.BytesIO(data)) as img:
        img.load()


def _image_bytes(value: Any) -> bytes | None:
    """An image value's encoded bytes: bytes, or an HF ``Image`` struct (bytes, else the
    file at path; a relative path is from the working directory, as HF datasets opens it).

    Raises ``_Refused`` when the path does not open."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict):
        if isinstance(value.get("bytes"), bytes):
            return value["bytes"]
        path = value.get("path")
        if isinstance(path, str):
            return _read_image_path(path)
    return None


def _read_image_path(path: str) -> bytes:
    """The bytes of an ``Image`` struct's file: a regular file of at most
    `MAX_IMAGE_FILE_BYTES` (a FIFO would block, ``/dev/zero`` never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        where = "" if os.path.isabs(path) else f"; from the working directory {os.getcwd()}"
        raise _Refused(
            f"image path {path!r} does not open ({e.strerror or e}, expected a readable "
            f"file{where})"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Refused(
                f"image path {path!r} is {special_file_kind(info.st_mode)}: not a regular file"
            )
        if info.st_size > MAX_IMAGE_FILE_BYTES:
            raise _Refused(
                f"image path {path!r} holds {info.st_size} bytes (expected at most "
                f"MAX_IMAGE_FILE_BYTES = {MAX_IMAGE_FILE_BYTES} for one encoded image)"
            )
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        return file.read(MAX_IMAGE_FILE_BYTES + 1)


def _image_value(record: Record, config: ImageConfig) -> Any:
    """What a record's image field stores: pixels, or the encoded bytes checked to decode."""
    data = _image_bytes(record.get(config.field))
    if data is None:
        found = "missing" if config.field not in record else type(record[config.field]).__name__
        raise _Refused(f"not a decodable image ({found}, expected image bytes)")
    if config.keep_encoded:
        _check_decodes(data)
        return data
    return decode_image(data, config)


def image_records(
    records: Iterator[Located],
    config: ImageConfig,
    bad: BadRecords,
    skip_bad: bool,
    locate: Callable[[Piece, int], str],
) -> Iterator[Located]:
    """Records with their image field decoded to pixels (or checked, kept encoded), and the
    class label of an image file added. An image that does not decode raises ConfigError
    naming its file (and row); with ``skip_bad`` it is counted in ``bad`` instead. So is an
    image refused: a decompression bomb (a size over Pillow's limit), pixels of unknown range,
    an ``Image`` struct's path that does not open."""
    bomb = pillow().DecompressionBombError  # no OSError: raised on open, for the header's size
    for record, piece, key in records:
        try:
            value = _image_value(record, config)
        except (OSError, ValueError, SyntaxError, bomb) as e:  # PIL raises these on bad data
            why = _IN_MEMORY.sub("", str(e))  # PIL names a BytesIO by its address
            what = why if isinstance(e, _Refused) else f"not a decodable image ({why})"
            message = f"{locate(piece, key)}: field {config.field!r}: {what}"
            if not skip_bad:
                raise ConfigError(message, path=piece.path) from None
            bad.add(message)
            continue
        out = {**record, config.field: value}
        if config.classes:
            out[config.label_field] = _label(piece.path, config.classes)
        yield out, piece, key


def _label(path: str, classes: dict[str, int]) -> int:
    folder = os.path.dirname(os.path.normpath(path))
    while folder not in classes:
        parent = os.path.dirname(folder)
        if parent == folder:
            raise ConfigError(f"{path}: in no class folder (expected one of {list(classes)})")
        folder = parent
    return classes[folder]


def read_image_file(
    piece: Piece, opts: ReadOptions, bad: BadRecords
) -> Iterator[tuple[Record, int]]:
    """One record ``{field: encoded bytes}`` per image file (decoded later, by the pack)."""
    del bad
    with open(piece.path, "rb") as f:
        data = f.read(piece.num_bytes + 1)
    if len(data) != piece.num_bytes:
        raise ConfigError(
            f"{piece.path}: {len(data)} bytes read (expected {piece.num_bytes}: the input "
            f"changed since planning)",
            path=piece.path,
        )
    yield {opts.field_for("image"): data}, 0


def _image_pieces(path: str, unit_bytes: int) -> list[Piece]:
    del unit_bytes  # an image is never split
    return [Piece(path, "image", 0, 1, os.path.getsize(path))]


def _locate_file(piece: Piece, key: int) -> str:
    del key
    return piece.path


IMAGE = InputKind("image", IMAGE_EXTENSIONS, _image_pieces, read_image_file, locate=_locate_file)
