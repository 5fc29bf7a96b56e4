"""A mixture's TOML file (`tomllib`) as `Mixture` arguments; the schema is in ``docs/sampling.md``.

`Mixture.from_toml` (`roxxel.sampling.mixture`) builds the mixture from what this module
reads: it is the lower of the two, so the class can offer the constructor. The file names
each source by a path and options; the caller's ``open_source`` opens it, so neither module
knows anything about files of records. Unknown keys and values of the wrong TOML type are
errors naming the file and the table: a typo never silently changes a training run.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError
from roxxel.sampling.phases import Cap, Phase

__all__ = ["MixtureArgs", "OpenSource", "looks_like_url", "mixture_args", "read_toml"]

OpenSource = Callable[[str, Mapping[str, Any]], Sized]
"""``open_source(name, spec) -> source``: ``spec`` is the source's table without its cap
keys, with ``path`` resolved against the TOML file's folder."""

_INT, _NUMBER = (int, "an integer"), ((int, float), "a number")
# a scheme then a slash: a URL (`roxxel.format.remote.is_url`'s rule, which sampling does not
# import), "file:/abs" included, which the opener refuses rather than a relative folder
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")


def looks_like_url(path: str) -> bool:
    """Whether a source's ``path`` is a URL (kept as it is, not resolved against the TOML's
    folder)."""
    return _URL.match(path) is not None


_TOP_KEYS = {
    "seed": _INT,
    "shuffle": (bool, "true or false"),
    "batch_size": _INT,
    "on_exhausted": (str, "a string"),
    "sources": (dict, "a table"),
    "phases": (list, "an array of tables"),
}
_PHASE_KEYS = {"weights": (dict, "a table"), "end_step": _INT, "batch_size": _INT, "seq_len": _INT}
_CAP_KEYS = {"epochs": _NUMBER, "samples": _INT}


@dataclass(frozen=True, slots=True)
class MixtureArgs:
    """The arguments of `roxxel.Mixture` that a TOML document gives.

    Attributes:
        sources: name -> the opened source, in the file's order (the source ids).
        phases: the ``[[phases]]`` tables, in order.
        options: the keyword arguments (``batch_size``, ``caps``, ``seed``, ``shuffle``,
            ``on_exhausted``), with the documented defaults.
    """

    sources: dict[str, Sized]
    phases: list[Phase]
    options: dict[str, Any]


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML document at ``path``.

    Raises:
        ConfigError: invalid TOML (naming the file).
        OSError: the file cannot be read.
    """
    if "://" in str(path):  # before Path() makes "s3://b/m.toml" a local "s3:/b/m.toml"
        raise ConfigError(
            f"{path}: a URL (expected a local file: a mixture TOML is read from disk; its"
            " sources' paths may be URLs)",
            path=path,
        )
    with Path(path).open("rb") as file:
        try:
            return tomllib.load(file)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(
                f"{path}: invalid TOML ({error}, expected TOML 1.0)", path=path
            ) from None


def _table(where: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: not a table ({value!r}, expected a TOML table)")
    return value


def _check_keys(
    where: str, table: Mapping[str, Any], allowed: Mapping[str, tuple[Any, str]]
) -> None:
    """Raise `ConfigError` for a key not in ``allowed`` (listing the known keys) or a value
    whose TOML type is not the one ``allowed`` gives it (a bool is no number)."""
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        known = ", ".join(sorted(allowed))
        raise ConfigError(f"{where}: unknown keys ({', '.join(unknown)}, expected some of {known})")
    for key, value in table.items():
        kind, name = allowed[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"{where}.{key}: wrong type ({value!r}, expected {name})")


def _open_sources(where: str, tables: object, open_source: OpenSource, base_dir: Path | None):
    sources: dict[str, Sized] = {}
    caps: dict[str, Cap] = {}
    for name, value in _table(f"{where}: sources", tables).items():
        spec = dict(_table(f"{where}: sources.{name}", value))
        path = spec.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"{where}: sources.{name}.path: missing ({path!r}, expected a path string)"
            )
        if base_dir is not None and not Path(path).is_absolute() and not looks_like_url(path):
            spec["path"] = str(base_dir / path)  # a URL (s3://...) stays as it is
        cap = {key: spec.pop(key) for key in _CAP_KEYS if key in spec}
        _check_keys(f"{where}: sources.{name}", cap, _CAP_KEYS)
        if cap:
            caps[name] = Cap(**cap)
        sources[name] = open_source(name, spec)
    return sources, caps


def _phases(where: str, tables: object) -> list[Phase]:
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{where}: phases ({tables!r}, expected at least one [[phases]] table)")
    phases = []
    for i, value in enumerate(tables):
        table = _table(f"{where}: phases[{i}]", value)
        _check_keys(f"{where}: phases[{i}]", table, _PHASE_KEYS)
        weights = _table(f"{where}: phases[{i}].weights", table.get("weights"))
        phases.append(
            Phase(weights, table.get("end_step"), table.get("batch_size"), table.get("seq_len"))
        )
    return phases


def mixture_args(
    config: Mapping[str, Any],
    open_source: OpenSource,
    *,
    base_dir: Path | None = None,
    where: str = "mixture",
) -> MixtureArgs:
    """The `Mixture` arguments of a parsed TOML document (a dict), its sources opened.

    ``base_dir`` resolves relative source paths; ``where`` prefixes error messages. The
    values themselves (weights, steps, caps) are checked by `Mixture`.

    Raises:
        ConfigError: a missing or unknown key, or a value of the wrong TOML type.
    """
    _check_keys(where, config, _TOP_KEYS)
    sources, caps = _open_sources(where, config.get("sources"), open_source, base_dir)
    options = {
        "batch_size": config.get("batch_size"),
        "caps": caps,
        "seed": config.get("seed", 0),
        "shuffle": config.get("shuffle", True),
        "on_exhausted": config.get("on_exhausted", "stop"),
    }
    return MixtureArgs(sources, _phases(where, config.get("phases")), options)
