"""The roxxel error hierarchy.

Every error roxxel raises on purpose is a `RoxxelError`; each child is also a `ValueError`,
so code that already catches bad values keeps working. Messages follow one form:
``"<where>: <what> (<found>, expected <rule>)"``.
"""

from __future__ import annotations

__all__ = ["ConfigError", "FormatError", "RoxxelError", "StateError"]


class RoxxelError(ValueError):
    """Base class of every error roxxel raises on purpose."""


class FormatError(RoxxelError):
    """Bytes on disk (a shard file or a manifest) break a rule of the format spec."""


class ConfigError(RoxxelError):
    """An argument, schema, record or configuration is invalid."""


class StateError(RoxxelError):
    """A saved state does not belong to this configuration or dataset."""
