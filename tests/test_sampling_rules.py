"""The numbered order and mixture rules of docs/sampling.md (S1-S14), one test (or more) each.

Sources are plain ``range`` objects (a mixture only needs their length) except where a rule
is about token windows or the loader.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

import numpy as np
import pytest

import roxxel
from roxxel.errors import StateError
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sampling import order
from roxxel.sampling.mixture import Cap, Mixture, Phase
from roxxel.sources.windows import TokenWindows


def _sources(*sizes: int) -> dict[str, range]:
    return {name: range(n) for name, n in zip("abcd", sizes, strict=False)}


def _per_source(mixture: Mixture, start: int, stop: int) -> dict[int, list[int]]:
    ids, draws = mixture.draws(start, stop)
    out: dict[int, list[int]] = {}
    for k, d in zip(ids.tolist(), draws.tolist(), strict=True):
        out.setdefault(k, []).append(d)
    return out


def test_s1_every_epoch_reads_every_record_once_and_no_shuffle_is_identity() -> None:
    n = 13
    records = order.records_for_draws(n, np.arange(5 * n), seed=4, source="a", shuffle=True)
    for e in range(5):
        assert sorted(records[e * n : (e + 1) * n].tolist()) == list(range(n))
    assert records[:n].tolist() != records[n : 2 * n].tolist()  # a fresh shuffle per epoch
    plain = order.records_for_draws(n, np.arange(3 * n), seed=4, source="a", shuffle=False)
    assert plain.tolist() == [d % n for d in range(3 * n)]


def test_s2_epoch_key_is_the_documented_blake2b_and_names_key_sources() -> None:
    text = b"7|str:web|3"
    digest = hashlib.blake2b(text, digest_size=8, person=b"roxxel.order").digest()
    assert order.epoch_key(7, "web", 3) == int.from_bytes(digest, "little")
    int_text = b"7|int:2|0"
    int_digest = hashlib.blake2b(int_text, digest_size=8, person=b"roxxel.order").digest()
    assert order.epoch_key(7, 2, 0) == int.from_bytes(int_digest, "little")
    perm = order.KeyedPermutation(50, order.epoch_key(7, "web", 1))
    got = order.records_for_draws(50, np.arange(50, 100), seed=7, source="web", shuffle=True)
    assert got.tolist() == perm(np.arange(50)).tolist()


def test_s2_adding_a_source_does_not_reshuffle_the_others() -> None:
    two = Mixture(_sources(20, 30), {"a": 1, "b": 1}, batch_size=4, seed=3)
    three = Mixture(
        {"c": range(9), **_sources(20, 30)}, {"a": 1, "b": 1, "c": 1}, batch_size=4, seed=3
    )
    ids2, rec2 = two.locate(0, 200)
    ids3, rec3 = three.locate(0, 300)
    for name, k2, k3 in (("a", 0, 1), ("b", 1, 2)):
        first2 = rec2[ids2 == k2][:40].tolist()
        assert first2 == rec3[ids3 == k3][:40].tolist(), name


def test_s3_a_steps_rows_are_its_positions_for_a_single_source(tmp_path) -> None:
    with roxxel.DatasetWriter(tmp_path / "d", {"label": "int64"}) as w:
        for i in range(11):
            w.write({"label": i})
    config = LoaderConfig(num_epochs=None, provenance=True)
    for step in (0, 3, 10**9):
        with Loader(
            roxxel.open_dataset(tmp_path / "d"), 4, seed=2, start_step=step, config=config
        ) as loader:
            batch = next(iter(loader))
        draws = step * 4 + np.arange(4)
        expect = order.records_for_draws(11, draws, seed=2, source=0, shuffle=True)
        assert batch["record"].tolist() == expect.tolist()
        assert batch["label"].tolist() == expect.tolist()


def test_s3_positions_add_up_steps_times_batch_over_earlier_phases() -> None:
    phases = [
        Phase({"a": 1}, end_step=3),
        Phase({"a": 1}, end_step=5, batch_size=10),
        Phase({"a": 1}),
    ]
    m = Mixture(_sources(7), phases, batch_size=4)
    assert [m.position_at(s) for s in range(7)] == [0, 4, 8, 12, 22, 32, 36]
    assert [m.batch_size_at(s) for s in (2, 3, 4, 5)] == [4, 10, 10, 4]
    assert m.step_at(21) == 3 and m.step_at(22) == 4


def test_s4_weights_are_exact_and_only_their_ratios_matter() -> None:
    halves = Mixture(_sources(5, 5), {"a": 0.5, "b": 1}, batch_size=3)
    ints = Mixture(_sources(5, 5), {"a": 1, "b": 2}, batch_size=3)
    exact = Mixture(_sources(5, 5), {"a": Fraction(1, 3), "b": Fraction(2, 3)}, batch_size=3)
    assert halves.fingerprint() == ints.fingerprint() == exact.fingerprint()
    assert halves.draws(0, 99)[0].tolist() == ints.draws(0, 99)[0].tolist()
    tenths = Mixture(_sources(5, 5), {"a": 0.3, "b": 0.7}, batch_size=10)
    assert tenths.counts(10 * 1000).tolist() == [3000, 7000]


def test_s5_draws_arrive_at_odd_half_multiples_and_ties_go_to_the_lower_id() -> None:
    weights = {"a": 3, "b": 2, "c": 1}
    m = Mixture(_sources(100, 100, 100), weights, batch_size=1, shuffle=False)
    keys = [
        (Fraction(2 * j + 1, 2 * w), k) for k, w in enumerate(weights.values()) for j in range(60)
    ]
    expect = [k for _, k in sorted(keys)][:120]
    assert m.draws(0, 120)[0].tolist() == expect
    tie = Mixture(_sources(10, 10), {"a": 1, "b": 1}, batch_size=1)
    assert tie.draws(0, 4)[0].tolist() == [0, 1, 0, 1]


def test_s6_draws_advance_only_when_picked_and_count_across_phases() -> None:
    phases = [Phase({"a": 1, "b": 3}, end_step=5), Phase({"a": 2, "b": 1, "c": 1})]
    m = Mixture(_sources(7, 9, 4), phases, batch_size=4)
    per = _per_source(m, 0, 200)
    for k, draws in per.items():
        assert draws == list(range(len(draws))), k
    assert [m.counts(p).tolist() for p in (0, 20)] == [[0, 0, 0], [5, 15, 0]]


def test_s7_caps_bound_the_draws_over_the_whole_run() -> None:
    caps = {"a": Cap(epochs=Fraction(3, 2)), "b": Cap(samples=4), "c": 0}
    m = Mixture(_sources(10, 9, 5, 3), {"a": 1, "b": 1, "c": 1, "d": 1}, batch_size=2, caps=caps)
    counts = m.counts(2 * 500).tolist()
    assert counts[:3] == [15, 4, 0]
    assert m.caps[:3] == (15, 4, 0)


def test_s8_after_a_cap_the_rest_share_positions_by_their_weights() -> None:
    m = Mixture(
        _sources(50, 50, 50), {"a": 1, "b": 2, "c": 1}, batch_size=1, caps={"b": Cap(samples=6)}
    )
    end = m.exhausted_at()["b"]
    after = m.draws(end, end + 200)[0]
    assert 1 not in after.tolist()
    assert abs(int((after == 0).sum()) - int((after == 2).sum())) <= 1
    # the others keep their arrival times: the stream is the capped interleave of the keys
    keys = [
        (Fraction(2 * j + 1, 2 * w), k) for k, w in ((0, 1), (1, 2), (2, 1)) for j in range(150)
    ]
    keys = [(t, k) for t, k in keys if k != 1 or t < Fraction(2 * 6 + 1, 2 * 2)]
    assert m.draws(0, end + 200)[0].tolist() == [k for _, k in sorted(keys)][: end + 200]


def _labels(path, num: int) -> roxxel.Dataset:
    with roxxel.DatasetWriter(path, {"label": "int64"}) as w:
        for i in range(num):
            w.write({"label": i})
    return roxxel.open_dataset(path)


def test_s9_stop_ends_the_stream_when_every_weighted_source_is_capped(tmp_path) -> None:
    m = Mixture(_sources(5, 3), {"a": 2, "b": 1}, batch_size=4, caps={"a": 1, "b": 1})
    assert m.num_positions == 8
    assert len(m.draws(0, 100)[0]) == 8
    datasets = {"a": _labels(tmp_path / "a", 5), "b": _labels(tmp_path / "b", 3)}
    m = Mixture(datasets, {"a": 2, "b": 1}, batch_size=3, caps={"a": 1, "b": 1})
    with Loader(m, config=LoaderConfig(final_batch="pad", provenance=True)) as loader:
        batches = list(loader)
    assert [b["valid"].tolist() for b in batches] == [[True] * 3] * 2 + [[True, True, False]]


def test_s10_refill_gives_caps_again_and_draws_go_on_where_they_stopped() -> None:
    m = Mixture(
        _sources(10, 6),
        {"a": 1, "b": 1},
        batch_size=4,
        caps={"a": Cap(samples=3), "b": Cap(samples=2)},
        on_exhausted="refill",
    )
    assert m.num_positions is None
    ids, draws = m.draws(0, 50)
    cycle = ids[:5].tolist()
    assert ids.tolist() == (cycle * 10)  # every refill cycle has the same interleave
    assert draws[ids == 0].tolist() == list(range(30))  # no draw repeated early
    records = m.locate(0, 50)[1][ids == 0].tolist()
    assert sorted(records[:10]) == list(range(10))  # the rest of the shuffled epoch first


def test_s11_each_phase_starts_a_fresh_interleave_while_draws_keep_counting() -> None:
    phases = [Phase({"a": 1, "b": 1}, end_step=1), Phase({"a": 1, "b": 1})]
    m = Mixture(_sources(9, 9), phases, batch_size=3)
    assert m.draws(0, 3)[0].tolist() == [0, 1, 0]
    ids, draws = m.draws(3, 6)
    assert ids.tolist() == [0, 1, 0]  # a fresh interleave: 'a' first again
    assert draws.tolist() == [2, 1, 3]


def test_s12_a_phase_seq_len_recuts_windows_under_its_own_key_and_caps_count_tokens(
    tmp_path,
) -> None:
    with roxxel.DatasetWriter(tmp_path / "t", {"tokens": "int32[]"}) as w:
        for i in range(10):
            w.write({"tokens": np.arange(10, dtype=np.int32) + 10 * i})
    web = TokenWindows(roxxel.open_dataset(tmp_path / "t"), "tokens", 4, targets=False)
    phases = [Phase({"web": 1}, end_step=2), Phase({"web": 1}, seq_len=10)]
    m = Mixture({"web": web}, phases, batch_size=2, seed=1, caps={"web": Cap(samples=20)})
    own, long = m.spaces(0)[0], m.spaces(1)[0]
    assert (own.key, own.size, own.unit) == ("web", 25, 4)
    assert (long.key, long.size, long.unit) == ("web|seq_len=10", 10, 10)
    _, records = m.locate(4, 8)
    perm = order.KeyedPermutation(10, order.epoch_key(1, "web|seq_len=10", 0))
    assert records.tolist() == perm(np.arange(4)).tolist()
    # 20 samples of 4 tokens = 80 tokens: 16 before phase 1, then 6 windows of 10
    assert m.num_positions == 4 + 6


def test_s13_continue_from_neither_repeats_nor_skips_a_draw() -> None:
    old = Mixture(_sources(11, 7, 5), {"a": 2, "b": 1, "c": 1}, batch_size=4, seed=9, caps={"c": 1})
    new = Mixture.continue_from(
        old, 6, [Phase({"a": 1, "b": 3, "c": 1}, end_step=20), Phase({"a": 1})]
    )
    at = old.position_at(6)
    assert new.position_at(6) == at and new.counts(at).tolist() == old.counts(at).tolist()
    before, after = _per_source(old, 0, at), _per_source(new, at, new.position_at(20))
    for k in range(3):
        assert before.get(k, []) + after.get(k, []) == list(
            range(len(before.get(k, [])) + len(after.get(k, [])))
        )
    assert sum(after.get(2, [])) + sum(before.get(2, [])) == sum(range(5))  # the cap counts from 0
    with pytest.raises(IndexError):
        new.position_at(5)


def test_s14_the_fingerprint_covers_the_stream_and_the_loader_refuses_another() -> None:
    base = {"sources": _sources(5, 6), "phases": {"a": 1, "b": 2}}
    fp = Mixture(**base, batch_size=2, seed=1).fingerprint()
    others = [
        Mixture(**base, batch_size=2, seed=2),
        Mixture(**base, batch_size=3, seed=1),
        Mixture(**base, batch_size=2, seed=1, shuffle=False),
        Mixture(**base, batch_size=2, seed=1, caps={"a": 1}),
        Mixture(**base, batch_size=2, seed=1, caps={"a": 1}, on_exhausted="refill"),
        Mixture(_sources(5, 7), {"a": 1, "b": 2}, batch_size=2, seed=1),
        Mixture(_sources(5, 6), {"a": 1, "b": 3}, batch_size=2, seed=1),
    ]
    assert len({fp, *(m.fingerprint() for m in others)}) == len(others) + 1


def test_s14_a_loader_refuses_the_state_of_another_mixture(tmp_path) -> None:
    datasets = {"a": _labels(tmp_path / "a", 5), "b": _labels(tmp_path / "b", 6)}
    one = Mixture(datasets, {"a": 1, "b": 2}, batch_size=2, seed=1)
    two = Mixture(datasets, {"a": 1, "b": 3}, batch_size=2, seed=1)
    with Loader(one, seed=1) as first, Loader(two, seed=1) as second:
        second.restore(second.state())
        with pytest.raises(StateError):
            second.restore(first.state())
