"""Mixtures: interleave, phases, caps, exhaustion, seeking, continuation (roxxel.sampling.mixture)."""

from __future__ import annotations

import math
import types
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roxxel.errors import ConfigError
from roxxel.loader.steps import picker_for
from roxxel.sampling.interleave import Interleave, sort_draws
from roxxel.sampling.mixture import Cap, Mixture, Phase

WALK = 240  # positions walked one by one per example


class FakeSource:
    """Any object with a length is a source."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def fakes(*sizes: int) -> dict[str, FakeSource]:
    return {f"s{k}": FakeSource(n) for k, n in enumerate(sizes)}


POLICIES = st.sampled_from(["stop", "refill"])
WEIGHTS = st.one_of(
    st.just(0.0), st.just(1e-6), st.just(1.0), st.integers(1, 5), st.floats(0.01, 10.0)
)


@st.composite
def mixtures(draw, policy=POLICIES) -> Mixture:
    k = draw(st.integers(1, 16))
    names = [f"s{i}" for i in range(k)]
    sizes = draw(st.lists(st.integers(1, 40), min_size=k, max_size=k))
    num_phases = draw(st.integers(1, 3))
    ends = sorted(
        draw(st.lists(st.integers(1, 40), min_size=num_phases, max_size=num_phases, unique=True))
    )
    phases = []
    for p in range(num_phases):
        weights = {n: draw(WEIGHTS) for n in names}
        if not any(weights.values()):
            weights[draw(st.sampled_from(names))] = 1.0
        last = p == num_phases - 1
        end = draw(st.one_of(st.none(), st.just(ends[p]))) if last else ends[p]
        batch = draw(st.one_of(st.none(), st.integers(1, 9)))
        phases.append(Phase(weights, end_step=end, batch_size=batch))
    cap = st.one_of(
        st.none(),
        st.integers(0, 30).map(lambda s: Cap(samples=s)),
        st.sampled_from([0.5, 1, 1.5, 2.0]),
    )
    caps = {n: c for n in names if (c := draw(cap)) is not None}
    return Mixture(
        dict(zip(names, map(FakeSource, sizes), strict=True)),
        phases,
        batch_size=draw(st.integers(1, 8)),
        caps=caps,
        seed=draw(st.integers(0, 2**32)),
        shuffle=draw(st.booleans()),
        on_exhausted=draw(policy),
    )


def horizon(m: Mixture) -> int:
    return WALK if m.num_positions is None else min(WALK, m.num_positions)


def bound(m: Mixture) -> Fraction:
    """The documented bound: (K_p - 1) / 2 for the K_p sources a phase weights (>= 1/2)."""
    k_p = max(sum(1 for w in phase.weights.values() if w) for phase in m.phases)
    return Fraction(max(1, k_p - 1), 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures())
def test_walking_positions_one_by_one_matches_bulk_locate_and_counts(m: Mixture) -> None:
    stop = horizon(m)
    sources, draws = m.draws(0, stop)
    assert len(sources) == stop
    walked = [m.draws(t, t + 1) for t in range(stop)]
    assert [int(s[0]) for s, _ in walked] == sources.tolist()
    assert [int(d[0]) for _, d in walked] == draws.tolist()
    for t in range(stop + 1):
        expected = np.bincount(sources[:t], minlength=len(m.names))
        assert np.array_equal(m.counts(t), expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures())
def test_draws_of_each_source_are_consecutive_and_records_never_repeat_within_an_epoch(
    m: Mixture,
) -> None:
    stop = horizon(m)
    sources, draws = m.draws(0, stop)
    _, records = m.locate(0, stop)
    for k, size in enumerate(m.sizes):
        mine = draws[sources == k]
        assert mine.tolist() == list(range(len(mine)))  # nothing skipped, nothing repeated
        recs = records[sources == k]
        assert int(recs.min(initial=0)) >= 0 and int(recs.max(initial=0)) < size
        for e in range(0, len(mine), size):
            epoch = recs[e : e + size]
            assert len(set(epoch.tolist())) == len(epoch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures(policy=st.just("stop")))
def test_no_source_goes_above_its_cap(m: Mixture) -> None:
    final = m.counts(m.num_positions if m.num_positions is not None else 10**12)
    for k, cap in enumerate(m.caps):
        if cap is not None:
            assert final[k] <= cap


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures())
def test_every_prefix_stays_within_the_stated_bound_of_its_fluid_share(m: Mixture) -> None:
    for t in range(horizon(m) + 1):
        counts, shares = m.counts(t), m.shares(t)
        for k in range(len(m.names)):
            assert abs(counts[k] - shares[k]) <= bound(m), (t, k, counts, shares)


@settings(max_examples=80, deadline=None)
@given(
    weights=st.lists(st.integers(0, 50), min_size=1, max_size=3).filter(any),
    caps=st.lists(st.one_of(st.none(), st.integers(0, 40)), min_size=3, max_size=3),
)
def test_up_to_three_sources_stay_within_one_sample(weights: list[int], caps: list) -> None:
    il = Interleave(weights, caps[: len(weights)])
    stop = 300 if il.total is None else il.total
    for n in range(stop + 1):
        for c, f in zip(il.counts(n), il.fluid(n), strict=True):
            assert abs(c - f) <= 1


def test_equal_weights_stay_within_one_sample() -> None:
    il = Interleave([3] * 16, [None] * 16)
    for n in range(500):
        for c, f in zip(il.counts(n), il.fluid(n), strict=True):
            assert abs(c - f) < 1


def test_one_heavy_source_among_many_light_ones_can_lead_by_more_than_one() -> None:
    # The documented worst case of the divisor sequence: K - 1 light sources arrive together.
    il = Interleave([997, 1, 1, 1], [None] * 4)
    worst = max(
        abs(c - f) for n in range(1200) for c, f in zip(il.counts(n), il.fluid(n), strict=True)
    )
    assert 1 < worst <= Fraction(3, 2)


def test_exhausted_share_goes_to_the_others_in_proportion_to_their_weights() -> None:
    m = Mixture(
        fakes(5, 1000, 1000),
        {"s0": 1, "s1": 1, "s2": 2},
        batch_size=4,
        caps={"s0": Cap(samples=5)},
    )
    gone = m.exhausted_at()["s0"]
    sources, _ = m.draws(0, 400)
    assert np.count_nonzero(sources[:gone] == 0) == 5
    assert not np.any(sources[gone:] == 0)
    after = sources[gone:]
    for n in range(1, len(after) + 1):  # every prefix after exhaustion splits 1:2
        ones = np.count_nonzero(after[:n] == 1)
        assert abs(ones - Fraction(n, 3)) <= 1


def test_stream_stops_when_every_source_of_the_last_phase_is_exhausted() -> None:
    m = Mixture(fakes(3, 4), {"s0": 1, "s1": 1}, batch_size=2, caps={"s0": 1, "s1": Cap(samples=2)})
    assert m.num_positions == 5
    sources_, _ = m.locate(0, 100)
    assert len(sources_) == 5 and sorted(sources_.tolist()) == [0, 0, 0, 1, 1]
    assert m.locate(4, 6)[0].size == 1 and m.locate(5, 9)[0].size == 0


def test_a_middle_phase_that_runs_dry_ends_the_stream_under_stop() -> None:
    phases = [Phase({"s0": 1}, end_step=10), Phase({"s1": 1})]
    m = Mixture(fakes(3, 4), phases, batch_size=2, caps={"s0": 1})
    assert m.num_positions == 3
    assert m.draws(0, 50)[0].tolist() == [0, 0, 0]


def test_refill_gives_exhausted_sources_their_caps_again_and_continues_their_draws() -> None:
    m = Mixture(
        fakes(4, 6),
        {"s0": 1, "s1": 1},
        batch_size=2,
        caps={"s0": 0.5, "s1": 0.5},
        on_exhausted="refill",
    )
    assert m.num_positions is None
    sources_, draws = m.draws(0, 50)
    for k in (0, 1):
        assert draws[sources_ == k].tolist() == list(range(np.count_nonzero(sources_ == k)))
    assert m.counts(5 * 1000)[0] == 2 * 1000  # periodic: 2 + 3 draws per cycle of 5


def test_phases_change_weights_at_exact_step_boundaries_and_batch_sizes_add_up() -> None:
    phases = [
        Phase({"s0": 1}, end_step=3, batch_size=4),
        Phase({"s1": 1}, end_step=5, batch_size=2),
        Phase({"s0": 1, "s1": 1}),
    ]
    m = Mixture(fakes(100, 100), phases, batch_size=8)
    assert [m.position_at(s) for s in range(7)] == [0, 4, 8, 12, 14, 16, 24]
    assert [m.batch_size_at(s) for s in (0, 2, 3, 4, 5, 99)] == [4, 4, 2, 2, 8, 8]
    sources_, _ = m.draws(0, 24)
    assert sources_[:12].tolist() == [0] * 12 and sources_[12:16].tolist() == [1] * 4
    assert sorted(sources_[16:24].tolist()) == [0] * 4 + [1] * 4
    assert m.step_at(13) == 3 and m.step_at(16) == 5


@pytest.mark.parametrize("k", [1, 4, 16])
def test_seek_work_does_not_depend_on_the_position(k: int) -> None:
    weights = {f"s{i}": 1 + (i * 7919) % 13 for i in range(k)}
    phases = [Phase(weights, end_step=5), Phase({"s0": 1, **{f"s{i}": 0.5 for i in range(1, k)}})]
    m = Mixture(fakes(*[97] * k), phases, batch_size=64, caps={"s0": 3.0})
    bound = 3 * k + 2 + (k + 1).bit_length()  # see Interleave.counts

    def work(step: int) -> int:
        before = m.seek_work
        m.counts(m.position_at(step))
        return m.seek_work - before

    small = [work(s) for s in range(10, 40)]
    large = [work(2**40 + s) for s in range(30)] + [work(10**15 + s) for s in range(30)]
    assert max(large) <= bound and max(small) <= bound
    assert work(2**40) <= bound and work(10) <= bound
    before = m.seek_work
    m.locate(m.position_at(2**40), m.position_at(2**40 + 1))
    assert m.seek_work - before <= 2 * bound


def test_locate_far_away_returns_a_full_batch_with_valid_records() -> None:
    m = Mixture(fakes(1000, 333, 7), {"s0": 0.5, "s1": 0.3, "s2": 0.2}, batch_size=1024)
    start = m.position_at(10**9)
    sources_, records = m.locate(start, start + 1024)
    assert len(sources_) == 1024 and sources_.dtype == np.int32 and records.dtype == np.int64
    for k, size in enumerate(m.sizes):
        assert np.all(records[sources_ == k] < size)
    assert abs(np.count_nonzero(sources_ == 0) - 512) <= 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures(), data=st.data())
def test_resuming_at_any_position_equals_the_uninterrupted_stream(m: Mixture, data) -> None:
    stop = horizon(m)
    whole = m.locate(0, stop)
    cuts = {0, min(1, stop), stop, data.draw(st.integers(0, stop))}
    cuts |= {min(p, stop) for p in m.exhausted_at().values()}
    cuts |= {min(p, stop) for p in m.schedule.pos_starts}
    for cut in sorted(cuts):
        head, tail = m.locate(0, cut), m.locate(cut, stop)
        assert np.array_equal(np.concatenate([head[0], tail[0]]), whole[0])
        assert np.array_equal(np.concatenate([head[1], tail[1]]), whole[1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures(), data=st.data())
def test_continuing_with_a_new_schedule_repeats_and_skips_nothing(m: Mixture, data) -> None:
    last = m.end_step if m.end_step is not None else 40
    step = data.draw(st.integers(0, last))
    if m.num_positions is not None and m.position_at(step) > m.num_positions:
        return
    names = m.names
    weights = {n: data.draw(WEIGHTS) for n in names} | {names[0]: 1.0}
    phases = [
        Phase(weights, end_step=step + 5, batch_size=3),
        Phase({names[-1]: 2.0, names[0]: 1.0}),
    ]
    new = Mixture.continue_from(m, step, phases)
    switch = m.position_at(step)
    assert new.position_at(step) == switch and new.position_at(step + 1) == switch + 3
    assert np.array_equal(new.counts(switch), m.counts(switch))
    old_s, old_d = m.draws(0, switch)
    new_s, new_d = new.draws(switch, switch + 200)
    all_s, all_d = np.concatenate([old_s, new_s]), np.concatenate([old_d, new_d])
    for k in range(len(names)):
        mine = all_d[all_s == k]
        assert mine.tolist() == list(range(len(mine)))
    assert new.fingerprint() != m.fingerprint()
    with pytest.raises(IndexError):
        new.position_at(step - 1) if step else new.counts(switch - 1)


def test_continue_from_keeps_caps_counted_since_step_zero() -> None:
    old = Mixture(fakes(10, 10), {"s0": 1, "s1": 1}, batch_size=2, caps={"s0": 1})
    new = Mixture.continue_from(old, 4, {"s0": 3, "s1": 1})
    assert old.counts(8)[0] == 4
    total = new.counts(10**9)
    assert total[0] == 10  # the cap of one epoch holds across the switch


def test_fingerprint_changes_with_everything_that_decides_the_stream() -> None:
    src = fakes(10, 20)

    def fp(**kw) -> str:
        args = {"batch_size": 4, "caps": {}, "seed": 0} | kw
        phases = args.pop("phases", {"s0": 1, "s1": 2})
        return Mixture(src, phases, **args).fingerprint()

    base = fp()
    assert base == fp() == fp(phases={"s0": 0.5, "s1": 1.0})  # same integer weights
    variants = [
        fp(seed=1),
        fp(batch_size=5),
        fp(caps={"s0": 1}),
        fp(phases={"s0": 1, "s1": 3}),
        fp(shuffle=False),
        fp(phases=[Phase({"s0": 1}, end_step=3), Phase({"s1": 1})]),
        Mixture(fakes(10, 21), {"s0": 1, "s1": 2}, batch_size=4).fingerprint(),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_weights_are_exact_decimals_and_tiny_weights_still_draw() -> None:
    m = Mixture(fakes(10, 10), {"s0": 1e-6, "s1": 1.0}, batch_size=1)
    assert m.counts(500_000).tolist() == [0, 500_000]
    assert m.counts(500_001).tolist() == [1, 500_000]  # arrives at share 1/2: position 500000
    assert m.shares(1_000_001)[0] == Fraction(1, 1)


def test_sort_draws_is_exact_when_floats_collide() -> None:
    big = 2**52
    weights = [big + 1, big, 3]
    sources_ = np.array([0, 1, 2, 0, 1, 2], np.int64)
    draws = np.array([big // 2, big // 2, 1, 7, 7, 0], np.int64)
    order = sort_draws(sources_, draws, weights)
    keys = [
        (Fraction(2 * int(d) + 1, 2 * weights[int(s)]), int(s))
        for s, d in zip(sources_, draws, strict=True)
    ]
    assert [keys[i] for i in order] == sorted(keys)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"phases": {"s0": -1.0, "s1": 1}}, r"phases\[0\]\.weights\['s0'\]: negative"),
        ({"phases": {"s0": math.nan}}, "not finite"),
        ({"phases": {"s0": math.inf}}, "not finite"),
        ({"phases": {"s0": 0, "s1": 0.0}}, "all weights are zero"),
        ({"phases": {"nope": 1}}, r"unknown source \('nope'"),
        ({"phases": {"s0": "1"}}, "not a number"),
        ({"phases": {"s0": True}}, "not a number"),
        (
            {"phases": [Phase({"s0": 1}, end_step=5), Phase({"s1": 1}, end_step=5)]},
            "overlap or are out of order",
        ),
        (
            {"phases": [Phase({"s0": 1}, end_step=5), Phase({"s1": 1}, end_step=3)]},
            "overlap or are out of order",
        ),
        ({"phases": [Phase({"s0": 1}), Phase({"s1": 1})]}, "only the last phase may be open-ended"),
        ({"phases": [Phase({"s0": 1}, end_step=0)]}, "out of order"),
        ({"phases": []}, "no phases"),
        ({"phases": [{"s0": 1}]}, "not a Phase"),
        ({"caps": {"s0": -1}}, r"caps\['s0'\]\.epochs: negative"),
        ({"caps": {"s0": Cap(samples=-3)}}, "samples"),
        ({"caps": {"s0": Cap()}}, "exactly one"),
        ({"caps": {"s0": Cap(epochs=1, samples=2)}}, "exactly one"),
        ({"caps": {"zz": 1}}, r"unknown source \('zz'"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -4}, "batch_size"),
        ({"batch_size": None}, "no batch size"),
        ({"phases": [Phase({"s0": 1}, batch_size=0)]}, r"phases\[0\]\.batch_size"),
        ({"phases": [Phase({"s0": 1}, seq_len=0)]}, r"phases\[0\]\.seq_len"),
        ({"on_exhausted": "restart"}, "unknown policy"),
        ({"seed": -1}, "seed"),
        ({"shuffle": 1}, "shuffle"),
    ],
)
def test_bad_configuration_raises_a_precise_config_error(kwargs: dict, message: str) -> None:
    args = {"phases": {"s0": 1, "s1": 1}, "batch_size": 4} | kwargs
    phases = args.pop("phases")
    with pytest.raises(ConfigError, match=message):
        Mixture(fakes(5, 5), phases, **args)


def test_bad_sources_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="no sources"):
        Mixture({}, {"s0": 1}, batch_size=1)
    with pytest.raises(ConfigError, match="empty source"):
        Mixture({"s0": FakeSource(0)}, {"s0": 1}, batch_size=1)
    with pytest.raises(ConfigError, match="no length"):
        Mixture({"s0": object()}, {"s0": 1}, batch_size=1)  # type: ignore[dict-item]


def test_positions_and_steps_out_of_range_raise_index_error() -> None:
    m = Mixture(fakes(5), [Phase({"s0": 1}, end_step=3)], batch_size=2)
    assert m.position_at(3) == 6 and m.num_positions == 6
    with pytest.raises(IndexError):
        m.batch_size_at(3)
    with pytest.raises(IndexError):
        m.position_at(-1)
    with pytest.raises(IndexError):
        m.draws(5, 2)
    with pytest.raises(IndexError):
        m.counts(-1)


def reference_stream(m: Mixture, stop: int) -> list[tuple[int, int]]:
    """The documented semantics, position by position: (source, draw) of each position."""
    num, out = len(m.names), []
    consumed, allowance = [0] * num, list(m.caps)
    for p, phase in enumerate(m.phases):
        w = [Fraction(repr(float(phase.weights.get(n, 0)))) for n in m.names]
        length = m.schedule.num_positions(p)
        local = [0] * num
        remaining = [None if a is None else a - c for a, c in zip(allowance, consumed, strict=True)]
        done = 0
        while (length is None or done < length) and len(out) < stop:
            live = [
                k for k in range(num) if w[k] and (remaining[k] is None or local[k] < remaining[k])
            ]
            if not live:
                capped = [k for k in range(num) if w[k] and m.caps[k]]
                if m.on_exhausted == "stop" or not capped:
                    return out
                for k in capped:
                    allowance[k] += m.caps[k]
                remaining = [
                    None if a is None else a - c for a, c in zip(allowance, consumed, strict=True)
                ]
                local = [0] * num
                continue
            k = min(live, key=lambda k: (Fraction(2 * local[k] + 1, 2 * w[k]), k))
            out.append((k, consumed[k]))
            consumed[k], local[k], done = consumed[k] + 1, local[k] + 1, done + 1
        if len(out) >= stop or length is None:
            break
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=mixtures())
def test_locate_matches_a_position_by_position_reference_of_the_documented_semantics(
    m: Mixture,
) -> None:
    stop = horizon(m)
    expected = reference_stream(m, WALK)
    sources_, draws = m.draws(0, WALK)
    assert list(zip(sources_.tolist(), draws.tolist(), strict=True)) == expected
    assert len(expected) == stop


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1, 2, 3, 7, 100, 10**6]), min_size=1, max_size=12),
    data=st.data(),
)
def test_each_source_stays_within_its_own_rate_dependent_bound(weights: list[int], data) -> None:
    caps = data.draw(
        st.lists(
            st.one_of(st.none(), st.integers(1, 60)), min_size=len(weights), max_size=len(weights)
        )
    )
    il = Interleave(weights, caps)
    k_a = len(il.active)
    top = {k: Fraction(0) for k in il.active}  # each source's largest share of the fluid
    ends = {k: Fraction(caps[k], weights[k]) if caps[k] is not None else None for k in il.active}
    for v, rate in zip(il._seg_v, il._seg_rate, strict=True):
        for k in il.active:
            if rate and (ends[k] is None or ends[k] > v):
                top[k] = max(top[k], Fraction(weights[k], rate))
    stop = 400 if il.total is None else min(il.total, 400)
    for n in range(stop + 1):
        for k, (c, f) in enumerate(zip(il.counts(n), il.fluid(n), strict=True)):
            if k in top:
                assert abs(c - f) <= (1 + max(k_a - 2, 0) * top[k]) / 2, (n, k)


@settings(max_examples=80, deadline=None)
@given(
    weights=st.lists(
        st.one_of(st.integers(1, 10), st.integers(2**50, 2**70)), min_size=1, max_size=6
    ),
    data=st.data(),
)
def test_sort_draws_equals_an_exact_sort_for_any_weights(weights: list[int], data) -> None:
    num = data.draw(st.integers(1, 200))
    sources_ = np.asarray(
        data.draw(st.lists(st.integers(0, len(weights) - 1), min_size=num, max_size=num))
    )
    draws = np.asarray(
        data.draw(st.lists(st.integers(0, 2**40), min_size=num, max_size=num)), np.int64
    )
    order = sort_draws(sources_, draws, weights)
    keys = [
        (Fraction(2 * int(d) + 1, 2 * weights[int(s)]), int(s), i)
        for i, (s, d) in enumerate(zip(sources_, draws, strict=True))
    ]
    assert [keys[i][:2] for i in order] == [k[:2] for k in sorted(keys)]


# ---- window lengths per phase ------------------------------------------------------------


class FakeWindows:
    """A token stream of ``num_tokens`` cut into windows of ``seq_len`` (no targets)."""

    def __init__(self, num_tokens: int, seq_len: int) -> None:
        self.num_tokens, self.seq_len = num_tokens, seq_len

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def with_seq_len(self, seq_len: int) -> FakeWindows:
        return FakeWindows(self.num_tokens, seq_len)


LENGTHS = st.sampled_from([None, 2, 3, 4, 8])


@st.composite
def windowed_mixtures(draw) -> Mixture:
    k = draw(st.integers(1, 4))
    names = [f"w{i}" for i in range(k)]
    sources = {
        n: FakeWindows(draw(st.integers(16, 120)), draw(st.sampled_from([2, 4]))) for n in names
    }
    ends = sorted(draw(st.lists(st.integers(1, 30), min_size=3, max_size=3, unique=True)))
    phases = []
    for p, end in enumerate(ends):
        weights = {n: draw(st.integers(0, 3)) for n in names}
        weights[names[p % k]] = 1 + weights[names[p % k]]
        last_end = draw(st.one_of(st.none(), st.just(end))) if p == 2 else end
        batch = draw(st.one_of(st.none(), st.integers(1, 6)))
        phases.append(Phase(weights, end_step=last_end, batch_size=batch, seq_len=draw(LENGTHS)))
    cap = st.one_of(
        st.none(), st.sampled_from([0.5, 1, 1.5]), st.integers(0, 20).map(lambda s: Cap(samples=s))
    )
    caps = {n: c for n in names if (c := draw(cap)) is not None}
    policy = draw(POLICIES)
    args = {"batch_size": 4, "caps": caps, "seed": draw(st.integers(0, 99)), "on_exhausted": policy}
    return Mixture(sources, phases, **args)


def _records_by_space(m: Mixture, stop: int) -> dict[str, list[int]]:
    """Each space key -> the records drawn from it, in stream order, walking phase by phase."""
    found: dict[str, list[int]] = {}
    for p, first in enumerate(m.schedule.pos_starts):
        end = min(stop, m.schedule.pos_starts[p + 1] if p + 1 < len(m.phases) else stop)
        sources, records = m.locate(min(first, end), end)
        for k, r in zip(sources.tolist(), records.tolist(), strict=True):
            found.setdefault(m.spaces(p)[k].key, []).append(r)
    return found


def test_a_phase_seq_len_cuts_each_source_at_that_length_with_its_own_shuffle() -> None:
    web = FakeWindows(1000, 10)
    phases = [
        Phase({"web": 1}, end_step=5),
        Phase({"web": 1}, end_step=10, seq_len=20),
        Phase({"web": 1}, end_step=40),
    ]
    m = Mixture({"web": web}, phases, batch_size=4)
    assert [m.spaces(p)[0].key for p in range(3)] == ["web", "web|seq_len=20", "web"]
    assert [m.spaces(p)[0].size for p in range(3)] == [100, 50, 100]
    assert m.spaces(1)[0].source.seq_len == 20 and m.spaces(0)[0].source is web
    by_space = _records_by_space(m, m.position_at(40))
    # 20 windows at length 20: a fresh epoch of its own; length 10 resumes its epoch after it
    assert len(by_space["web|seq_len=20"]) == 20 == len(set(by_space["web|seq_len=20"]))
    ten = by_space["web"]
    assert len(ten) == 140 and sorted(ten[:100]) == list(range(100))
    assert ten[:20] == m.locate(0, 20)[1].tolist()
    # a source at its own length keeps the keys of a mixture without phase lengths
    plain = Mixture({"web": web}, [Phase({"web": 1}, end_step=5)], batch_size=4)
    assert plain.locate(0, 20)[1].tolist() == m.locate(0, 20)[1].tolist()
    same = Mixture({"web": web}, [Phase({"web": 1}, end_step=5, seq_len=10)], batch_size=4)
    assert same.locate(0, 20)[1].tolist() == plain.locate(0, 20)[1].tolist()


def test_caps_of_token_windows_count_tokens_across_lengths() -> None:
    web, code = FakeWindows(400, 4), FakeWindows(10_000, 4)  # web: 100 windows, 400 tokens
    phases = [Phase({"web": 1, "code": 1}, end_step=10), Phase({"web": 1, "code": 1}, seq_len=8)]
    m = Mixture({"web": web, "code": code}, phases, batch_size=6, caps={"web": 1.5})
    assert m.caps == (150, None)
    before = m.ledger_at(m.position_at(10))
    assert before.draws[0] == 30 and before.units[0] == 120
    end = m.exhausted_at()["web"]
    after = m.ledger_at(end)
    assert after.units[0] == 600 and after.draws[0] == 30 + 60  # (600 - 120) / 8 windows of 8
    assert after.by_space == {
        "web": 30,
        "code": 30,
        "web|seq_len=8": 60,
        "code|seq_len=8": end - 60 - 60,
    }
    ids = m.locate(end, end + 50)[0]
    assert np.all(ids == 1)  # the rest goes to code


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=windowed_mixtures(), data=st.data())
def test_windowed_mixtures_resume_anywhere_and_never_repeat_a_window_within_an_epoch(
    m, data
) -> None:
    stop = horizon(m)
    whole = m.locate(0, stop)
    cuts = {0, min(1, stop), stop, data.draw(st.integers(0, stop))}
    cuts |= {min(p, stop) for p in m.schedule.pos_starts}
    for cut in sorted(cuts):
        head, tail = m.locate(0, cut), m.locate(cut, stop)
        assert np.array_equal(np.concatenate([head[1], tail[1]]), whole[1])
    sizes = {s.key: s.size for p in range(len(m.phases)) for s in m.spaces(p)}
    for key, records in _records_by_space(m, stop).items():
        assert all(0 <= r < sizes[key] for r in records)
        for e in range(0, len(records), sizes[key]):  # each epoch at one length: no repeats
            epoch = records[e : e + sizes[key]]
            assert len(set(epoch)) == len(epoch)
    ledger = m.ledger_at(stop)
    for k, cap in enumerate(m._cap_units):
        if cap is not None and m.on_exhausted == "stop":
            assert ledger.units[k] <= cap


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=windowed_mixtures(), data=st.data())
def test_continuing_a_windowed_mixture_keeps_each_length_where_it_was(m, data) -> None:
    last = m.end_step if m.end_step is not None else 40
    step = data.draw(st.integers(0, last - 1))
    start = m.position_at(step)
    if m.num_positions is not None and start >= m.num_positions:
        return
    p = m.phase_at(step)
    rest = [Phase(ph.weights, ph.end_step, ph.batch_size, ph.seq_len) for ph in m.phases[p:]]
    same = Mixture.continue_from(m, step, rest)
    assert same.ledger_at(start) == m.ledger_at(start)
    stop = start + 60 if m.num_positions is None else m.num_positions
    if p + 1 < len(m.phases):
        stop = min(stop, m.schedule.pos_starts[p + 1])
    got, expected = same.locate(start, stop), m.locate(start, stop)
    for k in range(len(m.names)):  # each source goes on with the same windows, in order
        mine, theirs = got[1][got[0] == k], expected[1][expected[0] == k]
        n = min(len(mine), len(theirs))
        assert np.array_equal(mine[:n], theirs[:n])
    if step == m.schedule.step_starts[p]:  # at a phase start the interleave is the same too
        whole = same.locate(start, start + 80), m.locate(start, start + 80)
        assert np.array_equal(whole[0][0], whole[1][0]) and np.array_equal(whole[0][1], whole[1][1])


def test_continuing_keeps_what_refills_gave_back() -> None:
    """w1's cap of 5 windows was refilled many times in phase 1; continuing at phase 2 must
    not count those draws against one bare cap (found by hypothesis)."""
    sources = {"w0": FakeWindows(16, 2), "w1": FakeWindows(20, 2)}
    phases = [
        Phase({"w0": 1}, end_step=1),
        Phase({"w1": 1}, end_step=14),
        Phase({"w0": 1, "w1": 1}),
    ]
    m = Mixture(sources, phases, batch_size=4, caps={"w1": Cap(samples=5)}, on_exhausted="refill")
    same = Mixture.continue_from(m, 14, [Phase({"w0": 1, "w1": 1})])
    start = m.position_at(14)
    for got, want in zip(same.locate(start, start + 80), m.locate(start, start + 80), strict=True):
        np.testing.assert_array_equal(got, want)


def test_fingerprint_covers_each_phase_seq_len() -> None:
    def fp(seq_len):
        phases = [Phase({"w": 1}, end_step=3), Phase({"w": 1}, seq_len=seq_len)]
        return Mixture({"w": FakeWindows(100, 4)}, phases, batch_size=2).fingerprint()

    assert len({fp(None), fp(2), fp(8)}) == 3


def test_phase_lengths_a_source_cannot_take_are_config_errors() -> None:
    class Stated(FakeSource):
        tokens_per_sample = 4

    with pytest.raises(ConfigError, match=r"phases\[0\]\.seq_len: sources\['s'\]: cannot change"):
        Mixture({"s": Stated(5)}, [Phase({"s": 1}, seq_len=8)], batch_size=2)
    records = Mixture({"s": FakeSource(5)}, [Phase({"s": 1}, seq_len=8)], batch_size=2)
    assert records.spaces(0)[0].key == "s" and records.spaces(0)[0].unit == 1
    with pytest.raises(ConfigError, match=r"phases\[1\]\.seq_len: sources\['w'\]: no samples"):
        phases = [Phase({"w": 1}, end_step=2), Phase({"w": 1}, seq_len=200)]
        Mixture({"w": FakeWindows(100, 4)}, phases, batch_size=2)


# ---- issue 12: bounded weights, steps, positions, batch sizes and caps --------------------


def test_issue12_item14_weights_of_unbounded_ratio_are_refused_at_construction() -> None:
    for weights in ({"a": 5e-324, "b": 1e308}, {"a": 1, "b": 2**53 + 1}, {"a": 1e-300, "b": 1}):
        with pytest.raises(ConfigError, match=r"phases\[0\]\.weights: .*2\*\*53"):
            Mixture({"a": range(5), "b": range(5)}, weights, batch_size=2)
    fine = Mixture({"a": range(5), "b": range(5)}, {"a": 1, "b": 2**53}, batch_size=4)
    assert fine.locate(0, 8)[0].tolist() == [1] * 8
    tiny = Mixture({"a": range(5), "b": range(5)}, {"a": 1e-300, "b": 3e-300}, batch_size=4)
    assert tiny.counts(8).tolist() == [2, 6]


def test_issue12_item14_weights_whose_common_denominator_explodes_are_refused() -> None:
    primes = [p for p in range(2, 2000) if all(p % q for q in range(2, math.isqrt(p) + 1))]
    sources = {f"s{p}": range(3) for p in primes}
    weights = {f"s{p}": Fraction(p + 1, p) for p in primes}  # ratio < 2, lcm ~ e**2000
    with pytest.raises(ConfigError, match=r"weights: .*denominator"):
        Mixture(sources, weights, batch_size=2)


@pytest.mark.parametrize(
    ("phases", "options"),
    [
        ([Phase({"a": 1}, end_step=2**63 - 1)], {}),
        ([Phase({"a": 1}, end_step=2**62 + 1)], {}),
        ([Phase({"a": 1}, end_step=2**61)], {}),  # 2**61 steps of 4 rows: positions past 2**62
        ([Phase({"a": 1}, end_step=5)], {"batch_size": 2**62 + 1}),
        ([Phase({"a": 1}, end_step=5, batch_size=2**63)], {}),
        ([Phase({"a": 1}, seq_len=2**64)], {}),
        ([Phase({"a": 1})], {"caps": {"a": 1e300}}),
        ([Phase({"a": 1})], {"caps": {"a": Cap(samples=2**63)}}),
    ],
)
def test_issue12_clear_errors_steps_batches_and_caps_are_bounded(phases, options) -> None:
    kwargs = {"batch_size": 4, **options}
    with pytest.raises(ConfigError, match=r"2\*\*62"):
        Mixture({"a": range(5)}, phases, **kwargs)


def test_issue12_item7_positions_and_steps_at_the_limit_are_config_errors() -> None:
    m = Mixture({"a": range(5), "b": range(3)}, {"a": 1, "b": 1}, batch_size=4)
    last = m.locate(2**62 - 8, 2**62)  # the last positions there are
    assert len(last[0]) == 8 and int(last[1].min()) >= 0 and int(last[1].max()) < 5
    for start, stop in ((2**62, 2**62 + 4), (2**63, 2**63 + 4), (2**62 - 4, 2**64)):
        with pytest.raises(ConfigError, match=r"2\*\*62"):
            m.locate(start, stop)
        with pytest.raises(ConfigError, match=r"2\*\*62"):
            m.draws(start, stop)
    for step in (2**60 + 1, 2**62 + 1, 2**63):
        with pytest.raises(ConfigError, match=r"2\*\*62"):
            m.position_at(step)
    assert m.position_at(2**60 - 1) == 2**62 - 4
    with pytest.raises(ConfigError, match=r"2\*\*62"):
        Mixture.continue_from(m, 2**63, {"a": 1})


class _Ints:
    """A loader source of ``n`` records: record i is the int i."""

    def __init__(self, n: int) -> None:
        self.n = n

    @property
    def layout(self):
        return {"x": ((), np.dtype(np.int64))}

    def __len__(self) -> int:
        return self.n

    def read(self, indices, out) -> None:
        out["x"][: len(indices)] = indices

    def advise(self, indices) -> None: ...

    def fingerprint(self) -> str:
        return f"ints{self.n}"


@pytest.mark.parametrize("kind", ["single", "mixture"])
def test_issue12_item7_step_pickers_refuse_steps_whose_positions_pass_the_limit(kind) -> None:
    config = types.SimpleNamespace(fields=None, max_len=None, final_batch="pad", num_epochs=None)
    if kind == "single":
        picker = picker_for(_Ints(10), 8, config, seed=0, shuffle=True)
    else:
        mixture = Mixture({"a": _Ints(10), "b": _Ints(3)}, {"a": 1, "b": 1}, batch_size=8)
        picker = picker_for(mixture, None, config, seed=0, shuffle=True)
    rows, last = np.arange(8), 2**62 // 8 - 1
    for step in (last - 1, last):  # in order: the read-ahead block stops at the limit
        pick = picker.pick(step, rows)
        assert pick is not None and pick.num_read == 8 and int(pick.records.max()) < 10
    for step in (last + 1, 2**61, 2**63, 2**64):
        with pytest.raises(ConfigError, match=r"2\*\*62"):
            picker.pick(step, rows)


def test_issue13_item10_mixture_and_phase_reprs_show_sources_weights_batch_and_seed() -> None:
    sources = {"web": FakeSource(100), "code": FakeSource(10)}
    one = Mixture(sources, {"web": 0.7, "code": 0.3}, batch_size=4, seed=7)
    assert repr(one) == (
        "Mixture(sources={'web': 100, 'code': 10}, weights={'web': 0.7, 'code': 0.3}, "
        "batch_size=4, seed=7)"
    )
    assert repr(Phase({"web": Fraction(1, 3)}, end_step=10, seq_len=8)) == (
        "Phase({'web': 1/3}, end_step=10, seq_len=8)"
    )
    phases = [Phase({"web": 1}, end_step=10), Phase({"web": 1, "code": 1}, batch_size=8)]
    two = Mixture(sources, phases, batch_size=4, caps={"code": 1.5}, on_exhausted="refill")
    assert repr(two) == (
        "Mixture(sources={'web': 100, 'code': 10}, phases=[Phase({'web': 1}, end_step=10), "
        "Phase({'web': 1, 'code': 1}, batch_size=8)], batch_size=4, seed=0, caps={'code': 15}, "
        "on_exhausted='refill')"
    )
    later = Mixture.continue_from(two, 12, {"code": 1})
    assert repr(later).endswith("on_exhausted='refill', origin_step=12)")
    many = Mixture(sources, [Phase({"web": 1}, end_step=e) for e in (1, 2, 3, 4, 5)], batch_size=1)
    assert ", ... 2 more]" in repr(many) and len(repr(many)) < 250


def test_issue12_item7_interleave_windows_past_the_limit_are_config_errors() -> None:
    il = Interleave([2, 1], [None, None])
    sources, draws = il.window(2**62 - 3, 2**62)
    assert sources.tolist() == [1, 0, 0] and int(draws.max()) < 2**62
    for start, stop in ((2**62, 2**62 + 3), (2**63, 2**63 + 3), (0, 2**64)):
        with pytest.raises(ConfigError, match=r"2\*\*62"):
            il.window(start, stop)


def test_a_loader_reads_a_continued_mixture_from_its_origin(tmp_path) -> None:
    """Loader(Mixture.continue_from(...)) asked for the batch size at step 0, before the
    continued mixture's first step, and raised IndexError; with unchanged phases it must give
    the old mixture's batches from the switch on."""
    import roxxel
    from roxxel.loader.loader import Loader

    sources = {}
    for name in "ab":
        with roxxel.DatasetWriter(tmp_path / name, {"x": "int32"}) as w:
            for i in range(50):
                w.write({"x": i})
        sources[name] = roxxel.open_dataset(tmp_path / name)
    old = Mixture(sources, [Phase({"a": 0.5, "b": 0.5})], batch_size=4, seed=3)
    new = Mixture.continue_from(old, 5, [Phase({"a": 0.5, "b": 0.5})])
    with Loader(old, start_step=5) as a, Loader(new, start_step=5) as b:
        for _, x, y in zip(range(4), a, b, strict=False):
            np.testing.assert_array_equal(x["x"], y["x"])
    with pytest.raises(ConfigError, match="before the mixture's first step"):
        Loader(new, start_step=4)
