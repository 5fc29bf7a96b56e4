"""The roxxel error hierarchy and the validation helpers every layer shares.

Every error roxxel raises on purpose is a `RoxxelError`; each child is also a `ValueError`,
so code that already catches bad values keeps working. Messages follow one form:
``"<where>: <what> (<found>, expected <rule>)"``. An error may also carry what it is about as
attributes, for code (and tests) that should not parse messages: ``rule`` (a numbered rule of
``docs/format.md`` or ``docs/sampling.md``, e.g. ``"M7"``), ``path`` (the file) and ``offset``
(a byte offset, record or line number in that file). The user and password of a URL never
show in an error (``https://user:secret@host/`` becomes ``https://***@host/``): messages end
up in logs.
"""

from __future__ import annotations

import json
import math
import operator
import re
from typing import Any

import numpy as np

__all__ = [
    "ConfigError",
    "FormatError",
    "RoxxelError",
    "StateError",
    "check_int",
    "load_json",
    "without_credentials",
]

# the user-info part of a URL in a text ("https://user:secret@host/..."), up to the last
# '@' as URL parsers read it: of the authority, or with a password (a ':' before any '/') of
# the whole word, so a raw '@' or '/' in a password shows nothing of it (a path's '@' is
# masked with it, the safe side). A scheme of at least two letters, so a Windows drive
# ("C:\\data") is not one.
_USER_INFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]+://)(?:[^/@\s:]*:\S*|[^/\s]+)@")


def without_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it masked, for printing.

    >>> without_credentials("http://me:s3cret@host/ds: unreachable")
    'http://***@host/ds: unreachable'
    """
    return _USER_INFO.sub(r"\1***@", text)


class RoxxelError(ValueError):
    """Base class of every error roxxel raises on purpose.

    Args:
        message: the whole message, in the form above.
        rule: the numbered rule broken, if there is one.
        path: the file at fault, if there is one.
        offset: where in that file (bytes, a record or a line: the message says which).
    """

    def __init__(
        self,
        message: str = "",
        *,
        rule: str | None = None,
        path: object = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(without_credentials(message))
        self.rule = rule
        self.path = None if path is None else without_credentials(str(path))
        self.offset = offset


class FormatError(RoxxelError):
    """Bytes on disk (a shard file or a manifest) break a rule of the format spec."""


class ConfigError(RoxxelError):
    """An argument, schema, record or configuration is invalid."""


class StateError(RoxxelError):
    """A saved state does not belong to this configuration or dataset."""


def check_int(
    where: str,
    value: object,
    low: int | None = None,
    high: int | None = None,
    error: type[RoxxelError] = ConfigError,
) -> int:
    """``value`` as a Python int in [low, high], or ``error`` naming ``where``.

    Python and numpy integers are accepted; bools, floats and strings are not.

    >>> check_int("batch_size", np.int64(8), low=1)
    8
    >>> check_int("batch_size", True, low=1)
    Traceback (most recent call last):
    ...
    roxxel.errors.ConfigError: batch_size: not an integer (True, expected an int)
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise error(f"{where}: not an integer ({value!r}, expected an int)")
    number = operator.index(value)
    if low is not None and number < low:
        raise error(f"{where}: too small ({number}, expected >= {low})")
    if high is not None and number > high:
        raise error(f"{where}: too large ({number}, expected <= {high})")
    return number


def load_json(data: bytes | str, where: object, error: type[RoxxelError] = FormatError) -> Any:
    """Parse untrusted JSON strictly: no NaN/Infinity, no number that overflows a float, no
    duplicate keys, valid UTF-8. Raises ``error`` naming ``where`` (usually the file).

    >>> load_json('{"a": 1, "a": 2}', "m.json")
    Traceback (most recent call last):
    ...
    roxxel.errors.FormatError: m.json: invalid JSON (duplicate key 'a', expected each key once)
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite
        )
    except _Refused as e:
        raise error(f"{where}: invalid JSON ({e}, expected {e.rule})", path=where) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{where}: invalid JSON ({e})", path=where) from None


class _Refused(Exception):
    def __init__(self, what: str, rule: str) -> None:
        super().__init__(what)
        self.rule = rule


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key!r}", "each key once")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON", "finite numbers")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} overflows a float", "finite numbers")
    return value
