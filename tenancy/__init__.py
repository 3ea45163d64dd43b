"""Tenants, API keys and (issue 6) quotas in a SQL database.

Public surface: ``TenancyStore`` and its records (``TenantInfo``, ``KeyInfo``,
``Principal``, ``Quotas``), the errors, and ``tenancy.migrate.upgrade``. This
package never imports ``engine`` or ``app``.
"""

from .errors import (
    NotFoundError,
    PriorityNotAllowedError,
    QuotaExceededError,
    SchemaNotReadyError,
    StoreUnavailableError,
    TenancyError,
    TenantExistsError,
)
from .records import PRIORITY_CLASSES, KeyInfo, Principal, Quotas, TenantInfo
from .store import TenancyStore

__all__ = [
    "PRIORITY_CLASSES",
    "KeyInfo",
    "NotFoundError",
    "Principal",
    "PriorityNotAllowedError",
    "QuotaExceededError",
    "Quotas",
    "SchemaNotReadyError",
    "StoreUnavailableError",
    "TenancyError",
    "TenancyStore",
    "TenantExistsError",
    "TenantInfo",
]
