"""``roxxel plan``: what a mixture TOML file will feed, phase by phase, before training.

Each ``[sources.NAME]`` table names a dataset directory by ``path``. With ``field`` and
``seq_len`` the source is token windows over that 1-D field (``stride`` and ``targets``
optional, as `roxxel.sources.windows.TokenWindows`); otherwise it is the dataset's records.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Mapping
from typing import Any

from roxxel.cli.args import add_url_flags, storage_options, url_options
from roxxel.errors import ConfigError
from roxxel.format.dataset import open_dataset
from roxxel.sampling.mixture import Mixture
from roxxel.sampling.report import plan_report, plot_shares
from roxxel.sources.windows import TokenWindows

__all__ = ["add_plan_parser", "open_plan_source"]

SOURCE_KEYS = {  # key -> (TOML type, what it says in an error); a bool is no int
    "path": (str, "a path string"),
    "field": (str, "a field name"),
    "seq_len": (int, "an integer"),
    "stride": (int, "an integer"),
    "targets": (bool, "a bool: true or false"),
}

EPILOG = """example:
  roxxel plan mixture.toml --steps 100000 --plot shares.png

mixture.toml sources: [sources.web] path = "data/web", field = "tokens", seq_len = 2048"""


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show what a mixture feeds per phase and source",
        description="Print a mixture's plan: samples, tokens, epochs and exhaustion per source.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("mixture", metavar="MIXTURE.toml")
    p.add_argument("--steps", type=int, metavar="N", help="plan steps [0, N) (needed if endless)")
    p.add_argument(
        "--plot", metavar="PATH", help="also draw the shares over the steps (matplotlib)"
    )
    add_url_flags(p)
    p.set_defaults(func=cmd_plan)


def open_plan_source(
    name: str,
    spec: Mapping[str, Any],
    *,
    cache_dir: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """A mixture source from its TOML table: token windows or the dataset's records. A
    ``path`` that is a URL is cached in ``cache_dir`` (default: `open_dataset`'s) and read
    with ``storage_options``.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, ``field`` without ``seq_len``
            (or the reverse), or a field the dataset does not have (listing those it has).
    """
    _check_source_spec(name, spec)
    dataset = open_dataset(spec["path"], **url_options(spec["path"], cache_dir, storage_options))
    if "field" not in spec and "seq_len" not in spec:
        return dataset
    if "field" not in spec or "seq_len" not in spec:
        raise ConfigError(f"sources.{name}: field and seq_len go together (found one of them)")
    names = [f.name for f in dataset.schema.fields]
    if spec["field"] not in names:
        found = f"{spec['field']!r} not in {spec['path']}"
        raise ConfigError(
            f"sources.{name}.field: unknown field ({found}, expected one of {', '.join(sorted(names))})"
        )
    return TokenWindows(
        dataset,
        spec["field"],
        spec["seq_len"],
        targets=spec.get("targets", True),
        stride=spec.get("stride"),
    )


def _check_source_spec(name: str, spec: Mapping[str, Any]) -> None:
    unknown = sorted(set(spec) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(
            f"sources.{name}: unknown keys {unknown} (expected some of {sorted(SOURCE_KEYS)})"
        )
    for key, value in spec.items():
        kind, rule = SOURCE_KEYS[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"sources.{name}.{key}: wrong type ({value!r}, expected {rule})")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.plot:
        _check_plot_extra()  # before the work, not after the report
    options = storage_options(args.storage_options)
    opener = functools.partial(open_plan_source, cache_dir=args.cache_dir, storage_options=options)
    mixture = Mixture.from_toml(args.mixture, opener)
    print(plan_report(mixture, args.steps))
    if args.plot:
        print(f"shares drawn to {plot_shares(mixture, args.plot, args.steps)}")
    return 0


def _check_plot_extra() -> None:
    try:  # the optional ``plot`` extra; `plot_shares` loads it again (cached) to draw
        importlib.import_module("matplotlib")
    except ImportError:
        raise ConfigError(
            "--plot: matplotlib is not installed (missing, expected the plot extra: "
            "pip install 'roxxel[plot]')"
        ) from None
