"""Token windows and record sources against naive references."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import roxxel
from roxxel.errors import ConfigError
from roxxel.loader.steps import picker_for
from roxxel.sources.records import Records, as_source, takes_rows
from roxxel.sources.windows import TokenWindows, blend_of

SCHEMA = {"tokens": "int32[]", "label": "int64", "image": "uint8[2,3]", "text": "str"}


def _docs(num_docs: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, num_docs)
    lengths[::7] = 0  # empty documents must leave no trace
    return [rng.integers(0, 50_000, n).astype(np.int32) for n in lengths]


def _write(path, docs, shard_bytes=3000):
    schema = roxxel.Schema.parse(SCHEMA)
    with roxxel.DatasetWriter(path, schema, shard_bytes=shard_bytes) as writer:
        for i, doc in enumerate(docs):
            image = np.full((2, 3), i % 251, np.uint8)
            writer.write({"tokens": doc, "label": i, "image": image, "text": "x" * (i % 5)})
    return roxxel.open_dataset(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    docs = _docs(300, seed=0)
    return _write(tmp_path_factory.mktemp("views"), docs), docs


def _naive_document_fields(docs, start, width):
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    ids = doc_of[start : start + width]
    segments = np.cumsum(np.concatenate([[1], ids[1:] != ids[:-1]]))
    positions = np.zeros(width, np.int64)
    for j in range(1, width):
        positions[j] = 0 if ids[j] != ids[j - 1] else positions[j - 1] + 1
    return segments, positions


def _read_all(windows, indices):
    out = {k: np.full((len(indices), *s), -7, d) for k, (s, d) in windows.layout.items()}
    windows.read(np.asarray(indices), out)
    return out


@pytest.mark.parametrize(
    ("seq_len", "targets", "stride"),
    [(16, True, None), (16, False, None), (9, True, 4), (64, False, 64)],
)
def test_token_windows_equal_slices_of_the_naive_concatenation(corpus, seq_len, targets, stride):
    ds, docs = corpus
    flat = np.concatenate(docs)
    windows = TokenWindows(ds, "tokens", seq_len, targets=targets, stride=stride)
    width, step = seq_len + int(targets), stride or seq_len
    assert len(windows) == (len(flat) - width) // step + 1
    got = _read_all(windows, np.arange(len(windows)))["tokens"]
    expected = np.stack([flat[i * step : i * step + width] for i in range(len(windows))])
    np.testing.assert_array_equal(got, expected)


def test_token_windows_cross_shard_boundaries(corpus):
    ds, docs = corpus
    flat = np.concatenate(docs)
    windows = TokenWindows(ds, "tokens", 32)
    starts = ds.element_starts("tokens")
    assert ds.num_shards >= 3
    crossing = [
        i for i in range(len(windows)) if np.any((starts > i * 32) & (starts < i * 32 + 33))
    ]
    assert crossing, "the fixture must have windows that cross shard boundaries"
    got = _read_all(windows, crossing)["tokens"]
    for row, i in enumerate(crossing):
        np.testing.assert_array_equal(got[row], flat[i * 32 : i * 32 + 33])


def test_segment_ids_and_positions_reset_at_document_starts(corpus):
    ds, docs = corpus
    windows = TokenWindows(ds, "tokens", 24, document_structure=True)
    indices = np.arange(len(windows))[::-1]  # any order
    out = _read_all(windows, indices)
    assert out["segment_ids"].dtype == np.int32 and out["positions"].dtype == np.int32
    for row, i in enumerate(indices):
        segments, positions = _naive_document_fields(docs, int(i) * 24, 25)
        np.testing.assert_array_equal(out["segment_ids"][row], segments)
        np.testing.assert_array_equal(out["positions"][row], positions)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=40),
    seq_len=st.integers(1, 20),
    shard_bytes=st.sampled_from([64, 200, 10_000]),
)
def test_windows_match_naive_for_arbitrary_documents_and_shards(
    tmp_path_factory, lengths, seq_len, shard_bytes
):
    docs = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate(lengths)]
    ds = _write(tmp_path_factory.mktemp("prop"), docs, shard_bytes=shard_bytes)
    flat = np.concatenate(docs)
    windows = TokenWindows(ds, "tokens", seq_len, document_structure=True)
    assert len(windows) == max(0, (len(flat) - seq_len - 1) // seq_len + 1)
    if len(windows) == 0:
        return
    out = _read_all(windows, np.arange(len(windows)))
    for i in range(len(windows)):
        np.testing.assert_array_equal(
            out["tokens"][i], flat[i * seq_len : i * seq_len + seq_len + 1]
        )
        segments, positions = _naive_document_fields(docs, i * seq_len, seq_len + 1)
        np.testing.assert_array_equal(out["segment_ids"][i], segments)
        np.testing.assert_array_equal(out["positions"][i], positions)


def test_split_targets_are_the_window_shifted_by_one(corpus):
    ds, docs = corpus
    flat = np.concatenate(docs)
    whole = TokenWindows(ds, "tokens", 12, document_structure=True)
    split = TokenWindows(ds, "tokens", 12, document_structure=True, split_targets=True)
    assert len(split) == len(whole)
    assert split.layout["inputs"] == split.layout["targets"] == ((12,), np.dtype(np.int32))
    indices = np.arange(len(split))
    got, ref = _read_all(split, indices), _read_all(whole, indices)
    np.testing.assert_array_equal(got["inputs"], ref["tokens"][:, :-1])
    np.testing.assert_array_equal(got["targets"], ref["tokens"][:, 1:])
    np.testing.assert_array_equal(got["segment_ids"], ref["segment_ids"][:, :-1])
    np.testing.assert_array_equal(got["positions"], ref["positions"][:, :-1])
    np.testing.assert_array_equal(
        got["targets"][-1], flat[len(split) * 12 - 11 : len(split) * 12 + 1]
    )
    with pytest.raises(ConfigError):
        TokenWindows(ds, "tokens", 12, targets=False, split_targets=True)


def test_read_rejects_a_window_index_out_of_range(corpus):
    windows = TokenWindows(corpus[0], "tokens", 16)
    with pytest.raises(IndexError):
        _read_all(windows, [len(windows)])
    with pytest.raises(IndexError):
        _read_all(windows, [-1])


@pytest.mark.parametrize(
    ("field", "seq_len", "stride"),
    [("label", 8, None), ("text", 8, None), ("tokens", 0, None), ("tokens", 8, 0)],
)
def test_token_windows_reject_bad_fields_and_lengths(corpus, field, seq_len, stride):
    with pytest.raises(ConfigError):
        TokenWindows(corpus[0], field, seq_len, stride=stride)


def test_fingerprints_name_content_and_parameters(corpus, tmp_path):
    ds, docs = corpus
    base = TokenWindows(ds, "tokens", 16).fingerprint()
    assert base == TokenWindows(roxxel.open_dataset(ds.path), "tokens", 16).fingerprint()
    assert base != TokenWindows(ds, "tokens", 17).fingerprint()
    assert base != TokenWindows(ds, "tokens", 16, targets=False).fingerprint()
    assert base != TokenWindows(ds, "tokens", 16, document_structure=True).fingerprint()
    other = _write(tmp_path / "other", docs[:-1])
    assert base != TokenWindows(other, "tokens", 16).fingerprint()
    assert (
        Records(ds, fields=["label"]).fingerprint() != Records(ds, fields=["image"]).fingerprint()
    )


def test_records_pad_variable_fields_to_max_len_with_lengths(corpus):
    ds, docs = corpus
    records = Records(ds, max_len={"tokens": 40, "text": 8})
    layout = records.layout
    assert layout["tokens"] == ((40,), np.dtype(np.int32))
    assert layout["tokens.length"] == ((), np.dtype(np.int64))
    assert layout["text"] == ((8,), np.dtype(np.uint8))
    indices = np.array([5, 299, 0, 150, 7])
    out = {k: np.full((5, *s), 99, d) for k, (s, d) in layout.items()}
    records.read(indices, out)
    for row, i in enumerate(indices):
        n = len(docs[i])
        assert out["tokens.length"][row] == n
        np.testing.assert_array_equal(out["tokens"][row, :n], docs[i])
        assert not out["tokens"][row, n:].any()
        assert out["label"][row] == i
        assert bytes(out["text"][row, : out["text.length"][row]]) == b"x" * (i % 5)
    records.advise(indices)  # a hint only: must not raise or change anything


def test_records_pad_variable_fields_to_their_longest_record_unless_max_len_says(corpus):
    ds, docs = corpus
    longest = max(len(d) for d in docs)
    assert Records(ds, fields=["tokens"]).layout["tokens"] == ((longest,), np.dtype(np.int32))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="max_len"):
            Records(ds, fields=["tokens"], max_len={"tokens": bad})
    assert Records(corpus[0], fields=["label", "image"]).layout["image"] == (
        (2, 3),
        np.dtype(np.uint8),
    )


def test_records_refuse_a_record_longer_than_max_len(corpus):
    ds, docs = corpus
    longest = int(np.argmax([len(d) for d in docs]))
    records = Records(ds, fields=["tokens"], max_len={"tokens": 3})
    out = {k: np.zeros((1, *s), d) for k, (s, d) in records.layout.items()}
    with pytest.raises(ConfigError, match="max_len"):
        records.read(np.array([longest]), out)


def test_as_source_wraps_a_dataset_and_passes_sources_through(corpus):
    ds = corpus[0]
    windows = TokenWindows(ds, "tokens", 8)
    assert as_source(windows) is windows
    assert isinstance(as_source(ds, fields=["label"]), Records)
    with pytest.raises(ConfigError):
        as_source(object())


def _record_advice(monkeypatch):
    calls = []
    real = roxxel.format.reader.Shard.advise

    def spy(shard, field, start, stop):
        calls.append((str(shard.path), field, start, stop))
        real(shard, field, start, stop)

    monkeypatch.setattr(roxxel.format.reader.Shard, "advise", spy)
    return calls


def _covered(calls, path, field, lo, hi):
    return any(p == path and f == field and a <= lo and hi <= b for p, f, a, b in calls)


def test_window_advice_covers_every_byte_the_windows_read(corpus, monkeypatch):
    ds = corpus[0]
    calls = _record_advice(monkeypatch)
    windows = TokenWindows(ds, "tokens", 32)
    indices = np.arange(len(windows))[::3]
    windows.advise(indices)
    assert 0 < len(calls) <= len(indices)  # merged: never more than one call per window
    for start in (indices * 32).tolist():
        for shard, lo, hi in windows._pieces(start, windows.width):
            assert _covered(calls, str(ds.shard(shard).path), "tokens", lo * 4, hi * 4)


def test_record_advice_covers_the_fixed_fields_of_every_record(corpus, monkeypatch):
    ds = corpus[0]
    calls = _record_advice(monkeypatch)
    indices = np.array([3, 250, 17, 18, 120])
    Records(ds, fields=["label", "image"]).advise(indices)
    shard_ids, local = ds.locate(indices)
    for shard, i in zip(shard_ids.tolist(), local.tolist(), strict=True):
        path = str(ds.shard(shard).path)
        assert _covered(calls, path, "label", i * 8, i * 8 + 8)
        assert _covered(calls, path, "image", i * 6, i * 6 + 6)


def test_with_seq_len_keeps_every_option_and_a_default_stride_follows(corpus):
    ds, docs = corpus
    flat = np.concatenate(docs)
    windows = TokenWindows(ds, "tokens", 8, document_structure=True, split_targets=True)
    assert windows.with_seq_len(8) is windows and windows.tokens_per_sample == 8
    longer = windows.with_seq_len(16)
    assert (longer.seq_len, longer.stride, longer.tokens_per_sample) == (16, 16, 16)
    assert longer.layout["inputs"][0] == (16,) and longer.layout["segment_ids"][0] == (16,)
    assert len(longer) == (len(flat) - 17) // 16 + 1
    assert longer.fingerprint() != windows.fingerprint()
    np.testing.assert_array_equal(_read_all(longer, [3])["inputs"][0], flat[48:64])
    strided = TokenWindows(ds, "tokens", 8, targets=False, stride=4).with_seq_len(12)
    assert (strided.stride, strided.width, strided.targets) == (4, 12, False)


def _rows_read(source, indices, rows, num_rows):
    out = {k: np.full((num_rows, *s), 99, d) for k, (s, d) in source.layout.items()}
    source.read(np.asarray(indices), out, rows=np.asarray(rows))
    return out


@pytest.mark.parametrize(
    "options",
    [{}, {"document_structure": True}, {"split_targets": True, "document_structure": True}],
)
def test_token_windows_read_into_given_rows_equals_a_plain_read(corpus, options):
    windows = TokenWindows(corpus[0], "tokens", 32, **options)
    indices = np.arange(len(windows))[::-1]  # crosses every shard boundary
    rows = np.random.default_rng(0).permutation(len(indices) + 5)[: len(indices)]
    got, ref = _rows_read(windows, indices, rows, len(indices) + 5), _read_all(windows, indices)
    untouched = np.setdiff1d(np.arange(len(indices) + 5), rows)
    for name in windows.layout:
        np.testing.assert_array_equal(got[name][rows], ref[name])
        assert (got[name][untouched] == 99).all()


def test_records_read_into_given_rows_equals_a_plain_read(corpus):
    records = Records(corpus[0], max_len={"tokens": 40, "text": 8})
    indices, rows = np.array([5, 299, 0, 150, 7]), np.array([3, 0, 6, 1, 4])
    got, ref = _rows_read(records, indices, rows, 7), _rows_read(records, indices, range(5), 5)
    for name in records.layout:
        np.testing.assert_array_equal(got[name][rows], ref[name])
        assert (got[name][[2, 5]] == 99).all()


def test_read_refuses_rows_that_are_not_one_per_index(corpus):
    for source in (TokenWindows(corpus[0], "tokens", 8), Records(corpus[0], fields=["label"])):
        with pytest.raises(ConfigError, match="one per index"):
            _rows_read(source, [0, 1, 2], [0, 1], 3)
    assert takes_rows(source) and not takes_rows(lambda: None)


@pytest.mark.parametrize("split_targets", [False, True])
def test_a_window_blend_reads_what_each_source_reads(corpus, tmp_path, split_targets):
    other = _write(tmp_path, _docs(120, seed=3), shard_bytes=700)
    sources = [
        TokenWindows(corpus[0], "tokens", 16, split_targets=split_targets),
        TokenWindows(other, "tokens", 16, stride=5, split_targets=split_targets),
        TokenWindows(corpus[0], "tokens", 16, stride=7, split_targets=split_targets),
    ]
    blend = blend_of(sources)
    assert blend is not None
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 3, 400)
    indices = np.array([rng.integers(0, len(sources[k])) for k in ids.tolist()])
    out = {k: np.full((400, *s), -7, d) for k, (s, d) in sources[0].layout.items()}
    blend.read(ids, indices, out)
    for k, source in enumerate(sources):
        ref = _read_all(source, indices[ids == k])
        for name in source.layout:
            np.testing.assert_array_equal(out[name][ids == k], ref[name])
    with pytest.raises(IndexError, match="of source 1"):
        blend.read(np.array([0, 1]), np.array([0, len(sources[1])]), out)


def test_blend_of_needs_token_windows_of_one_cut_without_documents(corpus):
    ds = corpus[0]
    assert blend_of([TokenWindows(ds, "tokens", 8), Records(ds, fields=["label"])]) is None
    assert blend_of([TokenWindows(ds, "tokens", 8), TokenWindows(ds, "tokens", 9)]) is None
    assert blend_of([TokenWindows(ds, "tokens", 8, document_structure=True)]) is None
    assert blend_of([]) is None


class _NoRows:
    """A source whose ``read`` takes no ``rows=``: a mixture reads it through a block."""

    def __init__(self, inner):
        self.inner = inner

    layout = property(lambda self: self.inner.layout)
    advise = property(lambda self: self.inner.advise)
    fingerprint = property(lambda self: self.inner.fingerprint)

    def __len__(self):
        return len(self.inner)

    def read(self, indices, out):
        self.inner.read(indices, out)


def _mixture_batches(sources, num_steps):
    mixture = roxxel.Mixture(
        dict(zip("abc", sources, strict=True)), {"a": 3, "b": 2, "c": 1}, batch_size=16
    )
    config = types.SimpleNamespace(fields=None, max_len=None, final_batch="drop")
    plan = picker_for(mixture, None, config, seed=0, shuffle=True)
    rows, batches = np.arange(16), []
    for step in range(num_steps):
        pick = plan.pick(step, rows)
        host = {k: np.full((16, *s), 99, d) for k, (s, d) in sources[0].layout.items()}
        plan.fill(pick, host)
        batches.append(host)
    return batches


@pytest.mark.parametrize("kind", ["windows", "records"])
def test_mixture_batches_are_the_same_whichever_way_sources_take_rows(corpus, kind):
    ds = corpus[0]
    if kind == "windows":  # one pass (a blend), or each source into its rows, or blocks
        make = lambda: TokenWindows(ds, "tokens", 8)  # noqa: E731
    else:
        make = lambda: Records(ds, max_len={"tokens": 40, "text": 8})  # noqa: E731
    plain = [make() for _ in range(3)]
    wrapped = [_NoRows(source) for source in plain]
    mixed = [plain[0], wrapped[1], make()]
    ref = _mixture_batches(wrapped, 12)
    for sources in (plain, mixed):
        for got, want in zip(_mixture_batches(sources, 12), ref, strict=True):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
