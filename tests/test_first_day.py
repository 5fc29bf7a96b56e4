"""A user's first day with the Loader and its sources (issue 13), and the loader's hardening
(issue 12): one seed, clear errors that say what to pass, no silent empty runs, declared
dtypes, bounded steps and sizes, and states that say what differs.

Runs on 8 CPU devices (tests/conftest.py sets the flag before jax loads).
"""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import roxxel
from roxxel.errors import ConfigError, StateError
from roxxel.loader.loader import Loader, LoaderConfig
from roxxel.sources.records import Records
from roxxel.sources.windows import TokenWindows

if jax.device_count() < 8:
    pytest.skip(f"needs 8 CPU devices ({jax.device_count()})", allow_module_level=True)

README = Path(__file__).resolve().parent.parent / "README.md"


def _write(path, schema, records):
    with roxxel.DatasetWriter(path, roxxel.Schema.parse(schema), shard_bytes=400) as writer:
        for record in records:
            writer.write(record)
    return roxxel.open_dataset(path)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    docs = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate([5, 9, 0, 30, 12] * 4)]
    return _write(
        tmp_path_factory.mktemp("tokens"), {"tokens": "int32[]"}, ({"tokens": d} for d in docs)
    )


@pytest.fixture(scope="module")
def short_tokens(tmp_path_factory):
    docs = [np.arange(n, dtype=np.uint16) + 60_000 for n in [7, 3, 11, 20] * 3]
    path = tmp_path_factory.mktemp("uint16")
    return _write(path, {"tokens": "uint16[]"}, ({"tokens": d} for d in docs))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    schema = {"tokens": "int32[]", "text": "str", "label": "int64"}
    rows = [
        {"tokens": np.arange(i % 7, dtype=np.int32), "text": "héllo"[: i % 6], "label": i}
        for i in range(30)
    ]
    return _write(tmp_path_factory.mktemp("records"), schema, rows)


def _mixture(tokens, short_tokens, **kwargs):
    a = TokenWindows(tokens, "tokens", 8)
    b = TokenWindows(short_tokens, "tokens", 8, dtype="int32")
    options = {"batch_size": 4, "seed": 1234, **kwargs}
    return roxxel.Mixture({"a": a, "b": b}, {"a": 1, "b": 1}, **options)


def _take(loader, num_steps):
    with loader:
        out = []
        for batch in loader:
            out.append({k: np.array(v) for k, v in batch.items()})
            if len(out) == num_steps:
                break
        return out


# --- item 1: one seed, one batch size -------------------------------------------------------


def test_issue13_item1_the_mixtures_seed_governs_and_state_reports_it(tokens, short_tokens):
    mixture = _mixture(tokens, short_tokens)
    loader = Loader(mixture)
    assert loader.state()["seed"] == 1234
    assert Loader(mixture, seed=1234).state()["seed"] == 1234
    other = _mixture(tokens, short_tokens, seed=5)
    a, b = _take(Loader(mixture), 3), _take(Loader(other), 3)
    assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b, strict=True))


def test_issue13_item1_a_loader_seed_unlike_the_mixtures_is_a_config_error(tokens, short_tokens):
    mixture = _mixture(tokens, short_tokens)
    with pytest.raises(ConfigError, match=r"Mixture\(seed="):
        Loader(mixture, seed=5)
    with pytest.raises(ConfigError, match="batch_size"):
        Loader(mixture, 8)
    assert Loader(mixture, 4).state()["seed"] == 1234


def test_issue13_item1_a_single_sources_order_is_unchanged_by_the_default_seed(tokens):
    windows = TokenWindows(tokens, "tokens", 4)
    config = LoaderConfig(num_epochs=None)
    default = _take(Loader(windows, 4, config=config), 5)
    zero = _take(Loader(windows, 4, seed=0, config=config), 5)
    for x, y in zip(default, zero, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    assert Loader(windows, 4, config=config).state()["seed"] == 0


# --- item 3: the README's loading block, as written -----------------------------------------


def _readme_loading_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if "roxxel.Loader(mix" in b]
    return block


def test_issue13_item3_the_readmes_loading_block_runs_with_an_embedding_step(tmp_path, monkeypatch):
    block = _readme_loading_block()
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        docs = [rng.integers(0, 256, 1500).astype(np.int32) for _ in range(4)]
        _write(tmp_path / "data" / name, {"tokens": "int32[]"}, ({"tokens": d} for d in docs))
    # the block's "..." is the user's train step: the one the issue's user wrote
    step_line = "        loss = step(emb, batch['tokens'])\n"
    assert "        ...\n" in block
    code = block.replace("        ...\n", step_line)
    code = code.replace("loader.state()", "loader.state()\n        if state['step'] == 2: break", 1)
    import jax.numpy as jnp

    scope = {"emb": jnp.ones((256, 4)), "step": jax.jit(lambda e, t: e[t].sum())}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["state"]["step"] == 2
    assert float(scope["loss"]) == 64 * 2049 * 4


# --- item 4: a loader that would yield no step ----------------------------------------------


def test_issue13_item4_seq_len_longer_than_the_stream_is_a_config_error(tokens):
    windows = TokenWindows(tokens, "tokens", 10_000)
    assert len(windows) == 0
    with pytest.raises(ConfigError, match="no step") as info:
        Loader(windows, 4)
    assert "10001" in str(info.value)  # the window's width against the stream's length


def test_issue13_item4_a_batch_larger_than_a_finite_dataset_is_a_config_error(records):
    with pytest.raises(ConfigError, match="no step"):
        Loader(records, 31, config=LoaderConfig(fields=("label",)))
    assert Loader(records, 31, config=LoaderConfig(fields=("label",), final_batch="pad"))
    assert Loader(records, 31, config=LoaderConfig(fields=("label",), num_epochs=2))


# --- item 6: a source declares its output dtype --------------------------------------------


def test_issue13_item6_token_windows_cast_to_a_declared_dtype_and_mix(tokens, short_tokens):
    plain = TokenWindows(short_tokens, "tokens", 8)
    cast = TokenWindows(short_tokens, "tokens", 8, dtype="int32")
    assert cast.layout["tokens"][1] == np.int32 and plain.layout["tokens"][1] == np.uint16
    indices = np.arange(len(plain))
    out_plain = {"tokens": np.zeros((len(indices), 9), np.uint16)}
    out_cast = {"tokens": np.zeros((len(indices), 9), np.int32)}
    plain.read(indices, out_plain)
    cast.read(indices, out_cast)
    np.testing.assert_array_equal(out_cast["tokens"], out_plain["tokens"].astype(np.int32))
    assert out_cast["tokens"].max() >= 60_000
    mixture = _mixture(tokens, short_tokens)
    batches = _take(Loader(mixture, config=LoaderConfig(provenance=True)), 4)
    assert all(b["tokens"].dtype == np.int32 for b in batches)
    for batch in batches:  # each row equals its own source's window, cast
        for row, (source, record) in enumerate(zip(batch["source"], batch["record"], strict=True)):
            windows = mixture.sources[int(source)]
            out = {"tokens": np.zeros((1, 9), windows.dtype)}
            windows.read(np.array([record]), out)
            np.testing.assert_array_equal(batch["tokens"][row], out["tokens"][0].astype(np.int32))
    assert any(b["source"].tolist().count(1) for b in batches)
    unlike = {"a": TokenWindows(tokens, "tokens", 8), "b": plain}
    with pytest.raises(ConfigError, match="mixture sources have different fields"):
        Loader(roxxel.Mixture(unlike, {"a": 1, "b": 1}, batch_size=4))


def test_issue13_item6_a_dtype_that_cannot_hold_every_value_is_refused(tokens, short_tokens):
    with pytest.raises(ConfigError, match="int16"):
        TokenWindows(short_tokens, "tokens", 8, dtype="int16")
    with pytest.raises(ConfigError, match="uint16"):
        TokenWindows(tokens, "tokens", 8, dtype=np.uint16)
    with pytest.raises(ConfigError, match="dtype"):
        TokenWindows(tokens, "tokens", 8, dtype="float32x")


def test_issue13_item6_the_fingerprint_names_the_dtype_only_when_given(short_tokens):
    plain = TokenWindows(short_tokens, "tokens", 8)
    same = TokenWindows(short_tokens, "tokens", 8, dtype=None)
    cast = TokenWindows(short_tokens, "tokens", 8, dtype="int32")
    assert plain.fingerprint() == same.fingerprint() != cast.fingerprint()
    assert cast.with_seq_len(4).layout["tokens"][1] == np.int32
    assert (
        cast.with_seq_len(4).fingerprint()
        == TokenWindows(short_tokens, "tokens", 4, dtype="int32").fingerprint()
    )


# --- item 7: sharding mistakes say what to pass --------------------------------------------


def _auto_mesh():
    return Mesh(np.array(jax.devices()), ("data",))


@pytest.mark.parametrize("kind", ["spec", "mesh", "string", "pair_of_strings", "dict_of_specs"])
def test_issue13_item7_sharding_mistakes_say_what_to_pass(tokens, kind):
    mesh = _auto_mesh()
    sharding = {
        "spec": P("data"),
        "mesh": mesh,
        "string": "data",
        "pair_of_strings": ("data", "data"),
        "dict_of_specs": {"tokens": P("data")},
    }[kind]
    windows = TokenWindows(tokens, "tokens", 4)
    with pytest.raises(ConfigError, match=r"\(mesh, spec\)") as info:
        Loader(windows, 8, sharding=sharding)
    assert "Sharding" in str(info.value)


def test_issue13_item7_a_bare_partition_spec_is_placed_on_the_context_mesh(tokens):
    mesh = _auto_mesh()
    windows = TokenWindows(tokens, "tokens", 4)
    expected = _take(Loader(windows, 8), 2)
    with jax.sharding.set_mesh(mesh):
        loader = Loader(windows, 8, sharding=P("data"))
    got = _take(loader, 2)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    with Loader(windows, 8, sharding=(mesh, P("data"))) as placed:
        batch = next(placed)
        assert batch["tokens"].sharding == NamedSharding(mesh, P("data"))


# --- item 8: Python habits -----------------------------------------------------------------


@pytest.mark.parametrize("field", ["token", "nope"])
def test_issue13_item8_an_unknown_token_field_lists_the_fields(tokens, field):
    with pytest.raises(ConfigError, match=r"\['tokens'\]"):
        TokenWindows(tokens, field, 8)


def test_issue13_item8_token_windows_take_a_path_or_say_open_it_first(tokens):
    by_path = TokenWindows(tokens.path, "tokens", 8)
    by_str = TokenWindows(str(tokens.path), "tokens", 8)
    assert (
        by_path.fingerprint()
        == by_str.fingerprint()
        == TokenWindows(tokens, "tokens", 8).fingerprint()
    )
    with pytest.raises(ConfigError, match="open_dataset"):
        TokenWindows([1, 2, 3], "tokens", 8)
    with pytest.raises(ConfigError, match="open_dataset"):
        Records({"tokens": [1, 2]})


def test_issue13_item8_a_finite_loader_has_a_length_an_infinite_one_says_why_not(records):
    config = LoaderConfig(fields=("label",), num_epochs=2)
    loader = Loader(records, 4, config=config)
    assert (
        len(loader) == loader.num_steps == 15 == len(_take(Loader(records, 4, config=config), 99))
    )
    forever = Loader(records, 4, config=LoaderConfig(fields=("label",), num_epochs=None))
    with pytest.raises(TypeError, match="no length"):
        len(forever)
    assert bool(forever)
    assert len(list(Loader(records, 8, config=LoaderConfig(fields=("label",))))) == 3


# --- item 9: max_len defaults to the longest record ----------------------------------------


def test_issue13_item9_max_len_defaults_to_the_longest_record_and_text_decodes(records):
    loader = Loader(records, 30, shuffle=False)
    (batch,) = _take(loader, 1)
    assert batch["tokens"].shape == (30, 6) and batch["text"].shape == (30, 6)  # "héllo": 6 bytes
    texts = [
        bytes(row[:n]).decode("utf-8")
        for row, n in zip(batch["text"], batch["text.length"], strict=True)
    ]
    assert texts == ["héllo"[: i % 6] for i in range(30)]
    assert Records(records).layout["tokens"][0] == (6,)
    assert Records(records, max_len={"tokens": 9}).layout["tokens"][0] == (9,)
    with pytest.raises(ConfigError, match="max_len"):
        Records(records, max_len={"tokens": 0})


# --- item 10: reprs, provenance dtypes -----------------------------------------------------


def test_issue13_item10_reprs_name_what_a_source_and_a_loader_are(tokens, records):
    windows = TokenWindows(tokens, "tokens", 8, dtype="int64")
    assert repr(windows).startswith("TokenWindows(") and "seq_len=8" in repr(windows)
    assert "int64" in repr(windows) and str(tokens.path) in repr(windows)
    assert "fields=['label']" in repr(Records(records, fields=["label"]))
    text = repr(Loader(windows, 4, seed=3, start_step=2))
    assert text.startswith("Loader(TokenWindows(") and "batch_size=4" in text
    assert "seed=3" in text and "step=2" in text


class _Huge:
    """A source of 2**31 + 1 items (reads give zeros): its last record is past int32."""

    @property
    def layout(self):
        return {"x": ((), np.dtype(np.int32))}

    def __len__(self) -> int:
        return 2**31 + 1

    def read(self, indices, out) -> None:
        out["x"][: len(indices)] = 0

    def advise(self, indices) -> None:
        pass

    def fingerprint(self) -> str:
        return "huge"


def test_issue13_item10_provenance_record_dtypes_are_stated_and_never_wrap(tokens):
    windows = TokenWindows(tokens, "tokens", 4)
    config = LoaderConfig(provenance=True)
    (host,) = _take(Loader(windows, 8, config=config), 1)
    assert host["record"].dtype == np.int64 and host["source"].dtype == np.int32
    sharding = (_auto_mesh(), P("data"))
    (placed,) = _take(Loader(windows, 8, sharding=sharding, config=config), 1)
    assert placed["record"].dtype == (np.int64 if jax.config.jax_enable_x64 else np.int32)
    np.testing.assert_array_equal(placed["record"], host["record"])
    huge = LoaderConfig(provenance=True, num_epochs=None)
    assert len(_take(Loader(_Huge(), 8, config=huge), 1)) == 1  # numpy keeps int64
    if not jax.config.jax_enable_x64:
        with pytest.raises(ConfigError, match="jax_enable_x64"):
            Loader(_Huge(), 8, sharding=sharding, config=huge)


# --- issue 12 item 7: bounded steps ---------------------------------------------------------


@pytest.mark.parametrize("step", [2**59, 2**62, 2**63, 2**70])
def test_issue12_item7_a_start_step_past_the_position_bound_is_refused(tokens, step):
    windows = TokenWindows(tokens, "tokens", 4)
    with pytest.raises(ConfigError, match=r"2\*\*62"):
        Loader(windows, 8, start_step=step, config=LoaderConfig(num_epochs=None))


def test_issue12_item7_restoring_a_step_past_the_bound_is_a_state_error(tokens):
    windows = TokenWindows(tokens, "tokens", 4)
    config = LoaderConfig(num_epochs=None)
    loader = Loader(windows, 8, config=config)
    state = loader.state()
    with pytest.raises(StateError, match=r"2\*\*62"):
        loader.restore({**state, "step": 2**61})
    assert loader.step == 0
    last = 2**62 // 8 - 1
    with Loader(windows, 8, start_step=last, config=config) as edge:
        assert next(edge)["tokens"].shape == (8, 5)
    with Loader(windows, 8, config=config) as edge:
        edge.restore({**state, "step": last})
        assert next(edge)["tokens"].shape == (8, 5)


# --- issue 12 item 18: sizes checked before allocating --------------------------------------


@pytest.mark.parametrize("what", ["batch", "max_len"])
def test_issue12_item18_sizes_are_checked_against_the_source_before_allocating(records, what):
    config = LoaderConfig(fields=("tokens",), num_epochs=None)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="max_batch_bytes"):
            if what == "batch":
                Loader(records, 10**9, config=config)
            else:
                Loader(
                    records, 8, config=LoaderConfig(fields=("tokens",), max_len={"tokens": 10**9})
                )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


# --- issue 12 clear errors and issue 11 point 6: states -------------------------------------


@pytest.mark.parametrize(("key", "value"), [("version", True), ("seed", 1.0), ("step", 2.0)])
def test_issue12_clear_errors_state_values_must_be_ints(records, key, value):
    loader = Loader(records, 4, seed=1, config=LoaderConfig(fields=("label",)))
    with pytest.raises(StateError, match=key):
        loader.restore({**loader.state(), key: value})


def test_issue11_point6_a_state_error_names_the_fields_that_differ(records):
    saved = Loader(records, 4, config=LoaderConfig(fields=("label",), num_epochs=2)).state()
    assert saved["config"]["batch_size"] == 4 and saved["config"]["num_epochs"] == 2
    other = Loader(records, 5, config=LoaderConfig(fields=("label",), num_epochs=3))
    with pytest.raises(StateError) as info:
        other.restore(saved)
    message = str(info.value)
    assert "batch_size (4, now 5)" in message and "num_epochs (2, now 3)" in message
    assert "shuffle" not in message


def test_issue11_point6_a_state_without_a_description_still_restores(records):
    loader = Loader(records, 4, config=LoaderConfig(fields=("label",), num_epochs=None))
    old = {k: v for k, v in loader.state().items() if k != "config"}
    loader.restore({**old, "step": 7})
    assert loader.step == 7
    with pytest.raises(StateError, match="fingerprint"):
        loader.restore({**old, "fingerprint": "0" * 32})


def test_issue11_point6_an_old_mixture_state_with_the_old_default_seed_restores(
    tokens, short_tokens
):
    loader = Loader(_mixture(tokens, short_tokens))
    old = {k: v for k, v in loader.state().items() if k != "config"}
    loader.restore({**old, "seed": 0, "step": 3})  # states before one seed said 0
    assert loader.step == 3
    with pytest.raises(StateError, match="seed"):
        loader.restore({**loader.state(), "seed": 0})


@pytest.mark.parametrize("step", [2**60, 2**63, 2**70])  # batch size 4: 2**60 * 4 = 2**62
def test_issue12_item7_a_mixture_refuses_a_step_past_the_bound_on_start_and_restore(
    tokens, short_tokens, step
):
    mixture = _mixture(tokens, short_tokens)
    with pytest.raises(ConfigError, match=r"2\*\*62"):
        Loader(mixture, start_step=step)
    loader = Loader(mixture)
    with pytest.raises(StateError, match=r"2\*\*62"):
        loader.restore({**loader.state(), "step": step})
    assert loader.step == 0


def test_issue13_item3_the_batch_carries_the_meshs_axis_types(tokens):
    windows = TokenWindows(tokens, "tokens", 4)
    explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with Loader(windows, 8, sharding=(explicit, P("data"))) as loader:
        assert "@data" in str(jax.typeof(next(loader)["tokens"]))  # sharding in the type
    with Loader(windows, 8, sharding=(auto, P("data"))) as loader:
        batch = next(loader)["tokens"]
        assert "@" not in str(jax.typeof(batch)) and batch.sharding.spec == P("data")


def test_issue13_item4_a_mixture_that_ends_before_its_first_batch_is_a_config_error(records):
    capped = roxxel.Mixture(
        {"a": records, "b": records}, {"a": 1, "b": 1}, batch_size=4, caps={"a": 0.05, "b": 0.05}
    )
    config = LoaderConfig(fields=("label",))
    with pytest.raises(ConfigError, match="no step"):
        Loader(capped, config=config)
    padded = Loader(capped, config=LoaderConfig(fields=("label",), final_batch="pad"))
    assert [b["valid"].tolist() for b in _take(padded, 9)] == [[True, True, False, False]]


def test_issue12_clear_errors_numpy_ints_are_accepted_and_bools_refused(records):
    config = LoaderConfig(fields=("label",), max_len={"label": np.int64(3)})
    loader = Loader(records, np.int64(8), seed=np.uint64(2), start_step=np.int32(1), config=config)
    assert next(iter(loader))["label"].shape == (8,)
    for bad in (True, 8.0, "8"):
        with pytest.raises(ConfigError, match="batch_size"):
            Loader(records, bad, config=config)  # pyright: ignore[reportArgumentType]


def test_issue11_point6_a_state_error_names_the_source_parameter_that_differs(tokens):
    config = LoaderConfig(num_epochs=None)
    saved = Loader(TokenWindows(tokens, "tokens", 8), 4, config=config).state()
    with pytest.raises(StateError, match=r"source\.seq_len \(8, now 9\)"):
        Loader(TokenWindows(tokens, "tokens", 9), 4, config=config).restore(saved)
