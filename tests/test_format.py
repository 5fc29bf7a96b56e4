"""Format v1: golden files, and one test per rule of docs/format.md from a named mutation."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import roxxel
from roxxel import FormatError
from roxxel.format import writer as writer_module
from roxxel.format.spec import META_MAX_BYTES, TRAILER_BYTES
from tests.shardbytes import (
    GOLDEN,
    GOLDEN_ZSTD,
    edit_meta,
    extent,
    field,
    golden,
    make_golden_module,
    meta,
    put,
    reseal,
    trailer,
)

MAKE = make_golden_module()


def check(data: bytes | bytearray, rule: str, tmp_path: Path, read: bool = False) -> FormatError:
    """Open ``data`` as a shard (and read every record if ``read``): FormatError of ``rule``."""
    path = tmp_path / "mutant.rxs"
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as info:
        shard = roxxel.open_shard(path)
        if read:
            for i in range(len(shard)):
                shard[i]
    message = str(info.value)
    assert f"rule {rule} " in message, message
    assert str(path) in message and "at byte" in message
    assert (info.value.rule, info.value.path) == (rule, str(path))
    assert isinstance(info.value.offset, int) and 0 <= info.value.offset <= len(data)
    return info.value


def assert_records_equal(found: dict, expected: dict) -> None:
    assert set(found) == set(expected)
    for name, value in expected.items():
        if isinstance(value, str):
            assert found[name] == value
        elif isinstance(value, bytes):
            assert bytes(found[name]) == value
        else:
            want = np.asarray(value)
            assert found[name].dtype == roxxel.Schema.parse(MAKE.SCHEMA)[name].dtype
            np.testing.assert_array_equal(found[name], want.astype(found[name].dtype))


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_ZSTD], ids=["raw", "zstd"])
def test_golden_files_read_as_written(path: Path) -> None:
    shard = roxxel.open_shard(path)
    records = MAKE.golden_records()
    assert len(shard) == len(records)
    assert shard.schema.to_json() == MAKE.SCHEMA
    for i, record in enumerate(records):
        assert_records_equal(shard[i], record)
    assert shard.verify() == []


@pytest.mark.parametrize("name", list(MAKE.FILES))
def test_writer_reproduces_golden_files_byte_for_byte(name, tmp_path, monkeypatch) -> None:
    golden_path = MAKE.DATA / name
    shard = roxxel.open_shard(golden_path)
    if MAKE.FILES[name] and shard.metadata["zstandard"] != zstandard.__version__:
        pytest.skip("zstd frames were made by another zstandard version")
    monkeypatch.setattr(writer_module, "WRITER_VERSION", shard.layout.writer.split()[1])
    monkeypatch.setattr(MAKE, "DATA", tmp_path)
    MAKE.main()
    assert (tmp_path / name).read_bytes() == golden_path.read_bytes()


def test_returned_views_are_read_only_and_zero_copy() -> None:
    shard = roxxel.open_shard(GOLDEN)
    image = shard[0]["image"]
    with pytest.raises(ValueError, match="read-only"):
        image[0, 0] = 9
    assert not image.flags.owndata and not image.flags.writeable


# R1 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 127])
def test_r1_rejects_files_too_short(tmp_path, size) -> None:
    check(golden()[:size], "R1", tmp_path)


def test_r1_rejects_fifo_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "pipe.rxs"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="not a regular file"):
        roxxel.open_shard(fifo)


@pytest.mark.parametrize("path", ["/dev/null", "/dev/zero", "."])
def test_r1_rejects_devices_and_directories(path) -> None:
    with pytest.raises(FormatError, match="not a regular file"):
        roxxel.open_shard(path)


# R2-R5: header and trailer ---------------------------------------------------------------


def test_r2_rejects_wrong_magic(tmp_path) -> None:
    data = golden()
    data[1] ^= 0xFF
    check(data, "R2", tmp_path)


def test_r3_names_a_newer_version(tmp_path) -> None:
    error = check(put(golden(), 8, "I", 2), "R3", tmp_path)
    assert "newer roxxel" in str(error)


def test_r3_rejects_version_zero(tmp_path) -> None:
    check(put(golden(), 8, "I", 0), "R3", tmp_path)


def test_r4_rejects_header_size_and_reserved_bytes(tmp_path) -> None:
    check(put(golden(), 12, "I", 65), "R4", tmp_path)
    data = golden()
    data[40] = 1
    check(data, "R4", tmp_path)


def test_r5_rejects_a_file_cut_short(tmp_path) -> None:
    check(golden()[:-1], "R5", tmp_path)


def test_r5_rejects_bytes_after_the_trailer(tmp_path) -> None:
    check(golden() + b"polyglot", "R5", tmp_path)


def test_r5_rejects_reserved_trailer_bytes(tmp_path) -> None:
    data = golden()
    data[len(data) - TRAILER_BYTES + 40] = 7
    check(data, "R5", tmp_path)


# R6-R8: index extents and checksum -------------------------------------------------------


def _trailer_field(data: bytearray, index: int, value: int) -> bytearray:
    return reseal(put(data, len(data) - TRAILER_BYTES + 8 * index, "Q", value))


def test_r6_rejects_tables_after_metadata(tmp_path) -> None:
    t = trailer(golden())
    check(_trailer_field(golden(), 1, t.meta_offset + 64), "R6", tmp_path)


def test_r6_rejects_unaligned_tables(tmp_path) -> None:
    t = trailer(golden())
    check(_trailer_field(golden(), 1, t.tables_offset + 8), "R6", tmp_path)


def test_r6_rejects_metadata_not_ending_at_trailer(tmp_path) -> None:
    t = trailer(golden())
    check(_trailer_field(golden(), 3, t.meta_bytes - 1), "R6", tmp_path)


@pytest.mark.parametrize("count", [2**63, 2**40])
def test_r6_rejects_record_counts_the_file_cannot_hold(tmp_path, count) -> None:
    check(_trailer_field(golden(), 0, count), "R6", tmp_path)


def test_r7_caps_metadata_size(tmp_path) -> None:
    check(_trailer_field(golden(), 3, META_MAX_BYTES + 1), "R7", tmp_path)


def test_r8_rejects_a_flipped_table_byte(tmp_path) -> None:
    data = golden()
    offset, _ = extent(data, "tokens", "offsets")
    data[offset + 8] ^= 1
    check(data, "R8", tmp_path)


def test_r8_rejects_a_flipped_metadata_byte(tmp_path) -> None:
    data = golden()
    data[trailer(data).meta_offset + 3] ^= 0x20
    check(data, "R8", tmp_path)


# R9-R12: metadata ---------------------------------------------------------------------


def test_r9_rejects_metadata_that_is_not_json(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: None, raw=b"{not json"), "R9", tmp_path)


def test_r9_rejects_nan_in_metadata(tmp_path) -> None:
    raw = bytes(meta_bytes := bytes(golden()[trailer(golden()).meta_offset : -TRAILER_BYTES]))
    raw = raw.replace(b'"golden":1', b'"golden":NaN')
    assert raw != meta_bytes
    check(edit_meta(golden(), lambda d: None, raw=raw), "R9", tmp_path)


def test_r9_rejects_unknown_keys(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: d.update(extra=1)), "R9", tmp_path)


def test_r9_rejects_count_disagreeing_with_trailer(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: d.update(num_records=2)), "R9", tmp_path)


def test_r9_rejects_non_object_user_metadata(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: d.update(metadata=[1])), "R9", tmp_path)


def test_r10_rejects_duplicate_field_names(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: d["fields"][1].update(name="tokens")), "R10", tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [("type", "object"), ("type", "int32[0]"), ("codec", "lz4"), ("name", "a/b"), ("type", 3)],
)
def test_r10_rejects_types_codecs_and_names_off_the_allow_list(tmp_path, key, value) -> None:
    check(edit_meta(golden(), lambda d: field(d, "label").update({key: value})), "R10", tmp_path)


def test_r10_rejects_no_fields(tmp_path) -> None:
    check(edit_meta(golden(), lambda d: d.update(fields=[])), "R10", tmp_path)


@pytest.mark.parametrize("value", [[-64, 8], [64], "64", [64, 2**63], [True, 8]])
def test_r11_rejects_malformed_extents(tmp_path, value) -> None:
    check(edit_meta(golden(), lambda d: field(d, "label").update(data=value)), "R11", tmp_path)


def test_r11_rejects_overlapping_columns(tmp_path) -> None:
    def overlap(doc):
        tokens = field(doc, "tokens")["data"]
        field(doc, "label")["data"] = [tokens[0], field(doc, "label")["data"][1]]

    check(edit_meta(golden(), overlap), "R11", tmp_path)


def test_r11_rejects_nonzero_padding_between_columns(tmp_path) -> None:
    data = golden()
    offset, nbytes = extent(data, "tokens", "data")
    assert nbytes % 64
    data[offset + nbytes] = 1
    check(data, "R11", tmp_path)


def test_r12_rejects_an_offset_table_on_a_fixed_raw_field(tmp_path) -> None:
    def add(doc):
        field(doc, "label")["offsets"] = field(doc, "tokens")["offsets"]

    check(edit_meta(golden(), add), "R12", tmp_path)


def test_r12_rejects_a_fixed_column_of_the_wrong_size(tmp_path) -> None:
    data = golden()

    def shrink(doc):
        field(doc, "image")["data"][1] -= 6

    mutated = edit_meta(data, shrink)
    with pytest.raises(FormatError, match=r"rule R1[12] "):
        roxxel.open_shard(_write(tmp_path, mutated))


def _write(tmp_path: Path, data: bytes | bytearray) -> Path:
    path = tmp_path / "m.rxs"
    path.write_bytes(bytes(data))
    return path


# R13-R15: tables ----------------------------------------------------------------------


def _table_edit(data: bytearray, name: str, key: str, index: int, value: int, fmt="Q") -> bytearray:
    offset, _ = extent(data, name, key)
    return reseal(put(data, offset + struct.calcsize(fmt) * index, fmt, value))


def test_r13_rejects_offsets_that_decrease(tmp_path) -> None:
    data = _table_edit(golden(), "blob", "offsets", 2, 1)  # [0, 2, 1, 6]: 2 -> 1 decreases
    check(data, "R13", tmp_path)


def test_r13_rejects_a_first_offset_other_than_zero(tmp_path) -> None:
    check(_table_edit(golden(), "blob", "offsets", 0, 1), "R13", tmp_path)


def test_r13_rejects_a_last_offset_past_the_column(tmp_path) -> None:
    check(_table_edit(golden(), "blob", "offsets", 3, 7), "R13", tmp_path)


def test_r13_rejects_offsets_near_2_pow_64(tmp_path) -> None:
    check(_table_edit(golden(), "blob", "offsets", 1, 2**64 - 1), "R13", tmp_path)


def test_r13_rejects_steps_that_split_an_element(tmp_path) -> None:
    check(_table_edit(golden(), "tokens", "offsets", 1, 6), "R13", tmp_path)


def test_r14_rejects_a_checksum_table_of_the_wrong_size(tmp_path) -> None:
    check(
        edit_meta(golden(), lambda d: field(d, "label")["checksums"].__setitem__(1, 8)),
        "R14",
        tmp_path,
    )


def test_r15_rejects_records_claiming_impossible_decoded_sizes(tmp_path) -> None:
    data = golden(GOLDEN_ZSTD)
    offset, _ = extent(data, "text", "decoded")
    for i, value in enumerate([0, 2**40, 2**40, 2**40]):
        put(data, offset + 8 * i, "Q", value)
    check(reseal(data), "R15", tmp_path)


def test_r15_rejects_a_frame_whose_size_disagrees_with_its_table(tmp_path) -> None:
    data = golden(GOLDEN_ZSTD)
    offset, _ = extent(data, "tokens", "decoded")
    decoded = np.frombuffer(bytes(data[offset : offset + 32]), "<u8").copy()
    decoded[1:] += 4  # record 0 now claims one more int32 than its frame holds
    data[offset : offset + 32] = decoded.tobytes()
    check(reseal(data), "R15", tmp_path, read=True)


# R16-R18: record bytes ----------------------------------------------------------------


def _flip_record_byte(data: bytearray, name: str) -> bytearray:
    offset, _ = extent(data, name, "data")
    data[offset] ^= 0x80
    return data


def test_r16_verify_names_the_record_and_field_of_a_flipped_data_byte(tmp_path) -> None:
    path = _write(tmp_path, _flip_record_byte(golden(), "image"))
    shard = roxxel.open_shard(path)
    [problem] = shard.verify()
    assert (problem.record, problem.field) == (0, "image")
    with pytest.raises(FormatError, match="rule R16 "):
        roxxel.open_shard(path, verify=True)[0]
    assert roxxel.open_shard(path, verify=True)[1]["label"] == -(10**12) + 7


def test_r17_rejects_text_that_is_not_utf8(tmp_path) -> None:
    data = golden()
    offset, _ = extent(data, "text", "data")
    data[offset] = 0xFF  # record 0's text is empty, record 2's starts at the column start
    shard = roxxel.open_shard(_write(tmp_path, data))
    with pytest.raises(FormatError, match="rule R17 "):
        shard[2]
    assert {(c.record, c.field) for c in shard.verify()} == {(2, "text")}


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_r18_a_bool_byte_other_than_0_or_1_is_refused(tmp_path, monkeypatch, codec) -> None:
    """Bytes 0, 2, 1 stored (checksums valid) by a writer that skips its own R18 guard."""
    from roxxel.format import schema as schema_module

    raw = np.frombuffer(bytes([0, 2, 1]), np.bool_)
    monkeypatch.setattr(schema_module, "_exact_cast", lambda array, field, where: array)
    path = tmp_path / "b.rxs"
    compress = {"flag": "zstd"} if codec == "zstd" else None
    records = [{"flag": raw[i : i + 1]} for i in range(3)]
    roxxel.write_shard(path, records, {"flag": "bool[1]"}, compress=compress)
    monkeypatch.undo()
    shard = roxxel.open_shard(path)
    if codec == "none":
        [problem] = shard.verify()
        assert (problem.record, problem.field) == (1, "flag") and "not 0 or 1" in problem.message
        with pytest.raises(FormatError, match="rule R18 "):
            roxxel.open_shard(path, verify=True).get_batch([0, 1])
    else:  # a compressed record is checked as it decodes, on every read
        with pytest.raises(FormatError, match="rule R18 "):
            shard[1]
    assert shard[2]["flag"].tolist() == [True]


def test_the_writer_stores_any_nonzero_bool_byte_as_1(tmp_path) -> None:
    raw = np.frombuffer(bytes([0, 7, 1, 255]), np.bool_)
    roxxel.write_shard(tmp_path / "b.rxs", [{"flag": raw}], {"flag": "bool[]"})
    shard = roxxel.open_shard(tmp_path / "b.rxs")
    assert shard.verify() == [] and shard[0]["flag"].view(np.uint8).tolist() == [0, 1, 1, 1]


# Arbitrary bytes -------------------------------------------------------------------------


def _open_and_read_all(path: Path) -> None:
    """Open and read every record: anything but FormatError is a bug."""
    try:
        shard = roxxel.open_shard(path)
        for i in range(len(shard)):
            shard[i]
        shard.get_batch(np.arange(len(shard)))
        shard.verify()
    except FormatError:
        pass


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_give_a_shard_or_format_error(tmp_path, data) -> None:
    path = tmp_path / "any.rxs"
    path.write_bytes(data)
    _open_and_read_all(path)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.sampled_from([GOLDEN, GOLDEN_ZSTD]),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
    resealed=st.booleans(),
)
def test_mutated_golden_files_give_a_shard_or_format_error(
    tmp_path, which, flips, resealed
) -> None:
    data = golden(which)
    for position, mask in flips:
        data[position % len(data)] ^= mask
    if resealed:
        try:
            data = reseal(data)
        except struct.error:
            return
    path = tmp_path / "flip.rxs"
    path.write_bytes(bytes(data))
    _open_and_read_all(path)


def test_meta_helper_reads_golden_metadata() -> None:
    assert meta(golden())["metadata"]["golden"] == 1


def test_r1_rejects_a_writer_temp_file_even_when_complete(tmp_path) -> None:
    path = tmp_path / ".shard-00000.rxs.1234.0badcafe.tmp"
    path.write_bytes(bytes(golden()))
    with pytest.raises(FormatError, match="temp file"):
        roxxel.open_shard(path)


# Issue 12: strict metadata JSON, capped record sizes, errors that carry their rule -------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"golden":1', b'"golden":1e400'),
        (b'"golden":1', b'"golden":1,"golden":2'),
        (b'"format_version":1', b'"format_version":true'),
        (b'"format_version":1', b'"format_version":1.0'),
        (b'"num_records":3', b'"num_records":3.0'),
    ],
)
def test_issue12_clear_errors_shard_metadata_is_strict_json(tmp_path, old, new) -> None:
    data = golden()
    t = trailer(data)
    raw = bytes(data[t.meta_offset : t.meta_offset + t.meta_bytes])
    assert raw.count(old) == 1
    check(edit_meta(data, lambda d: None, raw=raw.replace(old, new)), "R9", tmp_path)


@pytest.mark.parametrize(
    "spec", ["uint8[4294967296,4294967296]", "float64[1048576,1048577]", "int32[,4294967296,256]"]
)
def test_issue12_item15_a_record_past_the_size_cap_is_refused_where_the_schema_is_parsed(
    tmp_path, spec
) -> None:
    with pytest.raises(roxxel.ConfigError, match=r"'big'.*too large") as info:
        roxxel.Schema.parse({"big": spec})
    assert "2**40" in str(info.value)
    with pytest.raises(roxxel.ConfigError):
        roxxel.ShardWriter(tmp_path / "s.rxs", {"big": spec})
    assert list(tmp_path.iterdir()) == []
    assert roxxel.Field.parse("ok", "uint8[1048576,1048576]").unit_bytes == 1 << 40


def test_issue12_item15_a_shard_declaring_a_huge_field_is_refused(tmp_path) -> None:
    def huge(doc):
        field(doc, "image")["type"] = "uint8[4294967296,4294967296]"

    check(edit_meta(golden(), huge), "R10", tmp_path)
