"""The celery remote-control commands a machine's worker refuses (docs/operations.md, "The celery
CLI and Flower").

``celery -A app.celery control …`` and Flower's worker page broadcast Celery's control commands
to the workers. Some would break the worker's two rules: ``add_consumer`` (another machine's queue:
its jobs' claims are refused and they end ``interrupted``, lost) and ``cancel_consumer`` (its own
queue: the machine shows online while its jobs stay queued for ever) break R8, one FIFO line per
machine read by that machine's worker only; ``pool_grow``, ``pool_shrink`` and ``autoscale``
(two jobs at once on one device, or none) break R7, one job at a time per device. The worker
answers each with an error naming the rule and what to run instead, changes nothing, and logs it.
Inspecting, revoking and terminating, rate and time limits, events and shutdown are left as
Celery has them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.worker.control import Panel, nok

log = logging.getLogger("homefleet.worker")

#: the refused control commands: why, and what to run instead ({machine} and {queue} filled in)
REFUSED: dict[str, str] = {
    "add_consumer": (
        "machine {machine}'s worker reads its own queue {queue} only (R8): a job taken from another machine's queue "
        "is refused at its claim and lost; put jobs on a machine with their target"
    ),
    "cancel_consumer": (
        "machine {machine}'s worker reads its queue {queue} for as long as it runs (R8): without it the machine "
        "shows online while its jobs stay queued; `homefleet drain {machine}` stops placing jobs there, and stopping "
        "the worker (SIGTERM) takes it offline"
    ),
    "pool_grow": "machine {machine} runs one job at a time (R7): its pool stays one process",
    "pool_shrink": "machine {machine} runs one job at a time (R7): its pool stays one process",
    "autoscale": "machine {machine} runs one job at a time (R7): its pool stays one process",
}


def _refusal(command: str, machine: str, queue: str) -> Callable[..., dict[str, Any]]:
    reason = REFUSED[command].format(machine=machine, queue=queue)

    def refuse(state: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        log.warning("refused the control command %s%s: %s", command, f" {args or ''}{kwargs or ''}".rstrip(), reason)
        return nok(f"refused ({command}): {reason}")

    return refuse


def refuse_rule_breaking_commands(machine: str, queue: str) -> None:
    """Replace the handlers of the :data:`REFUSED` control commands in this process (Celery's
    global ``Panel.data``, which the worker's mailbox reads) by refusals naming ``machine`` and
    its ``queue``. Call it in the worker's process before Celery starts consuming."""
    for command in REFUSED:
        Panel.data[command] = _refusal(command, machine, queue)
