"""Prometheus metrics of the serving front (R24), on one registry per server context.

Instruments (units in seconds and bytes, Prometheus naming):
- ``homefleet_request_duration_seconds{method,route,status}``: HTTP request time.
- ``homefleet_queue_duration_seconds{machine}``: submission to claim, per ended job that ran.
- ``homefleet_inference_duration_seconds{machine}``: the worker's run time (``run_s``).
- ``homefleet_cold_loads_total{machine}``: jobs that loaded their pipeline cold.
- ``homefleet_rejections_total{reason}``: refused submissions by reason (R22, R23, R10…).
- ``homefleet_webhook_attempts_total{outcome}``: webhook attempts, ``delivered``,
  ``retry`` (failed, another is due) or ``failed`` (failed, given up).
- ``homefleet_webhook_delivery_seconds``: a job's end to its webhook delivered.
- ``homefleet_fleet_lock_hold_seconds``: each hold of the fleet lock (R14), acquired to
  released, observed on every release (app/fleet/lock.py): a submission, a sync's
  reservation, residency commitments, a reconciliation pass.
- Read at scrape time: ``homefleet_queue_size{machine}`` (reserved jobs not yet running),
  ``homefleet_running_jobs{machine}``, ``homefleet_machine_online{machine}``,
  ``homefleet_verified_bytes{machine}`` (bytes of the models each machine verified, R4).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from app.db.tables import Job
    from app.fleet.machines import MachineStates
    from app.store.registry import Registry

# Seconds: from a millisecond HTTP answer to a multi-minute video job.
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# Seconds: a fleet lock hold is milliseconds; its TTL (``fleet_lock_ttl_s``, 5 s by default) is the far end.
LOCK_HOLD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class FleetCollector(Collector):
    """Gauges read from Redis (reservations, heartbeats, verified sets) when scraped."""

    def __init__(self, machines: MachineStates, registry: Registry) -> None:
        self.machines = machines
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily(
            "homefleet_queue_size", "Jobs waiting in a machine's line (reserved, not running)", labels=["machine"]
        )
        running = GaugeMetricFamily("homefleet_running_jobs", "Jobs running on a machine", labels=["machine"])
        online = GaugeMetricFamily(
            "homefleet_machine_online", "1 when the machine has a live heartbeat", labels=["machine"]
        )
        verified = GaugeMetricFamily(
            "homefleet_verified_bytes", "Bytes of the models a machine verified (R4)", labels=["machine"]
        )
        sizes = {m.id: m.total_bytes for m in self.registry.list()}
        for name, view in self.machines.views().items():
            active = sum(1 for item in view.queue if item.elapsed_s is not None)
            queued.add_metric([name], view.backlog - active)
            running.add_metric([name], active)
            online.add_metric([name], 1.0 if view.online else 0.0)
            verified.add_metric([name], sum(sizes.get(m, 0) for m in view.verified_models))
        yield from (queued, running, online, verified)


class Metrics:
    """The instruments of one server; :meth:`render` gives the text exposition format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_s = Histogram(
            "homefleet_request_duration_seconds",
            "HTTP request duration",
            ["method", "route", "status"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.queue_s = Histogram(
            "homefleet_queue_duration_seconds",
            "Submission to start of a job",
            ["machine"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.inference_s = Histogram(
            "homefleet_inference_duration_seconds",
            "Run time of a job on its worker",
            ["machine"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.cold_loads = Counter(
            "homefleet_cold_loads", "Jobs that loaded their pipeline cold", ["machine"], registry=self.registry
        )
        self.rejections = Counter(
            "homefleet_rejections", "Refused submissions by reason", ["reason"], registry=self.registry
        )
        self.webhook_attempts = Counter(
            "homefleet_webhook_attempts", "Webhook attempts by outcome", ["outcome"], registry=self.registry
        )
        self.webhook_delivery_s = Histogram(
            "homefleet_webhook_delivery_seconds",
            "A job's end to its webhook delivered",
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.fleet_lock_hold_s = Histogram(
            "homefleet_fleet_lock_hold_seconds",
            "Each hold of the fleet lock, acquired to released",
            buckets=LOCK_HOLD_BUCKETS_S,
            registry=self.registry,
        )

    def watch_fleet(self, machines: MachineStates, registry: Registry) -> None:
        self.registry.register(FleetCollector(machines, registry))

    def refused(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def finished(self, job: Job) -> None:
        """Observe an ended job's queue time, run time and cold load (only jobs that started)."""
        machine = job.machine or ""
        if job.started_at is not None and job.created_at is not None:
            self.queue_s.labels(machine=machine).observe(max(0.0, (job.started_at - job.created_at).total_seconds()))
        if job.run_s is not None:
            self.inference_s.labels(machine=machine).observe(job.run_s)
        if job.cold_load:
            self.cold_loads.labels(machine=machine).inc()

    def webhook(self, outcome: str, delivered_after_s: float | None = None) -> None:
        """Count one webhook attempt (``delivered``, ``retry`` or ``failed``); a delivered one
        also observes the seconds since its job ended."""
        self.webhook_attempts.labels(outcome=outcome).inc()
        if delivered_after_s is not None:
            self.webhook_delivery_s.observe(max(0.0, delivered_after_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)
