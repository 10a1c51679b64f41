"""What a webhook costs: a real ``homefleet serve`` process on its own Redis and SQLite
journal, a local HTTP receiver (``http.server`` in this process) on 127.0.0.1, and ``--jobs`` jobs
submitted over HTTP with a ``webhook_url`` and cancelled over HTTP (the server ends them: the
terminal transition writes the delivery, the server's delivery loop POSTs it). Measured:

- delivery latency: the receiver's arrival time minus the job's ``finished_at`` (the terminal
  transition), same host clock;
- the cost on the terminal transition: ``POST /v1/jobs/{id}/cancel`` with a webhook against
  the same route for jobs without one;
- the retry path: a receiver that answers 500 once, then 200, with the server's
  ``webhook_backoff_s`` set to ``--backoff`` seconds: arrival of the second attempt minus
  ``finished_at``.

No worker runs: the machine gets a heartbeat from this process and a header-only model (nothing
is ever loaded). Figures only, never asserts.

    python -m bench.webhooks [--jobs 50] [--backoff 0.2] [--forkserver]

Last line: ``delivery_p50_ms=X delivery_p99_ms=X cancel_plain_p50_ms=X cancel_hooked_p50_ms=X retry_ms=X``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from app.context import build_context
from app.core.config import Settings
from app.core.limits import key_id
from app.core.secret_files import write_private
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port, start_redis_server
from app.fleet.config import Fleet, Machine, WebhookConfig
from bench import add_forkserver_flag
from bench.latency import quantile
from bench.submit import _model_folder

MODEL = "bench-sd"
API_KEY = "bench-webhooks-key-".ljust(40, "x")
SECRET = "bench-webhooks-secret-".ljust(40, "x")


class Receiver:
    """Records the arrival (``time.time()``) of every POST by delivery id; answers ``fail_first``
    500s, then 200."""

    def __init__(self, fail_first: int = 0) -> None:
        self.arrivals: dict[str, list[float]] = {}
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.time()
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                job_id = json.loads(body)["id"]
                receiver.arrivals.setdefault(job_id, []).append(arrived)
                failing = receiver.fail_first > 0
                receiver.fail_first -= 1
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _unix(iso: str) -> float:
    moment = datetime.fromisoformat(iso)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _wait(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the webhooks did not arrive in time")
        time.sleep(0.01)


def run(jobs: int, backoff_s: float, forkserver: bool = False) -> dict[str, float]:
    fleet = Fleet(
        machines={
            "server": Machine(
                name="server",
                backend="cpu",
                memory_kind="unified",
                memory_bytes=8_000_000_000,
                families=frozenset({"sd1"}),
                token="token-server-".ljust(32, "x"),
            )
        },
        webhooks=WebhookConfig(allow_hosts=["127.0.0.1"]),
    )
    with tempfile.TemporaryDirectory(prefix="hf-webhooks-") as tmp:
        root = Path(tmp)
        redis_process = start_redis_server(root / "redis")
        fleet_file = root / "fleet.toml"
        write_private(fleet_file, fleet.to_toml())
        settings = Settings(
            data_dir=root / "server",
            redis_url=redis_process.url,
            fleet_file=fleet_file,
            api_port=free_port(),
            api_keys=[API_KEY],
            webhook_secrets={key_id({}, API_KEY): SECRET},
            webhook_backoff_s=backoff_s,
            max_queued_per_machine=10_000,
            max_pending_total=10_000,
        )
        local = LocalFleet(settings, fleet, fleet_file, forkserver=forkserver)
        receiver = Receiver()
        try:
            ctx = build_context(settings, fleet, migrate=True)
            try:
                ctx.registry.add(_model_folder(root), MODEL)
                ctx.redis.set(
                    ctx.keys.heartbeat("server"), json.dumps({"machine": "server", "at": time.time()}), ex=3600
                )
                ctx.redis.sadd(ctx.keys.verified("server"), MODEL)
            finally:
                ctx.close()
            local.start_api()
            with httpx.Client(base_url=local.api_url, headers=local.auth_headers, timeout=60) as client:

                def submit_and_cancel(hook: str | None) -> tuple[str, float, float]:
                    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "p", "steps": 1}}
                    if hook:
                        body["webhook_url"] = hook
                    job_id = client.post("/v1/jobs", json=body).raise_for_status().json()["id"]
                    started = time.perf_counter()
                    ended = client.post(f"/v1/jobs/{job_id}/cancel").raise_for_status().json()
                    return job_id, time.perf_counter() - started, _unix(ended["finished_at"])

                for _ in range(5):  # warm-up: connections, first queries, the loop's first rounds
                    submit_and_cancel(receiver.url)
                _wait(lambda: len(receiver.arrivals) == 5)
                receiver.arrivals.clear()
                plain_s = [submit_and_cancel(None)[1] for _ in range(jobs)]
                hooked = []
                for _ in range(jobs):
                    job_id, cancel_s, finished = submit_and_cancel(receiver.url)
                    _wait(lambda job_id=job_id: job_id in receiver.arrivals)  # one at a time: latency, not throughput
                    hooked.append((job_id, cancel_s, finished))
                delivery_s = [receiver.arrivals[job_id][0] - finished for job_id, _, finished in hooked]
                receiver.fail_first = 1
                job_id, _, finished = submit_and_cancel(receiver.url)
                _wait(lambda: len(receiver.arrivals.get(job_id, [])) == 2)
                retry_s = receiver.arrivals[job_id][1] - finished
        finally:
            receiver.close()
            local.stop()
            redis_process.stop()

    def ms(values: list[float]) -> str:
        return (
            f"p50 {1000 * quantile(values, 0.5):7.2f} ms  p99 {1000 * quantile(values, 0.99):7.2f} ms  "
            f"max {1000 * max(values):7.2f} ms"
        )

    cancel_hooked_s = [cancel_s for _, cancel_s, _ in hooked]
    print(f"delivery: finished_at -> receiver          {ms(delivery_s)}  ({jobs} webhooks, one at a time)")
    print(f"POST /v1/jobs/{{id}}/cancel, no webhook     {ms(plain_s)}")
    print(f"POST /v1/jobs/{{id}}/cancel, with webhook   {ms(cancel_hooked_s)}")
    print(f"one 500 then 200, webhook_backoff_s={backoff_s:g}: finished_at -> second attempt {1000 * retry_s:.1f} ms")
    return {
        "delivery_p50_ms": 1000 * quantile(delivery_s, 0.5),
        "delivery_p99_ms": 1000 * quantile(delivery_s, 0.99),
        "cancel_plain_p50_ms": 1000 * quantile(plain_s, 0.5),
        "cancel_hooked_p50_ms": 1000 * quantile(cancel_hooked_s, 0.5),
        "retry_ms": 1000 * retry_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="webhooks measured (default 50)")
    parser.add_argument("--backoff", type=float, default=0.2, help="webhook_backoff_s for the retry (default 0.2)")
    add_forkserver_flag(parser)
    args = parser.parse_args(argv)
    figures = run(args.jobs, args.backoff, args.forkserver)
    print(" ".join(f"{k}={v:.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
