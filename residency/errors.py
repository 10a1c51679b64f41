"""Residency's own refusal, mapped to the job's failure reason by the worker and to HTTP by
``app`` (``app.core.errors.from_core``): residency knows neither."""

from __future__ import annotations


class ResidencyRefused(Exception):
    """Raised when a load could only fit by evicting a protected model (R15, R16): nothing is
    evicted; the job fails with ``reason`` (``residency_protected``)."""

    def __init__(self, message: str, *, reason: str = "residency_protected") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
