"""``roxxel pack --image-size`` (issue 14): images decoded in the pack workers, checked
against Pillow's own decode and fit, from files made here (JPEG and PNG, grayscale and RGBA,
one corrupt file), an HF ``save_to_disk`` ``Image`` column and Parquet image bytes."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import roxxel
from roxxel.cli import main
from roxxel.errors import ConfigError
from roxxel.ingest.images import (
    ImageConfig,
    decode_image,
    folder_labels,
    image_folder_inputs,
    parse_image_size,
)
from roxxel.ingest.inputs import Input
from tests.cli_run import pack_in_subprocess

Image = pytest.importorskip("PIL.Image")
ImageOps = pytest.importorskip("PIL.ImageOps")

MODES = {"a.jpg": "RGB", "b.png": "RGBA", "c.png": "L", "d.jpg": "L", "e.png": "RGB"}


def _image(mode: str, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(20, 60)), int(rng.integers(20, 60))
    shape = (h, w) if mode == "L" else (h, w, len(mode))
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


def _encoded(name: str, seed: int) -> bytes:
    buf = io.BytesIO()
    _image(MODES[name], seed).save(buf, "JPEG" if name.endswith(".jpg") else "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """root/cat/{a.jpg,b.png}, root/dog/{c.png,d.jpg,e.png}, root/dog/zz_bad.jpg (corrupt)."""
    root = tmp_path / "photos"
    for i, name in enumerate(MODES):
        sub = root / ("cat" if name in ("a.jpg", "b.png") else "dog")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / name).write_bytes(_encoded(name, i))
    (root / "dog" / "zz_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


def _reference(data: bytes, h: int, w: int, pad: bool = False) -> np.ndarray:
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")  # as HF decodes
    fit = ImageOps.pad if pad else ImageOps.fit
    return np.asarray(fit(img, (w, h), Image.Resampling.BILINEAR))


def _pack(*argv: object) -> int:
    return main(["pack", *map(str, argv), "-q"])


@pytest.mark.parametrize("workers", [1, 2])
def test_issue14_image_folder_pixels_and_labels_match_pillow(folder, tmp_path, workers, capsys):
    out = tmp_path / "ds"
    argv = [folder, "-o", out, "--image-size", "16x24", "--skip-bad", "--unit-bytes", "1K"]
    assert _pack(*argv, "--workers", workers) == 0
    assert "zz_bad.jpg" in capsys.readouterr().err
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json()["image"] == "uint8[3,16,24]"
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "zz_bad.jpg")
    assert len(ds) == len(files) == 5
    for i, path in enumerate(files):
        record = ds[i]
        want = _reference(path.read_bytes(), 16, 24).transpose(2, 0, 1)
        np.testing.assert_array_equal(record["image"], want)
        assert record["label"] == (0 if path.parent.name == "cat" else 1)
    meta = ds.metadata["images"]
    assert meta["labels"] == {"cat": 0, "dog": 1}
    assert meta["spec"] == "uint8[3,16,24]"


def test_issue14_channels_last_and_pad_match_pillow(folder, tmp_path):
    out = tmp_path / "ds"
    argv = [folder / "cat", "-o", out, "--image-size", "20x12", "--channels-last", "--image-pad"]
    assert _pack(*argv) == 0
    ds = roxxel.open_dataset(out)
    assert ds.schema.to_json() == {"image": "uint8[20,12,3]"}  # files named alone: no labels
    for i, path in enumerate(sorted((folder / "cat").iterdir())):
        np.testing.assert_array_equal(ds[i]["image"], _reference(path.read_bytes(), 20, 12, True))


def test_issue14_grayscale_and_rgba_convert_to_rgb_exactly():
    gray = io.BytesIO()
    Image.new("L", (9, 7), 77).save(gray, "PNG")
    rgba = io.BytesIO()
    Image.new("RGBA", (5, 11), (10, 200, 30, 128)).save(rgba, "PNG")
    config = ImageConfig(height=4, width=6)
    assert (decode_image(gray.getvalue(), config) == 77).all()
    got = decode_image(rgba.getvalue(), config)
    assert got.shape == (3, 4, 6)
    assert got.reshape(3, -1)[:, 0].tolist() == [10, 200, 30]


def _palette_png_with_alphas() -> bytes:
    """A palette PNG whose tRNS chunk gives each palette entry an alpha (Pillow: bytes)."""
    rng = np.random.default_rng(3)
    img = Image.fromarray(rng.integers(0, 16, (21, 34), dtype=np.uint8), "P")
    img.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tobytes())
    buf = io.BytesIO()
    img.save(buf, "PNG", transparency=bytes(range(0, 256, 16)))
    return buf.getvalue()


def test_a_palette_png_with_alphas_packs_without_pillows_warning(tmp_path, capsys):
    """`convert("RGB")` of a palette image with per-entry alphas let Pillow's two-line
    UserWarning ("Palette images with Transparency expressed in bytes should be converted
    to RGBA images") through to a pack's stderr; the alpha is dropped anyway: the pixels are
    still Pillow's `convert("RGB")`, without the warning."""
    data = _palette_png_with_alphas()
    assert isinstance(Image.open(io.BytesIO(data)).info["transparency"], bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _reference(data, 9, 13).transpose(2, 0, 1)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "t.png").write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            _pack(tmp_path / "photos" / "t.png", "-o", tmp_path / "ds", "--image-size", "9x13") == 0
        )
    assert capsys.readouterr().err == ""
    np.testing.assert_array_equal(roxxel.open_dataset(tmp_path / "ds")[0]["image"], want)


def test_issue14_keep_encoded_stores_the_file_bytes(folder, tmp_path):
    out = tmp_path / "ds"
    assert _pack(folder, "-o", out, "--keep-encoded", "--skip-bad") == 0
    ds = roxxel.open_dataset(out)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "zz_bad.jpg")
    assert ds.schema.to_json()["image"] == "bytes"
    assert [bytes(ds[i]["image"]) for i in range(len(ds))] == [p.read_bytes() for p in files]


def test_issue14_corrupt_image_is_one_line_naming_the_file(folder, tmp_path, capsys):
    assert _pack(folder, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(folder / "dog" / "zz_bad.jpg") in err


def _hf_image_dir(tmp_path: Path, payloads: list[bytes]) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": b, "path": None} for b in payloads], image_type)
    table = pa.table({"image": images, "label": pa.array(range(len(payloads)), pa.int64())})
    with pa.ipc.new_stream(str(d / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (d / "state.json").write_text(json.dumps(state))
    return d


@pytest.mark.parametrize("workers", [1, 2])
def test_issue14_hf_image_column_decodes_and_keeps_labels(tmp_path, workers):
    payloads = [_encoded(name, i) for i, name in enumerate(MODES)]
    out = tmp_path / "ds"
    assert (
        _pack(
            _hf_image_dir(tmp_path, payloads),
            "-o",
            out,
            "--image-size",
            "8x8",
            "--workers",
            workers,
        )
        == 0
    )
    ds = roxxel.open_dataset(out)
    for i, data in enumerate(payloads):
        np.testing.assert_array_equal(ds[i]["image"], _reference(data, 8, 8).transpose(2, 0, 1))
        assert ds[i]["label"] == i


def test_issue14_parquet_image_bytes_corrupt_row_is_named(tmp_path, capsys):
    payloads = [_encoded("a.jpg", 0), b"garbage", _encoded("c.png", 2)]
    src = tmp_path / "imgs.parquet"
    pq.write_table(pa.table({"image": payloads}), src)
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{src}: row 1" in err
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8", "--skip-bad") == 0
    ds = roxxel.open_dataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds[1]["image"], _reference(payloads[2], 8, 8).transpose(2, 0, 1))


@pytest.mark.parametrize("text", ["64by64", "0x8", "x", "64x", "8x8x8", "99999x1"])
def test_issue14_image_size_that_does_not_parse_is_a_one_line_usage_error(
    folder, tmp_path, text, capsys
):
    """A bad --image-size exited 1, as for bad input; the command line is wrong: exit 2
    (docs/cli.md), one line naming the flag and its value."""
    assert _pack(folder, "-o", tmp_path / "ds", "--image-size", text) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--image-size {text!r}" in err
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ConfigError):  # the library's parse is no command line: ConfigError
        parse_image_size(text)
    with pytest.raises(ConfigError):
        parse_image_size(text)


def test_issue14_images_without_image_flags_ask_for_them(folder, tmp_path, capsys):
    assert _pack(folder, "-o", tmp_path / "ds") == 1
    assert "--image-size" in capsys.readouterr().err


def test_issue14_missing_pillow_says_which_extra(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    assert _pack(folder, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    assert "roxxel[images]" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--channels-last", "--image-pad"])
def test_issue14_image_options_without_image_size_are_usage_errors(folder, tmp_path, flag, capsys):
    """With --keep-encoded the error said "expected --image-size HxW", which
    --keep-encoded refuses: it says the option shapes decoded pixels."""
    assert _pack(folder, "-o", tmp_path / "ds", "--keep-encoded", flag) == 2
    err = capsys.readouterr().err
    assert f"{flag}: kept-encoded images have no pixels to" in err
    assert _pack(folder, "-o", tmp_path / "ds", flag) == 2
    assert f"{flag}: expected --image-size HxW" in capsys.readouterr().err


def test_issue14_speed_folder_labels_are_string_work_per_file(monkeypatch):
    """Planning an ImageFolder tree labels every file: it took os.path.relpath per file
    (two abspath calls, a getcwd for relative paths: 0.65 s for 6,000 files, minutes for
    ImageNet). The labels are a function of the path strings alone, found without asking
    the OS anything per file."""

    def no_os(*args: object) -> str:
        raise AssertionError("folder_labels asked the OS for the working directory")

    files = [f"photos/{c}/sub/{i}.jpg" for c in ("dog", "cat") for i in range(3)]
    files += ["more/cat/x.png", "photos/bird/y.jpg"]
    with monkeypatch.context() as patch:
        patch.setattr("os.getcwd", no_os)
        labels = folder_labels(["photos/", "./more"], files)
    assert labels == {"more/cat": 1, "photos/bird": 0, "photos/cat": 1, "photos/dog": 2}


def test_issue14_speed_rgb_images_are_fit_without_a_converted_copy(monkeypatch):
    """``convert("RGB")`` of an RGB image copies every pixel (12% of a 256x192 JPEG's decode
    and fit); an RGB image is fit as decoded, to the same pixels."""
    data = _encoded("a.jpg", 0)
    converted: list[str] = []
    real = Image.Image.convert

    def spy(self: Any, mode: str | None = None, *args: Any, **kwargs: Any) -> Any:
        converted.append(self.mode)
        return real(self, mode, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", spy)
    got = decode_image(data, ImageConfig(height=16, width=24))
    assert converted == []
    monkeypatch.undo()
    np.testing.assert_array_equal(got, _reference(data, 16, 24).transpose(2, 0, 1))


def test_issue14_keep_encoded_with_image_size_is_a_usage_error(folder, tmp_path, capsys):
    assert _pack(folder, "-o", tmp_path / "ds", "--keep-encoded", "--image-size", "8x8") == 2
    assert "--keep-encoded" in capsys.readouterr().err


def test_issue14_keep_encoded_metadata_and_info_name_no_size_or_fit(folder, tmp_path, capsys):
    out = tmp_path / "ds"
    assert _pack(folder, "-o", out, "--keep-encoded", "--skip-bad") == 0
    meta = roxxel.open_dataset(out).metadata["images"]
    assert (meta["keep_encoded"], meta["size"], meta["fit"], meta["channels_last"]) == (
        True,
        None,
        None,
        None,
    )
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("images:"))
    assert "kept encoded" in line and "crop" not in line


def test_issue14_a_bad_image_in_a_bytes_column_is_named_without_a_memory_address(tmp_path, capsys):
    src = tmp_path / "imgs.parquet"
    pq.write_table(pa.table({"image": [_encoded("a.jpg", 0), b"garbage"]}), src)
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    err = capsys.readouterr().err.strip()
    assert f"{src}: row 1" in err and "0x" not in err and "BytesIO" not in err


_IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # an HF ``Image``
GRADIENT = np.arange(256, dtype=np.uint16).reshape(16, 16) * 257  # 0..65535, v >> 8 == index


def _png16(values: np.ndarray, size: tuple[int, int] | None = None) -> bytes:
    """A 16-bit PNG written by hand (Pillow writes no 16-bit RGB): grayscale for ``[H,W]``,
    RGB for ``[H,W,3]``; ``size`` (width, height) puts another size in the header."""
    height, width = values.shape[:2]
    width, height = size or (width, height)
    header = struct.pack(">IIBBBBB", width, height, 16, 0 if values.ndim == 2 else 2, 0, 0, 0)
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in values)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def _tiff(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "TIFF")
    return buf.getvalue()


def _parquet(tmp_path: Path, images: list[Any], image_type: Any = None) -> Path:
    src = tmp_path / "imgs.parquet"
    pq.write_table(pa.table({"image": pa.array(images, image_type)}), src)
    return src


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flags", [("--image-size", "8x8"), ("--keep-encoded",)])
def test_a_decompression_bomb_is_a_bad_image_named_and_skippable(tmp_path, flags, capsys):
    """A PNG whose header says 30000x30000 trips Pillow's decompression bomb check on open:
    that was a traceback (``DecompressionBombError`` is no OSError), even with --skip-bad."""
    bomb = _png16(np.zeros((1, 1), np.uint16), size=(30000, 30000))
    src = _parquet(tmp_path, [_encoded("a.jpg", 0), bomb])
    assert _pack(src, "-o", tmp_path / "ds", *flags) == 1
    err = _one_line_error(capsys)
    assert f"{src}: row 1" in err and "decompression bomb" in err
    assert _pack(src, "-o", tmp_path / "ds", *flags, "--skip-bad") == 0
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 1


def test_an_image_struct_whose_path_does_not_open_is_named_and_skippable(tmp_path, capsys):
    """A ``{bytes: null, path}`` image whose file is missing stopped the pack with a bare
    ``[Errno 2]`` naming neither the input nor the row, and --skip-bad did not skip it."""
    missing = {"bytes": None, "path": "/nonexistent/x.png"}
    src = _parquet(
        tmp_path, [{"bytes": _encoded("a.jpg", 0), "path": None}, missing], _IMAGE_STRUCT
    )
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    err = _one_line_error(capsys)
    assert f"{src}: row 1" in err and "'/nonexistent/x.png'" in err
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8", "--skip-bad") == 0
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 1


@pytest.mark.parametrize("kind", ["fifo", "character device", "directory"])
def test_an_image_struct_path_that_is_no_regular_file_is_a_bad_image(tmp_path, kind, capsys):
    """A path to a FIFO hung the pack, to /dev/zero read until memory ran out, and to a
    directory gave a bare IsADirectoryError: only regular files are read."""
    path = {"fifo": tmp_path / "pipe", "directory": tmp_path}.get(kind, Path("/dev/zero"))
    if kind == "fifo":
        os.mkfifo(path)
    src = _parquet(
        tmp_path,
        [{"bytes": _encoded("a.jpg", 0), "path": None}, {"bytes": None, "path": str(path)}],
        _IMAGE_STRUCT,
    )

    def hung(*_: object) -> None:
        raise TimeoutError("the pack hung")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # the old code blocked on the FIFO's open for ever
    try:
        assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8", "--workers", 1) == 1
        err = _one_line_error(capsys)
        assert f"{src}: row 1" in err and f"{str(path)!r}" in err
        assert "not a regular file" in err and kind in err.lower()
        assert _pack(src, "-o", tmp_path / "ds", "--keep-encoded", "--skip-bad") == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 1


def test_an_image_struct_relative_path_is_from_the_working_directory(tmp_path, monkeypatch):
    """As HF datasets decodes an ``Image`` path: from the working directory, not the input's."""
    data = _encoded("b.png", 1)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "b.png").write_bytes(data)
    (tmp_path / "meta").mkdir()
    src = _parquet(tmp_path / "meta", [{"bytes": None, "path": "imgs/b.png"}], _IMAGE_STRUCT)
    monkeypatch.chdir(tmp_path)
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 0
    got = roxxel.open_dataset(tmp_path / "ds")[0]["image"]
    np.testing.assert_array_equal(got, _reference(data, 8, 8).transpose(2, 0, 1))


def test_an_image_field_named_like_the_label_field_is_a_usage_error(folder, tmp_path, capsys):
    """``--input-field label`` on class folders stored each label over its image (schema
    ``label:int64`` alone); another name keeps both."""
    argv = [folder, "-o", tmp_path / "ds", "--image-size", "8x8", "--skip-bad"]
    assert _pack(*argv, "--input-field", "label") == 2
    assert "--input-field label" in _one_line_error(capsys)
    assert _pack(*argv, "--input-field", "pixels") == 0
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds.schema.to_json() == {"pixels": "uint8[3,8,8]", "label": "int64"}
    want = _reference((folder / "cat" / "a.jpg").read_bytes(), 8, 8).transpose(2, 0, 1)
    np.testing.assert_array_equal(ds[0]["pixels"], want)


@pytest.mark.parametrize(
    "fields, named",
    [
        (["image:uint8[3,8,8]"], "label"),  # the labels dropped
        (["image:float32[3,8,8]", "label:int64"], "uint8[3,8,8]"),  # pixels not as packed
        (["image:uint8[3,4,4]", "label:int64"], "uint8[3,8,8]"),
        (["label:int64"], "image"),  # the images dropped
        (["image:uint8[3,8,8]", "label:float32"], "label"),
    ],
)
def test_field_flags_that_do_not_hold_the_images_as_packed_are_refused(
    folder, tmp_path, capsys, fields, named
):
    """--field gives the whole schema: `image:uint8[3,8,8]` alone dropped the class labels
    while the metadata still named them, and `image:float32[...]` stored floats the metadata
    called uint8. The image field must be as packed and the label an integer."""
    argv = [folder, "-o", tmp_path / "ds", "--image-size", "8x8", "--skip-bad"]
    assert _pack(*argv, *[a for f in fields for a in ("--field", f)]) == 2
    err = _one_line_error(capsys)
    assert "--field" in err and named in err
    assert not (tmp_path / "ds").exists()
    assert _pack(*argv, "--field", "image:uint8[3,8,8]", "--field", "label:int16") == 0
    assert roxxel.open_dataset(tmp_path / "ds").schema.to_json() == {
        "image": "uint8[3,8,8]",
        "label": "int16",
    }


def test_an_image_pack_of_text_inputs_says_so(tmp_path, capsys):
    """A tree of empty class folders and a README packed the README as text, then failed
    with "field 'image': not a decodable image (missing ...)"; a JSONL the same."""
    root = tmp_path / "emptyonly"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "readme.txt").write_text("about these photos\n")
    (tmp_path / "t.jsonl").write_text('{"x": 1}\n')
    for src in (root, tmp_path / "t.jsonl"):
        assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
        err = _one_line_error(capsys)
        assert "input in an image pack" in err and "not a decodable image" not in err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("kind", ["png_gray", "png_rgb", "tiff_gray16", "tiff_int32"])
def test_16_bit_images_keep_their_high_byte(kind):
    """A 16-bit grayscale PNG or TIFF opens as mode ``I;16`` (32-bit ``I`` for an int32
    TIFF) and ``convert("RGB")`` clipped it at 255: a 0..65535 gradient came out almost all
    white. It maps as ``v >> 8``, as Pillow decodes a 16-bit RGB PNG itself (to ``RGB``)."""
    rgb = np.stack([GRADIENT, GRADIENT.T, 65535 - GRADIENT], axis=2)
    data = {
        "png_gray": lambda: _png16(GRADIENT),
        "png_rgb": lambda: _png16(rgb),
        "tiff_gray16": lambda: _tiff(GRADIENT),
        "tiff_int32": lambda: _tiff(GRADIENT.astype(np.int32)),
    }[kind]()
    want = (rgb if kind == "png_rgb" else np.stack([GRADIENT] * 3, axis=2)) >> 8
    got = decode_image(data, ImageConfig(height=16, width=16, channels_last=True))
    np.testing.assert_array_equal(got, want.astype(np.uint8))


@pytest.mark.parametrize(
    ("values", "mode"),
    [
        (np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4), "F"),
        (np.array([[0, 70000]], np.int32), "I"),
        (np.array([[-1, 5]], np.int32), "I"),
    ],
)
def test_images_of_unknown_range_are_bad_images_naming_the_mode(tmp_path, values, mode, capsys):
    """A float image, or 32-bit integers outside [0, 65535], has no known white: refused as a
    bad image (``convert("RGB")`` clipped it), skippable."""
    src = _parquet(tmp_path, [_encoded("a.jpg", 0), _tiff(values)])
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8") == 1
    err = _one_line_error(capsys)
    assert f"{src}: row 1" in err and f"mode {mode!r}" in err
    assert _pack(src, "-o", tmp_path / "ds", "--image-size", "8x8", "--skip-bad") == 0
    assert len(roxxel.open_dataset(tmp_path / "ds")) == 1


def test_image_folder_inputs_pass_over_other_files_of_a_folder_with_images():
    inputs = [
        Input("photos/cat/a.jpg", "image"),
        Input("photos/cat/README.txt", "text"),
        Input("photos/labels.jsonl", "jsonl"),
        Input("tables/t.parquet", "parquet"),
        Input("extra.jsonl", "jsonl"),
    ]
    skipped: list[str] = []
    kept = image_folder_inputs(["photos/", "tables"], inputs, skipped)
    assert kept == [inputs[0], inputs[3], inputs[4]]
    assert [line.split(":")[0] for line in skipped] == [
        "photos/cat/README.txt",
        "photos/labels.jsonl",
    ]
    assert "image folder" in skipped[0]


def test_other_files_in_an_image_folder_are_passed_over_and_said(folder, tmp_path, capsys):
    """``photos/cat/README.txt`` and ``photos/labels.jsonl`` were packed as text beside the
    images, and the pack failed on the schema (``field 'text' is ambiguous``) naming no file."""
    (folder / "cat" / "README.txt").write_text("cats\n")
    (folder / "labels.jsonl").write_text('{"cat": 0}\n')
    out = tmp_path / "ds"
    assert main(["pack", str(folder), "-o", str(out), "--image-size", "8x8", "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert "README.txt: a text file in an image folder" in err and "labels.jsonl" in err
    ds = roxxel.open_dataset(out)
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".jpg", ".png"))
    assert len(ds) == len(files) - 1  # zz_bad.jpg skipped
    want = _reference(files[0].read_bytes(), 8, 8).transpose(2, 0, 1)
    np.testing.assert_array_equal(ds[0]["image"], want)


def _exif_jpeg(orientation: int) -> bytes:
    """A 40x20 JPEG whose EXIF says to show it turned (orientation 6: 90 degrees clockwise)."""
    pixels = np.random.default_rng(orientation).integers(0, 256, (20, 40, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_orientation_turns_the_image_before_the_fit(tmp_path, orientation):
    """A photo stored 40x20 with EXIF orientation 6 shows 20x40: HF datasets and photo
    pipelines apply ``ImageOps.exif_transpose``; the pack cropped it as stored. Kept encoded,
    the bytes are the file's (the orientation tag with them)."""
    data = _exif_jpeg(orientation)
    got = decode_image(data, ImageConfig(height=8, width=8, channels_last=True))
    np.testing.assert_array_equal(got, _reference(data, 8, 8))  # exif_transpose, then fit
    turn = {6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}[orientation]
    shown = Image.open(io.BytesIO(data)).convert("RGB").transpose(turn)
    assert shown.size == (20, 40)
    fit = ImageOps.fit(shown, (8, 8), Image.Resampling.BILINEAR)
    np.testing.assert_array_equal(got, np.asarray(fit))
    src = tmp_path / "x.jpg"
    src.write_bytes(data)
    assert _pack(src, "-o", tmp_path / "ds", "--keep-encoded") == 0
    assert bytes(roxxel.open_dataset(tmp_path / "ds")[0]["image"]) == data


# ---- issue 14 sweep: the working directory, big-endian TIFFs, EXIF warnings, other files ---


def _small_tree(root: Path) -> Path:
    """root/cat/a.png, root/dog/b.png and a stray root/README.txt."""
    for i, (cls, name) in enumerate([("cat", "a.png"), ("dog", "b.png")]):
        (root / cls).mkdir(parents=True)
        (root / cls / name).write_bytes(_encoded("e.png", i))
    (root / "README.txt").write_text("cats and dogs\n")
    return root


def _records(out: Path) -> tuple[Any, list[Any], dict[str, Any]]:
    ds = roxxel.open_dataset(out)
    rows = [{k: np.asarray(v).tolist() for k, v in ds[i].items()} for i in range(len(ds))]
    return ds.schema.to_json(), rows, ds.metadata["images"]


@pytest.mark.parametrize("spelling", [".", "./", "cat/..", "./dog/../."])
def test_issue14_the_working_directory_as_an_image_folder_is_the_named_folder(
    tmp_path, monkeypatch, capsys, spelling
):
    """``cd t && roxxel pack . --image-size 8`` dropped every class label (metadata labels
    ``{}``, no label field) and stopped on ``./README.txt: a text input in an image pack``,
    where ``roxxel pack t`` labelled cat 0 and dog 1 and passed the README over: the folder's
    prefix was ``./`` while the file paths were normalised to ``cat/a.png``. Every spelling
    of the working directory now packs as its name does, from the CLI and from ``roxxel.pack``."""
    tree = _small_tree(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    assert main(["pack", "t", "-o", str(tmp_path / "named"), "--image-size", "8"]) == 0
    assert "README.txt: a text file in an image folder" in capsys.readouterr().err
    want = _records(tmp_path / "named")
    assert want[0] == {"image": "uint8[3,8,8]", "label": "int64"}
    assert want[2]["labels"] == {"cat": 0, "dog": 1}
    monkeypatch.chdir(tree)
    assert main(["pack", spelling, "-o", str(tmp_path / "cli"), "--image-size", "8"]) == 0
    assert "README.txt: a text file in an image folder" in capsys.readouterr().err
    assert _records(tmp_path / "cli") == want
    roxxel.pack(spelling, tmp_path / "lib", image_size=8, workers=1)
    assert _records(tmp_path / "lib") == want


def test_issue14_folder_labels_and_image_folders_of_the_working_directory():
    """``folder_labels(["."], ...)`` found no class and ``image_folder_inputs(["."], ...)``
    kept the README: no normalised path starts with ``./``."""
    assert folder_labels(["."], ["./cat/a.png", "dog/b.png"]) == {"cat": 0, "dog": 1}
    assert folder_labels(["./"], ["./x.png"]) == {}
    skipped: list[str] = []
    found = [Input("./cat/a.png", "image"), Input("./README.txt", "text")]
    assert image_folder_inputs(["."], found, skipped) == found[:1]
    assert [line.split(":")[0] for line in skipped] == ["./README.txt"]


def _tiff16(values: np.ndarray, mode: str) -> bytes:
    """A 16-bit grayscale TIFF of mode ``I;16B`` (big-endian) or ``I;16`` (little-endian)."""
    order = ">u2" if mode == "I;16B" else "<u2"
    height, width = values.shape
    buf = io.BytesIO()
    Image.frombytes(mode, (width, height), values.astype(order).tobytes()).save(buf, "TIFF")
    return buf.getvalue()


def test_issue14_a_big_endian_16_bit_tiff_packs_as_its_little_endian_twin(tmp_path):
    """A 16-bit big-endian grayscale TIFF (Pillow mode ``I;16B``) was refused "not a
    decodable image (image has wrong mode)": ``getextrema`` does not take that mode. It maps
    as its little-endian twin (``I;16``) does: ``v >> 8``."""
    values = (np.arange(42, dtype=np.uint32).reshape(6, 7) * 1567 + 7).astype(np.uint16)
    for mode in ("I;16B", "I;16"):
        data = _tiff16(values, mode)
        assert Image.open(io.BytesIO(data)).mode == mode
        (tmp_path / f"{mode}.tif").write_bytes(data)
        src, out = tmp_path / f"{mode}.tif", tmp_path / mode
        assert _pack(src, "-o", out, "--image-size", "6x7", "--channels-last") == 0
    big, little = (roxxel.open_dataset(tmp_path / m)[0]["image"] for m in ("I;16B", "I;16"))
    np.testing.assert_array_equal(big, little)
    np.testing.assert_array_equal(big, np.stack([values >> 8] * 3, axis=2).astype(np.uint8))


def _corrupt_exif_jpegs() -> dict[str, bytes]:
    """JPEGs whose EXIF block is broken two ways, Pillow warning on each: the orientation
    entry's count made huge ("Tag data larger than file. Skipping tag 274"), the IFD's
    number of entries made 200 ("Corrupt EXIF data")."""
    data = _exif_jpeg(6)
    tiff = data.find(b"Exif\0\0") + 6  # the TIFF header; its first IFD at +8 (Pillow's)
    assert (
        data[tiff : tiff + 8] == b"MM\0*\0\0\0\x08" and data[tiff + 10 : tiff + 12] == b"\x01\x12"
    )
    count = tiff + 8 + 2 + 4  # entry 0 (the orientation): tag, type, count, value
    return {
        "count.jpg": data[:count] + struct.pack(">I", 0x7FFFFFFF) + data[count + 4 :],
        "entries.jpg": data[: tiff + 8] + struct.pack(">H", 200) + data[tiff + 10 :],
    }


def test_issue14_pillows_exif_warnings_stay_off_stderr(tmp_path):
    """A photo with a corrupt EXIF block packed right, but Pillow's warnings reached the
    pack's stderr as raw Python warning lines (``.../PIL/TiffImagePlugin.py:946:
    UserWarning: Tag data larger than file. Skipping tag 274``, ``Corrupt EXIF data``)."""
    photos = tmp_path / "photos"
    photos.mkdir()
    files = _corrupt_exif_jpegs()
    for name, data in files.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Image.open(io.BytesIO(data)).getexif()
        assert any("EXIF" in str(w.message) or "Tag data" in str(w.message) for w in caught)
        (photos / name).write_bytes(data)
    out = tmp_path / "ds"
    argv = [sys.executable, "-m", "roxxel.cli", "pack", str(photos), "-o", str(out)]
    done = subprocess.run(
        [*argv, "--image-size", "8", "--workers", "1"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
    ds = roxxel.open_dataset(out)
    for i, data in enumerate(files.values()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _reference(data, 8, 8).transpose(2, 0, 1)
        np.testing.assert_array_equal(ds[i]["image"], want)


def test_issue14_files_of_unknown_extensions_in_an_image_folder_are_listed(tmp_path, capsys):
    """In an image folder ``README.txt`` was listed as passed over, but ``x.heic`` and
    ``Thumbs.db`` vanished without a word (docs/cli.md: "passed over as files of unknown
    extensions are, and listed"). Each is listed the way the README is."""
    tree = _small_tree(tmp_path / "t")
    (tree / "dog" / "x.heic").write_bytes(b"not decodable here")
    (tree / "Thumbs.db").write_bytes(b"\0" * 16)
    (tree / ".hidden.png").write_bytes(b"hidden files stay unlisted")
    out = tmp_path / "ds"
    assert main(["pack", str(tree), "-o", str(out), "--image-size", "8"]) == 0
    prefix = "roxxel: skipped "
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(prefix)]
    listed = {line.removeprefix(prefix).split(": ")[0] for line in lines}
    assert listed == {
        str(tree / "README.txt"),
        str(tree / "dog" / "x.heic"),
        str(tree / "Thumbs.db"),
    }
    assert all("in an image folder (expected an image:" in line for line in lines)
    assert ".heic'" in next(line for line in lines if "x.heic" in line)
    assert len(roxxel.open_dataset(out)) == 2


def test_issue14_files_of_unknown_extensions_elsewhere_stay_unlisted(tmp_path, capsys):
    """Only an image folder lists them: a folder of JSON Lines passes its ``notes.md``
    over without a word, as before."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "docs" / "notes.md").write_text("notes\n")
    assert main(["pack", str(tmp_path / "docs"), "-o", str(tmp_path / "ds")]) == 0
    assert "notes.md" not in capsys.readouterr().err


def test_issue14_a_jfif_file_is_a_jpeg_image(tmp_path):
    """``.jfif`` (a JPEG as Windows saves it, which Pillow opens as JPEG) vanished from an
    image folder; it is an image extension."""
    tree = _small_tree(tmp_path / "t")
    data = _encoded("a.jpg", 5)
    (tree / "dog" / "c.jfif").write_bytes(data)
    out = tmp_path / "ds"
    assert _pack(tree, "-o", out, "--image-size", "8") == 0
    ds = roxxel.open_dataset(out)
    assert len(ds) == 3 and ds[2]["label"] == 1
    np.testing.assert_array_equal(ds[2]["image"], _reference(data, 8, 8).transpose(2, 0, 1))


def test_issue14_a_folder_of_many_other_files_lists_the_first_and_counts_the_rest(tmp_path, capsys):
    """A tree with an annotation beside every image (``a.xml``) listed every one of them,
    a line each (a million lines for a large tree); now the first 20 and a count."""
    tree = _small_tree(tmp_path / "t")
    for i in range(30):
        (tree / "cat" / f"n{i:02d}.xml").write_text("<a/>")
    assert main(["pack", str(tree), "-o", str(tmp_path / "ds"), "--image-size", "8"]) == 0
    lines = capsys.readouterr().err.splitlines()
    listed = [x for x in lines if x.startswith("roxxel: skipped ") and "image folder" in x]
    assert len(listed) == 20
    assert "roxxel: skipped 11 more files (--quiet hides these lines)" in lines


def test_an_image_over_pillows_limit_but_under_twice_packs_without_its_warning(tmp_path):
    """A 12000x10000 PNG (between once and twice ``PIL.Image.MAX_IMAGE_PIXELS``) packed, but
    Pillow's ``DecompressionBombWarning`` reached stderr as two raw lines (a path and
    ``warnings.warn(``) through ``-q``, which prints nothing but errors and skipped-record
    reports. The limit is lowered here (Pillow reads it on every open) to keep the image
    small; over twice the limit stays refused (`test_a_decompression_bomb_is_a_bad_...`)."""
    photos = tmp_path / "img6"
    photos.mkdir()
    Image.new("L", (15, 10), 7).save(photos / "big.png")  # 150 pixels: in (100, 200]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        limit = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = 100
        try:
            Image.open(photos / "big.png").close()
        finally:
            Image.MAX_IMAGE_PIXELS = limit
    assert [w.category for w in caught] == [Image.DecompressionBombWarning]
    out = tmp_path / "z1"
    script = (
        "import sys, PIL.Image; PIL.Image.MAX_IMAGE_PIXELS = 100; "
        "from roxxel.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = ["pack", str(photos), "-o", str(out), "-q", "--image-size", "8", "--workers", "1"]
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    ds = roxxel.open_dataset(out)
    assert len(ds) == 1 and ds[0]["image"].shape == (3, 8, 8) and (ds[0]["image"] == 7).all()


def _hf_class_label_dir(tmp_path: Path, features: dict[str, Any] | None) -> Path:
    """An HF folder as `_hf_image_dir` builds it, of three images with labels [2, 0, 1],
    and a dataset_info.json of ``features`` (none written for None), as ``datasets`` does."""
    d = tmp_path / "hf"
    d.mkdir()
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    payloads = [_encoded(name, i) for i, name in enumerate(MODES)][:3]
    images = pa.array([{"bytes": b, "path": None} for b in payloads], image_type)
    table = pa.table({"image": images, "label": pa.array([2, 0, 1], pa.int64())})
    with pa.ipc.new_stream(str(d / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (d / "state.json").write_text(json.dumps(state))
    if features is not None:
        (d / "dataset_info.json").write_text(json.dumps({"features": features}))
    return d


def _image_table(tmp_path: Path, kind: str) -> Path:
    """Columns ``image`` (image bytes) and ``label``: an HF folder, or a Parquet file."""
    if kind == "hf":
        return _hf_class_label_dir(tmp_path, {"image": {"_type": "Image"}})
    src = tmp_path / "img.parquet"
    payloads = [_encoded(name, i) for i, name in enumerate(MODES)][:3]
    pq.write_table(pa.table({"image": payloads, "label": pa.array([2, 0, 1], pa.int64())}), src)
    return src


@pytest.mark.parametrize("kind", ["hf", "parquet"])
def test_issue14_input_field_missing_or_no_images_is_named_before_the_schema(
    tmp_path, kind, capsys
):
    """`--input-field nosuch` on an HF image folder said "field 'image' is ambiguous (a dict
    value ... e.g. --field nosuch:uint8[3,16,16] ...)", and `--input-field label` the same
    with `--field label:uint8[3,16,16]`; Parquet said what is wrong, but only after printing
    `schema (from the input's own types): image:bytes, label:int64, nosuch:uint8[3,16,16]`.
    Both now refuse first, as Parquet words it."""
    src = _image_table(tmp_path, kind)
    arrow = src / "data-00000-of-00001.arrow" if kind == "hf" else src
    for field, want in [
        (
            "nosuch",
            f"{arrow}: row 0: field 'nosuch' missing from the record (its fields: "
            "['image', 'label'], expected every field the pack reads)",
        ),
        ("label", f"{arrow}: row 0: field 'label': not a decodable image (int64, expected"),
    ]:
        argv = ["pack", src, "-o", tmp_path / "ds", "--image-size", "16", "--input-field", field]
        assert main(list(map(str, argv))) == 1
        out, err = capsys.readouterr()
        assert "schema (" not in out and field not in out
        assert len(err.strip().splitlines()) == 1 and want in err, err
        assert "ambiguous" not in err
        assert not (tmp_path / "ds").exists()


def test_issue14_hf_class_label_names_are_the_labels_in_metadata_and_info(tmp_path, capsys):
    """An HF dataset's `ClassLabel` names were dropped: `images.labels` was `{}` and
    `roxxel info` named no labels, where an ImageFolder tree keeps its class names."""
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": ["cat", "dog", "zebra"]},
    }
    src = _hf_class_label_dir(tmp_path, features)
    metas = []
    for out in (tmp_path / "ds1", tmp_path / "ds2"):
        assert _pack(src, "-o", out, "--image-size", "8") == 0
        ds = roxxel.open_dataset(out)
        assert [ds[i]["label"] for i in range(3)] == [2, 0, 1]
        assert ds.schema.to_json() == {"label": "int64", "image": "uint8[3,8,8]"}
        metas.append((out / "manifest.json").read_bytes())
        meta = ds.metadata["images"]
        assert meta["labels"] == {"cat": 0, "dog": 1, "zebra": 2}
        assert meta["label_field"] == "label"
    assert metas[0] == metas[1]  # the same input: the same bytes
    capsys.readouterr()
    assert main(["info", str(tmp_path / "ds1")]) == 0
    assert "3 labels in 'label'" in capsys.readouterr().out


def test_issue14_hf_without_class_labels_keeps_no_labels(tmp_path):
    for i, features in enumerate(
        [None, {"image": {"_type": "Image"}, "label": {"dtype": "int64"}}]
    ):
        (tmp_path / str(i)).mkdir()
        src = _hf_class_label_dir(tmp_path / str(i), features)
        assert _pack(src, "-o", tmp_path / f"ds{i}", "--image-size", "8") == 0
        meta = roxxel.open_dataset(tmp_path / f"ds{i}").metadata["images"]
        assert meta["labels"] == {} and meta["label_field"] is None


@pytest.mark.skipif(sys.platform == "win32", reason="needs FIFOs")
@pytest.mark.parametrize(
    "name", ["state.json", "data-00000-of-00001.arrow", "dataset_info.json", "link"]
)
def test_issue14_hf_folder_files_that_are_no_regular_files_are_refused(tmp_path, name):
    """A FIFO named state.json (or the data file) in an HF save_to_disk folder hung the pack
    forever in `open()`: it is refused, one line naming it and what it is. A link to a FIFO
    the same; a FIFO dataset_info.json too (it was passed over without a word)."""
    src = _hf_class_label_dir(tmp_path, None)
    target = src / ("data-00000-of-00001.arrow" if name == "link" else name)
    target.unlink(missing_ok=True)
    if name == "link":
        os.mkfifo(tmp_path / "fifo")
        target.symlink_to(tmp_path / "fifo")
    else:
        os.mkfifo(target)
    done = pack_in_subprocess(src, "-o", tmp_path / "ds", "--image-size", "16")
    err = done.stderr.strip()
    assert done.returncode == 1, err
    assert len(err.splitlines()) == 1, err
    assert f"{target}: not a regular file (a FIFO, expected " in err, err
    assert not (tmp_path / "ds").exists()


def test_issue14_hf_class_label_of_a_column_the_data_lacks_keeps_no_labels(tmp_path, capsys):
    """dataset_info.json's one ClassLabel `coarse` named no column of the Arrow data (`image,
    label`): the pack wrote `images.labels` of `coarse` and `roxxel info` said `3 labels in
    'coarse'`, a column the dataset does not have. Such names are now left out."""
    features = {
        "image": {"_type": "Image"},
        "coarse": {"_type": "ClassLabel", "names": ["cat", "dog", "zebra"]},
    }
    src = _hf_class_label_dir(tmp_path, features)
    out = tmp_path / "ds"
    assert _pack(src, "-o", out, "--image-size", "8") == 0
    ds = roxxel.open_dataset(out)
    assert [ds[i]["label"] for i in range(3)] == [2, 0, 1]
    meta = ds.metadata["images"]
    assert meta["labels"] == {} and meta["label_field"] is None, meta
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    assert "coarse" not in capsys.readouterr().out


@pytest.mark.parametrize("keep_label", [False, True])
def test_issue14_hf_class_label_names_are_not_kept_under_a_map(tmp_path, keep_label):
    """With --map (its function makes the records: it may drop or rewrite the label), the
    HF folder's ClassLabel names were still written as the labels of `label`."""
    features = {
        "image": {"_type": "Image"},
        "label": {"_type": "ClassLabel", "names": ["cat", "dog", "zebra"]},
    }
    src = _hf_class_label_dir(tmp_path, features)
    fn = tmp_path / "fn.py"
    body = "{**record}" if keep_label else '{"image": record["image"], "n": record["label"]}'
    fn.write_text(f"def fn(record):\n    return {body}\n")
    out = tmp_path / "ds"
    assert _pack(src, "-o", out, "--image-size", "8", "--map", f"{fn}:fn") == 0
    ds = roxxel.open_dataset(out)
    assert ("label" in ds.schema.to_json()) == keep_label
    meta = ds.metadata["images"]
    assert meta["labels"] == {} and meta["label_field"] is None, meta
