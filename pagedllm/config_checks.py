"""The checks every config dataclass validates its fields with (config.py, spec_config.py): a
``ValueError`` that names the field, what it may be and what it was."""

from __future__ import annotations

from typing import Any


def require(ok: bool, field: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
