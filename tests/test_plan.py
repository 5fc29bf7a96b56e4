"""Planning a mixture (roxxel.sampling.report) and building it from TOML (Mixture.from_toml)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from roxxel.errors import ConfigError
from roxxel.sampling.mixture import Cap, Mixture, Phase
from roxxel.sampling.report import plan_report, plot_shares, share_curve


class FakeSource:
    def __init__(self, n: int, tokens_per_sample: int | None = None) -> None:
        self.n = n
        if tokens_per_sample is not None:
            self.tokens_per_sample = tokens_per_sample

    def __len__(self) -> int:
        return self.n


class FakeWindows:
    """Windows of ``seq_len`` over ``num_tokens`` tokens, resizable like `TokenWindows`."""

    def __init__(self, num_tokens: int, seq_len: int) -> None:
        self.num_tokens, self.seq_len = num_tokens, seq_len

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    def with_seq_len(self, seq_len: int) -> FakeWindows:
        return FakeWindows(self.num_tokens, seq_len)


def curriculum() -> Mixture:
    web = FakeWindows(1000 * 2048, 2048)
    sources = {"web": web, "code": FakeSource(50), "math": FakeSource(20)}
    phases = [
        Phase({"web": 3, "code": 1}, end_step=10),
        Phase({"web": 1, "code": 1, "math": 2}, end_step=30, batch_size=8, seq_len=4096),
    ]
    return Mixture(sources, phases, batch_size=4, caps={"math": Cap(samples=12)})


def test_plan_report_lists_each_phase_and_source_with_exact_samples() -> None:
    m = curriculum()
    report = plan_report(m)
    lines = report.splitlines()
    assert lines[1].startswith("stream: 200 positions")
    phase0 = lines.index("phase 0: steps [0, 10), batch 4")
    web0 = lines[phase0 + 2].split()
    assert web0[:4] == ["web", "75.00%", "30", "61,440"]  # 3/4 of 40 positions, 2048 tokens each
    phase1 = lines.index("phase 1: steps [10, 30), batch 8, seq_len 4096")
    web1, math1 = lines[phase1 + 2].split(), lines[phase1 + 4].split()
    web1_samples = int(m.counts(200)[0]) - 30
    # web's windows are 4096 tokens long in phase 1: 500 of them make an epoch
    assert web1[:5] == [
        "web",
        "25.00%",
        f"{web1_samples}",
        f"{web1_samples * 4096:,}",
        f"{web1_samples / 500:.3f}",
    ]
    assert math1[:5] == ["math", "50.00%", "12", "-", "0.600"]  # records: no window length
    out_step = m.step_at(m.exhausted_at()["math"] - 1)
    assert math1[5] == f"{out_step}" and 10 <= out_step < 30
    assert (
        lines[-2]
        == "total: web "
        + f"{int(m.counts(200)[0]):,}"
        + ", code "
        + f"{int(m.counts(200)[1]):,}"
        + ", math 12"
    )
    assert lines[-1] == f"total tokens: web {30 * 2048 + web1_samples * 4096:,}"


def test_plan_report_needs_num_steps_for_an_endless_stream() -> None:
    m = Mixture({"a": FakeSource(5)}, {"a": 1}, batch_size=2)
    with pytest.raises(ConfigError, match="never ends"):
        plan_report(m)
    report = plan_report(m, num_steps=10**12)
    assert "phase 0: steps [0, 1,000,000,000,000), batch 2" in report
    assert "2,000,000,000,000" in report and "400000000000.000" in report
    with pytest.raises(ConfigError, match="num_steps"):
        plan_report(m, num_steps=0)


def test_plan_report_stops_at_the_end_of_a_stream_that_runs_dry() -> None:
    m = Mixture(
        {"a": FakeSource(5), "b": FakeSource(3)},
        {"a": 1, "b": 1},
        batch_size=2,
        caps={"a": 1, "b": 1},
    )
    report = plan_report(m)
    assert "planned steps [0, 4)" in report and report.endswith("total: a 5, b 3")


def test_share_curve_follows_the_weights_of_each_phase() -> None:
    m = curriculum()
    steps, shares = share_curve(m, points=30)
    assert steps[0] == 0 and steps[-1] == 30
    assert np.allclose(shares.sum(axis=0), 1.0)
    first = steps[:-1] < 10
    assert np.allclose(shares[0, first].mean(), 0.75, atol=0.05)
    assert np.all(shares[2, first] == 0)


def test_plot_shares_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install roxxel\[plot\]"):
        plot_shares(curriculum(), tmp_path / "out.png")


def test_plot_shares_writes_an_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_shares(curriculum(), tmp_path / "shares.png", num_steps=30)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TOML = """
seed = 7
batch_size = 4
on_exhausted = "stop"

[sources.web]
path = "data/web"
field = "tokens"

[sources.code]
path = "/abs/code"
epochs = 1.5

[sources.math]
path = "data/math"
samples = 3

[[phases]]
end_step = 10
weights = { web = 0.7, code = 0.3 }

[[phases]]
batch_size = 8
seq_len = 1024
weights = { web = 1, code = 1, math = 2 }
"""


def opener(calls: list):
    def open_source(name: str, spec: dict) -> FakeSource:
        calls.append((name, dict(spec)))
        return FakeSource({"web": 100, "code": 10, "math": 5}[name])

    return open_source


def test_issue13_item10_mixture_from_toml_reads_sources_caps_and_phases(tmp_path: Path) -> None:
    path = tmp_path / "mixture.toml"
    path.write_text(TOML)
    calls: list = []
    m = Mixture.from_toml(path, opener(calls))
    assert m.names == ("web", "code", "math") and m.seed == 7 and m.batch_size == 4
    assert m.caps == (None, 15, 3)
    assert calls[0] == ("web", {"path": str(tmp_path / "data/web"), "field": "tokens"})
    assert calls[1] == ("code", {"path": "/abs/code"})
    assert m.end_step is None and m.batch_size_at(10) == 8 and m.seq_len_at(10) == 1024
    direct = Mixture(
        {"web": FakeSource(100), "code": FakeSource(10), "math": FakeSource(5)},
        [
            Phase({"web": 0.7, "code": 0.3}, end_step=10),
            Phase({"web": 1, "code": 1, "math": 2}, batch_size=8, seq_len=1024),
        ],
        batch_size=4,
        caps={"code": 1.5, "math": Cap(samples=3)},
        seed=7,
    )
    assert m.fingerprint() == direct.fingerprint()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c | {"sedd": 1}, "unknown keys"),
        (lambda c: c | {"phases": []}, r"phases \(\[\], expected at least one"),
        (
            lambda c: c | {"phases": [{"weights": {"web": 1}, "end": 3}]},
            r"phases\[0\]: unknown keys \(end",
        ),
        (lambda c: c | {"phases": [{"weights": {"nope": 1}}]}, "unknown source"),
        (lambda c: c | {"phases": [{"weights": {"web": -1}}]}, "negative"),
        (lambda c: c | {"sources": {"web": {"field": "x"}}}, r"sources\.web\.path: missing"),
        (lambda c: c | {"sources": {"web": "data/web"}}, "not a table"),
        (lambda c: c | {"on_exhausted": "loop"}, "unknown policy"),
    ],
)
def test_bad_mixture_config_names_what_is_wrong(edit, message: str) -> None:
    import tomllib

    config = edit(tomllib.loads(TOML))
    with pytest.raises(ConfigError, match=message):
        Mixture.from_config(config, opener([]), where="mix.toml")


def test_invalid_toml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("seed = = 3")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML"):
        Mixture.from_toml(path, opener([]))


def test_toml_phase_seq_len_re_cuts_token_windows_and_the_plan_counts_their_tokens(
    tmp_path: Path,
) -> None:
    import roxxel
    from roxxel.sources.windows import TokenWindows

    with roxxel.DatasetWriter(tmp_path / "web", roxxel.Schema.parse({"tokens": "int32[]"})) as w:
        for i in range(40):
            w.write({"tokens": np.arange(25, dtype=np.int32) + i})
    (tmp_path / "mix.toml").write_text(
        'batch_size = 4\n[sources.web]\npath = "web"\nepochs = 1\n'
        "[[phases]]\nend_step = 5\nweights = { web = 1 }\n"
        "[[phases]]\nseq_len = 16\nweights = { web = 1 }\n"
    )

    def open_windows(name: str, spec: dict) -> TokenWindows:
        return TokenWindows(roxxel.open_dataset(spec["path"]), "tokens", 8, targets=False)

    m = Mixture.from_toml(tmp_path / "mix.toml", open_windows)
    assert [m.spaces(p)[0].size for p in (0, 1)] == [125, 62]  # 1000 tokens
    lines = plan_report(m).splitlines()
    # 20 windows of 8, then (1000 - 160) // 16 = 52 windows of 16: one epoch of tokens
    assert lines[lines.index("phase 0: steps [0, 5), batch 4") + 2].split()[2:4] == ["20", "160"]
    phase1 = lines.index("phase 1: steps [5, 18), batch 4, seq_len 16")
    assert lines[phase1 + 2].split()[2:5] == ["52", "832", f"{52 / 62:.3f}"]
    assert lines[-1] == "total tokens: web 992"


# ---- roxxel plan: clear errors (issue 12) -------------------------------------------------

PLAN_TOML = """
batch_size = 4
[sources.web]
path = "web"
field = "tokens"
seq_len = 8
[sources.ids]
path = "web"
[[phases]]
weights = { web = 1, ids = 1 }
end_step = 10
[[phases]]
weights = { web = 1 }
"""


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    import roxxel

    folder = tmp_path_factory.mktemp("plan")
    schema = roxxel.Schema.parse({"tokens": "int32[]", "label": "int64"})
    with roxxel.DatasetWriter(folder / "web", schema) as writer:
        for i in range(40):
            writer.write({"tokens": np.arange(25, dtype=np.int32) + i, "label": i})
    return folder


def _plan(folder: Path, text: str, *args: str) -> int:
    from roxxel.cli import main

    (folder / "mix.toml").write_text(text)
    return main(["plan", str(folder / "mix.toml"), *args])


@pytest.mark.parametrize(
    ("edit", "args", "message"),
    [
        (("end_step = 10", f"end_step = {2**63 - 1}"), (), r"2\*\*62"),
        (("", ""), ("--steps", str(10**30)), r"num_steps: too large .*2\*\*62"),
        (("batch_size = 4", f"batch_size = {2**62 + 1}"), ("--steps", "10"), r"2\*\*62"),
        (("batch_size = 4", f"batch_size = {2**62}"), ("--steps", "10"), r"2\*\*62"),
        (('path = "web"\nfield', 'path = "web"\nepochs = 1e300\nfield'), (), r"2\*\*62"),
        (('field = "tokens"', 'field = "tokns"'), (), r"sources\.web\.field: .*label, tokens"),
        (("seq_len = 8", 'seq_len = 8\ntargets = "no"'), (), r"sources\.web\.targets: .*bool"),
        (("seq_len = 8", "seq_len = 8.5"), (), r"sources\.web\.seq_len: "),
        (("seq_len = 8", "seq_len = 8\nstride = true"), (), r"sources\.web\.stride: "),
        (("batch_size = 4", "batch_sise = 4"), (), r"unknown keys \(batch_sise, expected .*seed"),
        (("end_step = 10", "end_step = 10.0"), (), r"phases\[0\]\.end_step: wrong type"),
        (('path = "web"\nfield', 'path = "web"\nsamples = "3"\nfield'), (), "samples: wrong"),
    ],
)
def test_issue12_clear_errors_roxxel_plan_refuses_with_one_line(
    plan_dir: Path, capsys, edit, args, message: str
) -> None:
    assert _plan(plan_dir, PLAN_TOML.replace(*edit), *args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("roxxel plan: error: ")
    assert re.search(message, err), err


def test_issue12_item14_roxxel_plan_refuses_weights_of_unbounded_ratio(plan_dir: Path, capsys):
    text = PLAN_TOML.replace("web = 1, ids = 1", "web = 5e-324, ids = 1e308")
    assert _plan(plan_dir, text) == 1
    assert "weights too far apart" in capsys.readouterr().err


# ---- issue 13 item 4: a stream that ends early says so -----------------------------------


def test_issue13_item4_plan_says_when_the_stream_ends_before_the_last_phase() -> None:
    phases = [Phase({"a": 1, "b": 1}, end_step=100), Phase({"a": 1}, batch_size=8)]
    sources = {"a": FakeSource(30), "b": FakeSource(10)}
    m = Mixture(sources, phases, batch_size=4, caps={"a": 1, "b": Cap(samples=10)})
    assert m.num_positions == 40  # b runs dry at position 20 (step 4), a at 40 (step 9)
    lines = plan_report(m, num_steps=200).splitlines()
    assert lines[2:5] == [
        "source 'b' is exhausted at step 4 (its cap, 10 samples; on_exhausted=stop)",
        "source 'a' is exhausted at step 9 (its cap, 30 samples; on_exhausted=stop)",
        "the mixture ends at step 10, before phase 1 (steps from 100): every source of "
        "phase 0 is exhausted (on_exhausted=stop)",
    ]
    odd = Mixture(sources, phases, batch_size=3, caps={"a": 1, "b": Cap(samples=10)})
    assert "the mixture ends at step 14 (its last batch has 1 of 3 rows), before phase 1" in (
        plan_report(odd)
    )


def test_issue13_item4_plan_says_when_the_stream_ends_before_the_last_end_step() -> None:
    phases = [Phase({"a": 1}, end_step=5), Phase({"a": 1}, end_step=50)]
    m = Mixture({"a": FakeSource(30)}, phases, batch_size=2, caps={"a": 1})
    report = plan_report(m)
    assert "the mixture ends at step 15, before the end_step of phase 1 (50)" in report
    whole = Mixture({"a": FakeSource(30)}, phases, batch_size=2)
    assert "the mixture ends" not in plan_report(whole)
    assert "is exhausted" not in plan_report(whole)


def test_issue13_item4_roxxel_plan_prints_the_early_end(plan_dir: Path, capsys) -> None:
    text = PLAN_TOML.replace('path = "web"\nfield', 'path = "web"\nepochs = 1\nfield')
    text = text.replace('[sources.ids]\npath = "web"', '[sources.ids]\npath = "web"\nepochs = 1')
    text = text.replace("end_step = 10", "end_step = 100")  # 124 windows + 40 records: 41 steps
    assert _plan(plan_dir, text, "--steps", "200") == 0
    out = capsys.readouterr().out
    assert "source 'web' is exhausted at step 40 (its cap, 124 samples; on_exhausted=stop)" in out
    assert "the mixture ends at step 41, before phase 1 (steps from 100)" in out


def test_issue12_clear_errors_a_bad_value_in_a_toml_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mix.toml"
    path.write_text(TOML.replace("end_step = 10", f"end_step = {2**63 - 1}"))
    with pytest.raises(ConfigError, match=r"mix\.toml: Mixture: phases\[0\]\.end_step") as info:
        Mixture.from_toml(path, opener([]))
    assert info.value.path == str(path)
