"""Validation of tenant fields, shared by the store and (issue 6) the admin API."""

from __future__ import annotations

import math
import re

from .records import Quotas, normalize_priorities

__all__ = ["TENANT_NAME_RE", "check_name", "check_weight", "normalize_priorities", "quota_columns"]

TENANT_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")


def check_name(name: str) -> str:
    """Raises ``ValueError`` unless ``name`` is a letter then up to 63 of ``[A-Za-z0-9._-]``."""
    if not isinstance(name, str) or not TENANT_NAME_RE.match(name):
        raise ValueError(
            f"invalid tenant name {name!r}: a letter then up to 63 letters, digits, '.', '_' or '-'"
        )
    return name


def check_weight(weight: float) -> float:
    """Raises ``ValueError`` unless ``weight`` is finite and > 0."""
    weight = float(weight)
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"tenant weight must be a finite number > 0, got {weight}")
    return weight


def quota_columns(quotas: Quotas) -> dict[str, int | None]:
    """Column values of ``quotas``; raises ``ValueError`` on a negative or non-integer limit."""
    columns = {}
    for field, value in vars(quotas).items():
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"quota {field} must be a non-negative integer or None, got {value!r}")
        columns[field] = value
    return columns
