"""Placement's own refusals. ``app`` maps them to its domain errors and HTTP statuses
(``app.core.errors.from_core``): placement knows no HTTP.

- :class:`Refused`: the job cannot run where it asked (422): unknown machine, a filter that
  excludes the explicit target, or no machine left for Auto (R10, R11).
- :class:`Unavailable`: the explicit target is offline, drained or receiving a sync (R10):
  temporary, never rerouted (503); for Auto, every machine that could run the job is so.
- :class:`Full`: the target (or every machine Auto could use) is at ``max_queued`` (R23, 429).
"""

from __future__ import annotations


class Refused(Exception):
    """Raised when placement refuses a job; ``reason`` is one of the reason codes of
    :mod:`routing.placement` and ``message`` names the machine, the model and the fix."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class Unavailable(Refused):
    """Raised when an explicitly targeted machine cannot take jobs now (offline, drained,
    syncing): the client may retry later; the job is never sent elsewhere (R10). Auto raises it
    when every machine that could run the job is out only so (R11)."""


class Full(Refused):
    """Raised when the target's backlog is at its ``max_queued`` (R23), or every machine Auto
    could use is full."""
