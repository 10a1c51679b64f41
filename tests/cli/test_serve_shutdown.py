"""``homefleet serve`` stops soon after SIGTERM even while calls wait for their jobs: an image
call waiting for its job is answered at once 503 ``server_stopping`` with ``Retry-After``,
resendable (it stayed up minutes before ``api_shutdown_grace_s``, and then cut the call: a 500
after which the SDKs' two quick retries found no server); a request still running when the
grace runs out is cut with one warning line, not a traceback. The job waits on in
its line, untouched, and the official OpenAI SDK with its default retries resends the call to the
restarted server, which answers with the first call's job (C10): no second job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.secret_files import write_private
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.redis_server import free_port
from tests.helpers import bring_online, make_fleet, settings_env, wait_for

MODEL = "tiny-sd"


@pytest.fixture
def stopping(
    settings: Settings, tmp_path: Path, tiny_models_dir: Path
) -> Iterator[tuple[ServerContext, dict[str, str]]]:
    """A server context whose machine ``server`` holds tiny-sd verified and has no worker (a
    job waits in its line), and the environment of a ``serve`` process on a free port."""
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
        yield ctx, env
    finally:
        ctx.close()


@contextmanager
def serving(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A ``homefleet serve`` process answering on ``env``'s port; killed if still running after."""
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: _answers(url_of(env)), timeout_s=60, what="the API to answer")
        yield server
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate(timeout=30)


def url_of(env: dict[str, str]) -> str:
    return f"http://127.0.0.1:{env['HOMEFLEET_API_PORT']}"


def test_sigterm_answers_a_waiting_image_call_503_and_stops_the_server_leaving_its_job_queued(
    stopping: tuple[ServerContext, dict[str, str]],
) -> None:
    ctx, env = stopping
    url, headers = url_of(env), {"Authorization": f"Bearer {json.loads(env['HOMEFLEET_API_KEYS'])[0]}"}
    with serving(env) as server:
        answered: list[httpx.Response | httpx.HTTPError] = []

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
            except httpx.HTTPError as error:
                answered.append(error)

        caller = threading.Thread(target=call)
        caller.start()
        [job] = wait_for(lambda: ctx.journal.list([JobState.queued]), timeout_s=30, what="the call's job to queue")
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        caller.join(timeout=30)
        answered_s = time.monotonic() - started
        out, _ = server.communicate(timeout=60)  # it hung for minutes here
        stopped_s = time.monotonic() - started
    said = out.decode(errors="replace")
    [response] = answered
    assert isinstance(response, httpx.Response), (response, said[-2000:])
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_stopping", response.text
    assert f"job {job.id} runs on" in response.json()["error"]["message"]
    assert response.headers["Retry-After"] == "5" and response.headers.get("x-should-retry") != "false"
    assert answered_s < 2, answered_s  # at once, not at the grace's end
    assert stopped_s < 30, (stopped_s, said[-2000:])
    assert ctx.journal.get(job.id).state == JobState.queued  # not judged lost: it runs once a worker claims it
    assert "timeout graceful shutdown exceeded" not in said, said[-3000:]  # nothing left to cut
    assert "Exception in ASGI application" not in said and "CancelledError" not in said, said[-3000:]


def test_a_request_cut_when_the_grace_runs_out_is_one_warning_line() -> None:
    """What uvicorn logs of each request it cancels at the grace's end ("Exception in ASGI
    application" with a CancelledError traceback, which reads as a crash) becomes one line;
    any other record passes as it is."""
    import asyncio
    import logging

    from app.cli.main import CutAtShutdown

    try:
        raise asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")
    except asyncio.CancelledError:
        cut = logging.LogRecord(
            "uvicorn.error", logging.ERROR, "h11_impl.py", 1, "Exception in ASGI application\n", (), sys.exc_info()
        )
    assert CutAtShutdown().filter(cut)
    assert (cut.levelname, cut.exc_info) == ("WARNING", None)
    assert cut.getMessage().startswith("a request still running when the shutdown's grace ran out was cut")
    try:
        raise ValueError("a real fault")
    except ValueError:
        fault = logging.LogRecord(
            "uvicorn.error", logging.ERROR, "h11_impl.py", 1, "Exception in ASGI application\n", (), sys.exc_info()
        )
    assert CutAtShutdown().filter(fault) and fault.levelname == "ERROR" and fault.exc_info is not None


def test_the_openai_sdk_resends_a_call_cut_by_a_restart_and_gets_its_first_job(
    stopping: tuple[ServerContext, dict[str, str]],
) -> None:
    """Default retries (2): the 503's Retry-After (here 15 s) covers the restart; the resent call
    is the first call's (C10), answered by the next server with that job (409 job_pending once
    its wait, here 2 s, runs out: still no worker), not a second job."""
    ctx, env = stopping
    env = {**env, "HOMEFLEET_RETRY_AFTER_S": "15", "HOMEFLEET_IMAGES_WAIT_S": "2"}
    client = openai.OpenAI(base_url=f"{url_of(env)}/v1", api_key=json.loads(env["HOMEFLEET_API_KEYS"])[0], timeout=120)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.images.generate(model=MODEL, prompt="cut by a restart", extra_body={"target": "server"})
        except openai.APIError as error:
            outcome.append(error)

    with serving(env) as server:
        caller = threading.Thread(target=call)
        caller.start()
        [job] = wait_for(lambda: ctx.journal.list([JobState.queued]), timeout_s=30, what="the call's job to queue")
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
    with serving(env):  # the next server, within the Retry-After
        caller.join(timeout=90)
    client.close()
    [error] = outcome
    assert isinstance(error, openai.ConflictError), error
    assert error.body is not None and error.body["code"] == "job_pending", error.body  # type: ignore[index]
    assert error.body["job_ids"] == [job.id]  # type: ignore[index]
    assert [j.id for j in ctx.journal.list()] == [job.id]  # no second job


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, verify=tls_context()).status_code in (200, 503)
    except httpx.HTTPError:
        return False
