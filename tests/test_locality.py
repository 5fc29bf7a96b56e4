"""The locality shuffle (issue 15): ``LoaderConfig(shuffle_group_shards=G)``.

Each epoch shuffles the shards, then the records within each group of G consecutive shards of
that list (`roxxel.sampling.order.ShardGroups`, rule S15 of docs/sampling.md). These tests
pin what that order promises: every epoch reads every record once, a group reads only its
shards, any position is a pure function of (seed, position, layout, G) whatever came before
or how many processes read, the default order is untouched, and the state refuses a restore
under another option.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.errors import ConfigError, StateError
from roxxel.format import writer as writer_module
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.loader.steps import picker_for
from roxxel.sampling.mixture import Mixture, Phase
from roxxel.sampling.order import (
    MAX_POSITION,
    KeyedPermutation,
    ShardGroups,
    epoch_key,
    group_key,
    records_for_draws,
)
from roxxel.sources.records import Records, TokenWindows, shard_starts_of

LAYOUT = [0, 5, 5, 12, 20, 21, 30, 37, 44, 50]  # 9 shards, one of them empty


def _shards_of(starts: list[int] | np.ndarray, records: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(starts), records, side="right") - 1


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> roxxel.Dataset:
    """600 records over many small shards; ``tokens`` of varying length."""
    path = tmp_path_factory.mktemp("locality") / "ds"
    schema = {"label": "int64", "tokens": "int32[]"}
    with roxxel.DatasetWriter(path, schema, shard_bytes=400) as writer:
        for i in range(600):
            writer.write({"label": i, "tokens": np.arange(1 + i % 7, dtype=np.int32) + i})
    ds = roxxel.open_dataset(path)
    assert ds.num_shards >= 20
    return ds


def _labels(loader: Loader, steps: int) -> list[list[int]]:
    out = []
    for _, batch in zip(range(steps), loader, strict=False):
        out.append(np.asarray(batch["label"]).tolist())
    return out


# ------------------------------------------------------------------ the rule (S15)


# 40 shards of 0-12 records: up to 40 groups among an epoch's draws (one network pass for
# all of them), where LAYOUT has at most 8 (a permutation call per group)
MANY = np.concatenate([[0], np.cumsum(np.random.default_rng(5).integers(0, 13, 40))]).tolist()


@pytest.mark.parametrize(
    ("layout", "group_shards"),
    [(LAYOUT, 1), (LAYOUT, 2), (LAYOUT, 3), (LAYOUT, 8), (LAYOUT, 100), (MANY, 1), (MANY, 3)],
)
def test_s15_every_epoch_reads_every_record_once_group_by_group(
    layout: list[int], group_shards: int
) -> None:
    groups = ShardGroups(layout, group_shards)
    n = layout[-1]
    for epoch in range(3):
        records = groups.records(np.arange(epoch * n, (epoch + 1) * n), seed=4, source=0)
        assert sorted(records.tolist()) == list(range(n))
        shards = _shards_of(layout, records)
        # the shards come in runs: a group's records are contiguous, and touch its shards only
        seen: set[int] = set()
        position = 0
        shard_key = group_key(4, 0, epoch, None)
        held = [k for k in range(len(layout) - 1) if layout[k + 1] > layout[k]]
        listed = [held[j] for j in KeyedPermutation(len(held), shard_key)(np.arange(len(held)))]
        for first in range(0, len(listed), group_shards):
            members = listed[first : first + group_shards]
            size = sum(layout[k + 1] - layout[k] for k in members)
            assert set(shards[position : position + size].tolist()) == set(members)
            local = records[position : position + size]
            # inside the group: the group's own keyed permutation of its items, in list order
            items = np.concatenate([np.arange(layout[k], layout[k + 1]) for k in members])
            perm = KeyedPermutation(size, group_key(4, 0, epoch, first // group_shards))
            assert local.tolist() == items[perm(np.arange(size))].tolist()
            seen |= set(members)
            position += size
        assert seen == set(held)


def test_s15_group_keys_never_equal_the_epoch_keys_of_the_global_shuffle() -> None:
    keys = {group_key(s, "web", e, g) for s in range(3) for e in range(3) for g in (None, 0, 1)}
    assert len(keys) == 27
    assert not keys & {epoch_key(s, "web", e) for s in range(3) for e in range(3)}
    assert group_key(0, 0, 0, None) == group_key(0, 0, 0, None)


# ------------------------------------------------------------------ pure function of the position


def test_issue15_locality_any_position_is_computed_directly_without_replay() -> None:
    groups = ShardGroups(LAYOUT, 2)
    n = LAYOUT[-1]
    far = np.array([10**12, 10**12 + 1, MAX_POSITION - 1, 7 * n + 3], np.int64)
    alone = [int(ShardGroups(LAYOUT, 2).records([d], seed=9, source=0)[0]) for d in far]
    assert groups.records(far, seed=9, source=0).tolist() == alone
    # one draw = the same draw inside a full epoch computed at once
    epoch, position = divmod(10**12, n)
    whole = groups.records(np.arange(epoch * n, (epoch + 1) * n), seed=9, source=0)
    assert int(whole[position]) == alone[0]


def test_issue15_locality_order_is_the_same_in_any_order_of_the_draws() -> None:
    groups = ShardGroups(LAYOUT, 3)
    draws = np.random.default_rng(0).permutation(np.arange(200))
    assert (
        groups.records(draws, seed=1, source=0)
        == groups.records(np.arange(200), seed=1, source=0)[draws]
    ).all()
    assert groups.records(draws.reshape(20, 10), seed=1, source=0).shape == (20, 10)


@pytest.mark.parametrize("start", [0, 1, 7, 29, 30, 61, 10**9])
def test_issue15_locality_a_loader_started_anywhere_equals_an_uninterrupted_run(
    dataset: roxxel.Dataset, start: int
) -> None:
    config = LoaderConfig(num_epochs=None, fields=("label",), shuffle_group_shards=3)
    with Loader(dataset, 20, seed=5, start_step=start, config=config) as loader:
        resumed = _labels(loader, 3)
    groups = ShardGroups(dataset.shard_starts, 3)
    draws = np.arange(start * 20, (start + 3) * 20).reshape(3, 20)
    assert resumed == groups.records(draws, seed=5, source=0).tolist()
    if start < 100:  # the same steps reached from step 0
        with Loader(dataset, 20, seed=5, config=config) as loader:
            assert _labels(loader, start + 3)[start:] == resumed


def test_issue15_locality_restore_equals_an_uninterrupted_run(dataset: roxxel.Dataset) -> None:
    config = LoaderConfig(num_epochs=2, fields=("label",), shuffle_group_shards=2)
    with Loader(dataset, 16, seed=1, config=config) as loader:
        whole = _labels(loader, 10**6)
    for k in (0, 1, 37, len(whole) - 1):
        with Loader(dataset, 16, seed=1, config=config) as first:
            _labels(first, k)
            state = first.state()
        with Loader(dataset, 16, seed=1, config=config) as second:
            second.restore(state)
            assert _labels(second, 10**6) == whole[k:]
    assert len(whole) == 2 * 600 // 16
    flat = np.asarray(whole[: 600 // 16]).ravel()
    assert len(set(flat.tolist())) == len(flat)  # no record twice inside an epoch


def test_issue15_locality_does_not_depend_on_the_number_of_processes(
    dataset: roxxel.Dataset,
) -> None:
    config = LoaderConfig(num_epochs=None, fields=("label",), shuffle_group_shards=4)
    picker = picker_for(
        Records(dataset, fields=["label"]), 32, config, seed=3, shuffle=True, group_shards=4
    )
    for step in (0, 5, 10**10):
        whole = picker.pick(step, np.arange(32))
        assert whole is not None
        for num_processes in (2, 4, 8):
            for rows in np.split(np.arange(32), num_processes):
                part = picker_for(
                    Records(dataset, fields=["label"]),
                    32,
                    config,
                    seed=3,
                    shuffle=True,
                    group_shards=4,
                ).pick(step, rows)
                assert part is not None
                assert part.records.tolist() == whole.records[rows].tolist()


# ------------------------------------------------------------------ locality


def test_issue15_locality_a_batch_touches_few_shards(dataset: roxxel.Dataset) -> None:
    starts = dataset.shard_starts
    grouped = ShardGroups(starts, 2).records(np.arange(600), seed=0, source=0)
    shuffled = records_for_draws(600, np.arange(600), seed=0, source=0, shuffle=True)
    per_batch = [len(set(_shards_of(starts, b).tolist())) for b in grouped.reshape(-1, 8)]
    assert max(per_batch) <= 4  # a batch (8 < any group) in one group, or across two
    assert min(len(set(_shards_of(starts, b).tolist())) for b in shuffled.reshape(-1, 8)) > 4


def test_issue15_locality_token_windows_group_by_the_shard_a_window_starts_in(
    dataset: roxxel.Dataset,
) -> None:
    windows = TokenWindows(dataset, "tokens", 5, stride=3)
    starts = windows.shard_starts
    element_starts = dataset.element_starts("tokens")
    assert starts[0] == 0 and starts[-1] == len(windows) and (np.diff(starts) >= 0).all()
    first = np.arange(len(windows)) * 3  # each window's first element
    expected = np.searchsorted(element_starts, first, side="right") - 1
    assert (_shards_of(starts, np.arange(len(windows))) == expected).all()
    assert (shard_starts_of(Records(dataset), "x") == dataset.shard_starts).all()
    config = LoaderConfig(num_epochs=1, shuffle_group_shards=2)
    with Loader(windows, 10, seed=0, config=config) as loader:
        rows = [np.asarray(b["tokens"]) for b in loader]
    assert sum(len(r) for r in rows) == len(windows) // 10 * 10


# ------------------------------------------------------------------ defaults, options, state


def test_issue15_locality_the_default_order_is_unchanged(dataset: roxxel.Dataset) -> None:
    config = LoaderConfig(num_epochs=None, fields=("label",))
    assert "shuffle_group_shards" not in config.order_json()
    with Loader(dataset, 8, seed=2, start_step=10**6, config=config) as loader:
        got = _labels(loader, 1)[0]
    draws = np.arange(8 * 10**6, 8 * 10**6 + 8)
    assert got == records_for_draws(600, draws, seed=2, source=0, shuffle=True).tolist()


def test_issue15_locality_a_state_under_another_option_is_refused(
    dataset: roxxel.Dataset,
) -> None:
    def state(group_shards: int | None) -> dict:
        config = LoaderConfig(fields=("label",), shuffle_group_shards=group_shards)
        with Loader(dataset, 8, seed=2, config=config) as loader:
            return loader.state()

    states = {g: state(g) for g in (None, 2, 3)}
    assert len({s["fingerprint"] for s in states.values()}) == 3
    for saved in (None, 2, 3):
        for used in (None, 2, 3):
            config = LoaderConfig(fields=("label",), shuffle_group_shards=used)
            with Loader(dataset, 8, seed=2, config=config) as loader:
                if saved == used:
                    loader.restore(states[saved])
                else:
                    with pytest.raises(StateError, match="shuffle_group_shards"):
                        loader.restore(states[saved])


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_issue15_locality_a_bad_group_size_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="shuffle_group_shards"):
        LoaderConfig(shuffle_group_shards=bad)  # type: ignore[arg-type]


def test_issue15_locality_needs_a_shuffled_single_source_with_shards(
    dataset: roxxel.Dataset,
) -> None:
    config = LoaderConfig(shuffle_group_shards=2)
    with pytest.raises(ConfigError, match="shuffle=False"):
        Loader(dataset, 8, shuffle=False, config=config)
    mixture = Mixture({"a": Records(dataset)}, [Phase({"a": 1})], batch_size=8)
    with pytest.raises(ConfigError, match="Mixture"):
        Loader(mixture, config=config)

    class Plain:
        @property
        def layout(self) -> dict:
            return {"x": ((), np.dtype(np.int64))}

        def __len__(self) -> int:
            return 4

        def read(self, indices: np.ndarray, out: dict) -> None:
            out["x"][: len(indices)] = indices

        def advise(self, indices: np.ndarray) -> None:
            pass

        def fingerprint(self) -> str:
            return "plain"

    with pytest.raises(ConfigError, match="shard layout"):
        Loader(Plain(), 2, config=config)


@pytest.mark.parametrize(
    "starts", [[], [1, 2], [0, 3, 2], [[0, 1]], [0.0, 1.0], [0, MAX_POSITION + 1]]
)
def test_issue15_locality_bad_shard_starts_are_config_errors(starts: list) -> None:
    with pytest.raises(ConfigError, match="shard_starts"):
        ShardGroups(np.asarray(starts), 2)


def test_issue15_locality_empty_sources_and_bad_draws() -> None:
    with pytest.raises(ConfigError, match="no items"):
        ShardGroups([0, 0], 1).records([0], seed=0, source=0)
    groups = ShardGroups([0, 3], 1)
    with pytest.raises(IndexError):
        groups.records([-1], seed=0, source=0)
    with pytest.raises(ConfigError):
        groups.records([MAX_POSITION], seed=0, source=0)
    assert groups.records([], seed=0, source=0).tolist() == []


# ------------------------------------------------------------------ golden vectors

# Pinned: a change here changes which record lands where under the option, so it is a
# roxxel version bump and a CHANGELOG.md line, like tests/data/order-golden.json.
GOLDEN_DRAWS = [0, 1, 2, 49, 50, 51, 10**6, 10**12, MAX_POSITION - 1]
GOLDEN = {
    1: [2, 3, 4, 19, 46, 45, 17, 4, 36],
    3: [32, 3, 10, 41, 28, 46, 35, 0, 34],
}


@pytest.mark.parametrize("group_shards", sorted(GOLDEN))
def test_issue15_locality_golden_order_vectors(group_shards: int) -> None:
    got = ShardGroups(LAYOUT, group_shards).records(GOLDEN_DRAWS, seed=11, source=0)
    assert got.tolist() == GOLDEN[group_shards]


def test_issue15_locality_golden_loader_rows_and_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "WRITER_VERSION", "0.1.0")  # as make_order_golden.py
    with roxxel.DatasetWriter(tmp_path / "ds", {"label": "int64"}, shard_bytes=80) as writer:
        for i in range(200):  # 20 shards of 10 records
            writer.write({"label": i})
    ds = roxxel.open_dataset(tmp_path / "ds")
    assert ds.shard_starts.tolist() == list(range(0, 201, 10))
    config = LoaderConfig(num_epochs=None, shuffle_group_shards=2)
    got = {}
    for step in (0, 1, 10**6, 10**12):
        with Loader(ds, 4, seed=7, start_step=step, config=config) as loader:
            got[step] = (_labels(loader, 1)[0], loader.state()["fingerprint"])
    fingerprint = "8cd17b3a654089c24ec9426abedea448"
    assert got == {
        0: ([60, 68, 69, 57], fingerprint),
        1: ([50, 63, 64, 66], fingerprint),
        10**6: ([153, 75, 73, 156], fingerprint),
        10**12: ([156, 24, 27, 159], fingerprint),
    }


def test_issue15_locality_peek_and_provenance_name_the_grouped_records(
    dataset: roxxel.Dataset,
) -> None:
    config = LoaderConfig(num_epochs=None, fields=("label",), provenance=True)
    grouped = LoaderConfig(
        num_epochs=None, fields=("label",), provenance=True, shuffle_group_shards=3
    )
    with Loader(dataset, 8, seed=6, start_step=40, config=grouped) as loader:
        batch = next(loader)
        peeked = [row["record"] for row in loader.peek(40)]
    assert np.asarray(batch["record"]).tolist() == peeked == np.asarray(batch["label"]).tolist()
    with Loader(dataset, 8, seed=6, start_step=40, config=config) as loader:
        assert np.asarray(next(loader)["record"]).tolist() != peeked
