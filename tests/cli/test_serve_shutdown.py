"""``homefleet serve`` stops soon after SIGTERM even while an image call waits for its job
(``api_shutdown_grace_s``): it stayed up minutes, its port already closed, so workers could
neither claim nor report and its own reconciliation judged their jobs lost. The job waits on
in its line, untouched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from app.context import build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.redis_server import free_port
from tests.helpers import bring_online, make_fleet, settings_env, wait_for

MODEL = "tiny-sd"


def test_sigterm_ends_a_waiting_image_call_and_stops_the_server_leaving_its_job_queued(
    settings: Settings, tmp_path: Path, tiny_models_dir: Path
) -> None:
    fleet = make_fleet()
    fleet_file = write_private(tmp_path / "fleet.toml", fleet.to_toml())
    port = free_port()
    mine = settings.model_copy(update={"fleet_file": fleet_file, "api_port": port})
    ctx = build_context(mine, fleet, migrate=True)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, MODEL)
        bring_online(ctx, "server", {MODEL})  # verified there; no worker: the job waits in its line
        env = {
            **os.environ,
            **{k: v for k, v in settings_env(mine).items() if v is not None},
            "HOMEFLEET_API_KEYS": json.dumps(mine.api_keys),
            "HOMEFLEET_API_PORT": str(port),
            "HOMEFLEET_API_SHUTDOWN_GRACE_S": "2",
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            url = f"http://127.0.0.1:{port}"
            headers = {"Authorization": f"Bearer {mine.api_keys[0]}"}
            wait_for(lambda: _answers(url), timeout_s=60, what="the API to answer")
            answered: list[object] = []

            def call() -> None:
                try:
                    answered.append(
                        httpx.post(
                            f"{url}/v1/images/generations",
                            json={"model": MODEL, "prompt": "waits for a worker", "target": "server"},
                            headers=headers,
                            timeout=120,
                            verify=tls_context(),
                        )
                    )
                except httpx.HTTPError as error:  # the connection closed by the stopping server
                    answered.append(error)

            caller = threading.Thread(target=call)
            caller.start()
            [job] = wait_for(lambda: ctx.journal.list([JobState.queued]), timeout_s=30, what="the call's job to queue")
            server.send_signal(signal.SIGTERM)
            started = time.monotonic()
            out, _ = server.communicate(timeout=60)  # it hung for minutes here
            stopped_s = time.monotonic() - started
            caller.join(timeout=30)
            assert server.returncode is not None and answered, out
            assert stopped_s < 30, (stopped_s, out.decode(errors="replace")[-2000:])
            assert ctx.journal.get(job.id).state == JobState.queued  # not judged lost: it runs once a worker claims it
            said = out.decode(errors="replace")
            assert "timeout graceful shutdown exceeded" in said, said[-3000:]  # the waiting call was cut:
            assert "Exception in ASGI application" not in said and "CancelledError" not in said, said[-3000:]
            assert "a request still running when the shutdown's grace ran out was cut" in said, said[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
    finally:
        ctx.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, verify=tls_context()).status_code in (200, 503)
    except httpx.HTTPError:
        return False
