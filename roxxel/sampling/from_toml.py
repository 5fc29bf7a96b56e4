"""A `Mixture` from a TOML file (`tomllib`); the schema is in ``docs/sampling.md``.

The file names each source by a path and options; the caller's ``open_source`` opens it, so
neither this module nor `roxxel.sampling.mixture` knows anything about files of records. Unknown
keys are errors: a typo never silently changes a training run.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sized
from pathlib import Path
from typing import Any

from roxxel.errors import ConfigError
from roxxel.sampling.mixture import Cap, Mixture, Phase

__all__ = ["OpenSource", "load_mixture", "mixture_from_config"]

OpenSource = Callable[[str, Mapping[str, Any]], Sized]
"""``open_source(name, spec) -> source``: ``spec`` is the source's table without its cap
keys, with ``path`` resolved against the TOML file's folder."""

_TOP_KEYS = frozenset({"seed", "shuffle", "batch_size", "on_exhausted", "sources", "phases"})
_PHASE_KEYS = frozenset({"weights", "end_step", "batch_size", "seq_len"})
_CAP_KEYS = ("epochs", "samples")


def load_mixture(path: str | Path, open_source: OpenSource) -> Mixture:
    """Read a mixture TOML file and build the `Mixture` it describes.

    Raises:
        ConfigError: invalid TOML, a missing or unknown key, or any invalid value (the
            message names the file and the table at fault).
        OSError: the file cannot be read.
    """
    path = Path(path)
    with path.open("rb") as file:
        try:
            config = tomllib.load(file)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: invalid TOML ({error}, expected TOML 1.0)") from error
    return mixture_from_config(config, open_source, base_dir=path.parent, where=str(path))


def _table(where: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: not a table ({value!r}, expected a TOML table)")
    return value


def _no_unknown(where: str, table: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown keys ({', '.join(unknown)}, expected some of {', '.join(sorted(allowed))})"
        )


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
        if base_dir is not None and not Path(path).is_absolute():
            spec["path"] = str(base_dir / path)
        cap = {key: spec.pop(key) for key in _CAP_KEYS if key in spec}
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
        _no_unknown(f"{where}: phases[{i}]", table, _PHASE_KEYS)
        weights = _table(f"{where}: phases[{i}].weights", table.get("weights"))
        phases.append(
            Phase(weights, table.get("end_step"), table.get("batch_size"), table.get("seq_len"))
        )
    return phases


def mixture_from_config(
    config: Mapping[str, Any],
    open_source: OpenSource,
    *,
    base_dir: Path | None = None,
    where: str = "mixture",
) -> Mixture:
    """Build a `Mixture` from a parsed TOML document (a dict); see `load_mixture`.

    ``base_dir`` resolves relative source paths; ``where`` prefixes error messages.
    """
    _no_unknown(where, config, _TOP_KEYS)
    sources, caps = _open_sources(where, config.get("sources"), open_source, base_dir)
    try:
        return Mixture(
            sources,
            _phases(where, config.get("phases")),
            batch_size=config.get("batch_size"),
            caps=caps,
            seed=config.get("seed", 0),
            shuffle=config.get("shuffle", True),
            on_exhausted=config.get("on_exhausted", "stop"),
        )
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
