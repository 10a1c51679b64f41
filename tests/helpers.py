"""Shared test helpers, one copy each: fleets, settings for CLI subprocesses, waiting, a live
worker's advertisement, small images. Fixtures live in ``tests/conftest.py``."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, TypeVar

import psutil

from app.core.config import Settings, WorkerSettings
from app.core.secret_files import write_private
from app.devtools import forkserver
from app.devtools.redis_server import free_port
from app.fleet.config import Fleet, Machine

if TYPE_CHECKING:
    import redis
    from fastapi.testclient import TestClient

    from app.context import ServerContext

TEST_API_KEY = "test-api-key-0123456789"
TEST_WEBHOOK_SECRET = "test-webhook-secret-0123456789"  # webhook_secrets[Settings.api_key_id(TEST_API_KEY)]
#: the image size of a job that must keep its machine busy for seconds (a "long" job, a blocker):
#: the tiny SD model's step costs ~0.04 CPU-s at its default 64x64 and ~0.145 at 112x112 (one torch
#: thread; app/devtools/tiny_models.py ``_unet``), what a 64x64 step cost before its attention moved
LONG_SIZE = {"width": 112, "height": 112}
FAMILIES = frozenset({"sd1", "sd1-pix2pix", "sd-upscale", "animatediff"})

T = TypeVar("T")


def refused_status(path: str) -> int:
    """The status of a refused request on ``path``: OpenAI's 400 on the OpenAI-compatible routes
    (app/api/openai_errors.py ``OPENAI_INVALID_STATUS``: OpenAI's images and text routes, the
    Hugging Face image routes), 422 on Homefleet's own and TGI's (R22)."""
    from app.api.openai_errors import OPENAI_INVALID_STATUS, is_openai_route

    return OPENAI_INVALID_STATUS if is_openai_route(path) else 422


def make_fleet(*names: str, families: frozenset[str] = FAMILIES) -> Fleet:
    """A fleet of CPU machines with distinct 32-character tokens; ``server`` is always in it."""
    machines = {}
    for name in ("server", *names):
        machines[name] = Machine(
            name=name,
            backend="cpu",
            memory_kind="unified",
            memory_bytes=4_000_000_000,
            families=families,
            token=f"token-{name}-".ljust(32, "x"),
        )
    return Fleet(machines=machines)


def run_cli(
    *args: str, env: dict[str, str | None] | None = None, timeout_s: float = 180, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``homefleet ARGS`` as a user would, in this process's environment updated by ``env`` (a
    value of None unsets that variable); with ``check``, raise with its output if it fails.

    It is forked from the preloaded fork server (app/devtools/forkserver.py: the same entry
    point, ``python -m app.cli``, without ~1-3 CPU-seconds of imports per call); what is about
    the start-up itself (import-time messages) runs ``python -m app.cli`` in a subprocess
    (tests/cli/test_import_noise.py)."""
    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    done = forkserver.run(list(args), full_env, timeout_s)
    if check and done.returncode != 0:
        raise AssertionError(f"homefleet {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@dataclass
class FleetFiles:
    """A fleet on this host for an e2e test: its fleet file (mode 0600), the server's settings
    and the operator's environment (``HOMEFLEET_*`` of a CLI run, :func:`settings_env`)."""

    config: Fleet
    fleet_file: Path
    settings: Settings
    operator: dict[str, str]


def fleet_files(
    data_dir: Path, redis_url: str, *machines: str, config: Fleet | None = None, **settings: object
) -> FleetFiles:
    """:func:`make_fleet` of ``machines`` (or ``config``, a fleet of the test's own) written to
    ``data_dir/fleet.toml``, the Redis database of ``redis_url`` flushed, and the server's
    settings: a free API port, one API key (:data:`TEST_API_KEY`), heartbeats every 0.5 s with an
    8 s TTL; ``settings`` add to them or replace them."""
    import redis

    assert config is None or not machines, "a fleet's machines, or its config: not both"
    redis.Redis.from_url(redis_url).flushdb()
    config = config if config is not None else make_fleet(*machines)
    fleet_file = data_dir / "fleet.toml"
    write_private(fleet_file, config.to_toml())
    fields: dict[str, object] = {
        "data_dir": data_dir,
        "redis_url": redis_url,
        "fleet_file": fleet_file,
        "api_port": free_port(),
        "heartbeat_interval_s": 0.5,
        "heartbeat_ttl_s": 8,
        "api_keys": [TEST_API_KEY],
    }
    server = Settings(**{**fields, **settings})  # type: ignore[arg-type]
    return FleetFiles(config, fleet_file, server, settings_env(server))


def settings_env(settings: Settings) -> dict[str, str]:
    """``HOMEFLEET_*`` variables that give a CLI subprocess the same server settings."""
    env = {"HOMEFLEET_DATA_DIR": str(settings.data_dir), "HOMEFLEET_REDIS_URL": settings.redis_url}
    if settings.database_url:
        env["HOMEFLEET_DATABASE_URL"] = settings.database_url
    if settings.fleet_file:
        env["HOMEFLEET_FLEET_FILE"] = str(settings.fleet_file)
    if settings.broker_key_prefix:
        env["HOMEFLEET_BROKER_KEY_PREFIX"] = settings.broker_key_prefix
    return env


def worker_settings(redis_url: str, tmp_path: Path) -> WorkerSettings:
    """Machine m1's worker settings on ``redis_url``, with a quick heartbeat (every 0.2 s, a
    1 s TTL) for tests of the heartbeat and the lease."""
    return WorkerSettings(
        machine="m1",
        models_dir=tmp_path / "models",
        worker_token="t" * 32,
        redis_url=redis_url,
        heartbeat_interval_s=0.2,
        heartbeat_ttl_s=1.0,
    )


def wait_for(predicate: Callable[[], T], timeout_s: float = 60.0, what: str = "condition", poll_s: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true; return it. Raises ``AssertionError``
    naming ``what`` after ``timeout_s`` seconds (a deadline, never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
    return value


def pool_process(worker_pid: int, timeout_s: float = 60.0) -> psutil.Process:
    """The one prefork pool process (concurrency 1, R7) of the ``celery worker`` process
    ``worker_pid``, once it is there: its living child that runs the worker's own executable. On
    a starved host another, short-lived child of the worker was seen beside it, already a zombie
    when its environ was read: such a child is never taken for the pool. Raises
    ``AssertionError`` after ``timeout_s`` seconds."""
    worker = psutil.Process(worker_pid)

    def the_pool() -> psutil.Process | None:
        found = []
        for child in worker.children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and child.exe() == worker.exe():
                    found.append(child)
            except psutil.Error:  # it exited while we looked
                continue
        return found[0] if len(found) == 1 else None

    return wait_for(the_pool, timeout_s=timeout_s, what=f"worker {worker_pid}'s pool process")


def _pool_pid(ctx: ServerContext, job_id: str) -> int | None:
    """The pid of the pool process that runs ``job_id`` now, by its own record for the watchdog
    (``Keys.running``, R19), or None when no pool process says it runs it."""
    machine = ctx.journal.get(job_id).machine
    raw = ctx.redis.get(ctx.keys.running(machine)) if machine else None
    record = json.loads(raw) if raw else {}
    return int(record["pid"]) if record.get("job_id") == job_id else None


#: the pool processes :func:`pause` stopped and nothing continued yet; ``tests/conftest.py``
#: continues any left after each test (:func:`resume_all`), so a failed test never leaves a
#: machine of a shared fleet stopped for the tests after it.
PAUSED: set[int] = set()


def pause(ctx: ServerContext, job_id: str, steps: int = 1, timeout_s: float = 120.0) -> int:
    """Pause a running blocker once it has reported ``steps`` denoising steps: its pool process
    is stopped (SIGSTOP). The job stays ``running`` and keeps its machine busy as a working one
    does (the worker's parent process, not stopped, beats and answers control commands, R7; the
    watchdog's bound, ``hung_after_s``, is far longer than any test holds it) at no CPU, where its
    steps would take a core from the other tests for as long as the test needs the machine busy.
    :func:`end_running` continues it before ending it; :func:`resume` lets it run on. Only for a
    fleet on this host (every test fleet is). Returns the pool process's pid. Raises
    ``AssertionError`` when the job reports no ``steps`` within ``timeout_s`` seconds or no pool
    process runs it."""

    def stepped() -> bool:
        progress = ctx.progress.read(job_id)
        return progress is not None and progress.step is not None and progress.step >= steps

    wait_for(stepped, timeout_s=timeout_s, what=f"job {job_id} to report {steps} steps")
    pid = _pool_pid(ctx, job_id)
    assert pid is not None, f"no pool process says it runs job {job_id}"
    os.kill(pid, signal.SIGSTOP)
    PAUSED.add(pid)
    return pid


def resume(pid: int) -> None:
    """Continue a pool process :func:`pause` stopped (SIGCONT); nothing if it is gone."""
    PAUSED.discard(pid)
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def resume_all() -> None:
    """Continue every pool process :func:`pause` stopped and nothing continued."""
    for pid in list(PAUSED):
        resume(pid)


def freeze_worker(worker_pid: int, redis_client: redis.Redis, timeout_s: float = 60.0) -> None:
    """Stop an idle worker (SIGSTOP to its process group) so that a job queued on its machine
    stays in its list for as long as the test needs: the frozen worker must hold no ``BRPOP``.
    kombu's Redis transport keeps one in flight while a worker is idle (``brpop_timeout``, 1 s);
    Redis serves a message pushed meanwhile to the stopped process's socket, where it sits in no
    list and no unacked hash, and reconciliation rightly judges it gone (``purged``, R19). So this
    waits, after the stop, until no client of ``redis_client``'s database is blocked in ``BRPOP``
    (the one in flight timed out; a stopped process sends no other), twice in a row: a BRPOP sent
    just before the stop may reach Redis in the same event-loop turn as the first look and be
    served after it, never after the second. Only for a database that this worker alone consumes
    from (the other fleets of a test session's Redis use other databases). Raises
    ``AssertionError`` after ``timeout_s`` seconds."""
    os.killpg(worker_pid, signal.SIGSTOP)
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    looks: list[bool] = []

    def none_blocked() -> bool:
        looks.append(
            not any(
                client["db"] == db and "b" in client["flags"] and client["cmd"] == "brpop"
                for client in redis_client.client_list()
            )
        )
        return looks[-2:] == [True, True]

    wait_for(none_blocked, timeout_s=timeout_s, what="the frozen worker's BRPOP to time out", poll_s=0.1)


@contextmanager
def stopped_workers(*worker_pids: int, timeout_s: float = 60.0) -> Iterator[None]:
    """Keep the workers ``worker_pids`` (each its process group: its parent, which beats, and its
    pool process) stopped (SIGSTOP) for the block, and continue them after it. Waits until every
    process of each group is seen stopped, so that none runs a step of the block's span: a worker's
    beat stats the files of the models it advertises (``tasks/verify.py``), and a change made in
    two steps (the bytes written, then the mtime put back, C07) must not be seen half made."""
    groups = [psutil.Process(pid) for pid in worker_pids]
    try:
        for leader in groups:
            os.killpg(leader.pid, signal.SIGSTOP)

        def all_stopped() -> bool:
            members = [process for leader in groups for process in (leader, *leader.children(recursive=True))]
            return all(process.status() == psutil.STATUS_STOPPED for process in members)

        wait_for(all_stopped, timeout_s=timeout_s, what=f"workers {worker_pids} to stop", poll_s=0.01)
        yield
    finally:
        for leader in groups:
            with suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGCONT)


def flip_keeping_stat(path: Path, offset: int, *worker_pids: int) -> None:
    """XOR the byte at ``offset`` of ``path`` in place (``-1``: the last): same inode, same size,
    the mtime put back (C07), while the workers ``worker_pids`` are stopped
    (:func:`stopped_workers`): their beats must not stat the file between the write and the
    mtime's return, which they would rightly take for a change."""
    with stopped_workers(*worker_pids):
        stat = path.stat()
        with open(path, "r+b") as handle:
            handle.seek(offset if offset >= 0 else stat.st_size + offset)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def end_running(ctx: ServerContext, job_id: str, timeout_s: float = 60.0, resend_s: float = 10.0) -> None:
    """End a running job that only kept its machine busy (a blocker), as an operator would with
    ``celery control terminate SIGTERM ID`` (C11): its pool process is replaced and the journal
    says ``interrupted`` (reason ``terminated``). Cheaper than waiting out its steps, which would
    hold a core the other tests need.

    A revoke is a broadcast (Redis pub/sub): a worker whose subscription is being renewed at
    that instant never hears it. So, as an operator would, the revoke is sent again every
    ``resend_s`` seconds until the journal moves; the assertion after ``timeout_s`` seconds
    gives the workers' replies and the lines of their logs that name the job."""
    from app.core.states import JobState

    deadline = time.monotonic() + timeout_s
    pid = _pool_pid(ctx, job_id)
    if pid is not None:  # stopped by ``pause``, it would not act on the signal until continued
        resume(pid)
    replies: list[object] = []  # the first is None: that send does not wait for replies
    while True:
        # A resend waits a second for the replies (who heard it, what each found); the first does not.
        replies.append(
            ctx.celery.control.revoke(job_id, terminate=True, signal="SIGTERM", reply=bool(replies), timeout=1.0)
        )
        try:
            wait_for(
                lambda: ctx.journal.state_of(job_id) != JobState.running,
                timeout_s=max(0.0, min(resend_s, deadline - time.monotonic())),
                what="",
            )
            return
        except AssertionError:
            if time.monotonic() < deadline:
                continue
        logs = sorted((ctx.settings.data_dir / "logs").glob("worker-*.log"))
        named = [
            f"{log.name}: {line}"
            for log in logs
            for line in log.read_text(errors="replace").splitlines()
            if job_id in line
        ]
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for the terminated blocker {job_id} to end "
            f"in the journal; the workers' replies to each revoke: {replies}; "
            "their log lines naming it:\n" + "\n".join(named[-20:])
        )


def bring_online(
    ctx: ServerContext,
    machine: str,
    verified: set[str] | frozenset[str] = frozenset(),
    warm: tuple[str, ...] = (),
    ttl_s: int = 600,
) -> None:
    """Write what a live worker of ``machine`` advertises, without running one: its heartbeat
    (with its ``warm`` models, least recently used first) and, replacing any, its verified set (R4)."""
    beat = {"machine": machine, "at": time.time(), "warm_models": list(warm)}
    ctx.redis.set(ctx.keys.heartbeat(machine), json.dumps(beat), ex=ttl_s)
    ctx.redis.delete(ctx.keys.verified(machine))
    if verified:
        ctx.redis.sadd(ctx.keys.verified(machine), *verified)


@contextmanager
def api_with_copies(
    settings: Settings, model_folder: Path, *model_ids: str
) -> Iterator[tuple[TestClient, ServerContext]]:
    """The real ASGI app (its API key in every request) on a fleet of ``server`` and ``m1``, with
    ``model_folder`` registered once under each of ``model_ids`` and verified on both machines;
    no worker runs (jobs stay queued). Closed at the end."""
    from fastapi.testclient import TestClient

    from app.api.server import create_app
    from app.context import build_context

    ctx = build_context(settings, make_fleet("m1"), migrate=True)
    try:
        for model_id in model_ids:
            ctx.registry.add(model_folder, model_id)
        for machine in ("server", "m1"):
            bring_online(ctx, machine, set(model_ids))
        with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
            yield client, ctx
    finally:
        ctx.close()


def files_under(folder: Path) -> set[Path]:
    """Every file below ``folder``."""
    return {p for p in folder.rglob("*") if p.is_file()}


def png(width: int, height: int, colour: tuple[int, int, int] | None = None) -> bytes:
    """A PNG of width x height pixels: one ``colour``, else a gradient (so it compresses)."""
    from PIL import Image

    image = Image.new("RGB", (width, height), colour or (0, 0, 0))
    if colour is None:
        image.putdata([(x * 255 // width, y * 255 // height, 96) for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A real safetensors file of uint8 tensors (name -> bytes), zero-filled."""
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


class FakeTorch:
    """A torch module with ``cuda`` and ``mps`` namespaces: allocations are tracked in bytes,
    the allocator cache keeps freed bytes until ``empty_cache``; every call is recorded."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.live_bytes = 0  # held by live tensors
        self.cached_bytes = 0  # freed but kept by the caching allocator
        self.calls: list[str] = []
        self.fraction: float | None = None
        self.cuda = SimpleNamespace(
            mem_get_info=self._mem_get_info, empty_cache=self._empty_cache, memory_allocated=lambda: self.live_bytes
        )
        self.mps = SimpleNamespace(
            recommended_max_memory=lambda: self.total_bytes,
            driver_allocated_memory=lambda: self.live_bytes + self.cached_bytes,
            empty_cache=self._empty_cache,
            set_per_process_memory_fraction=self._set_fraction,
        )

    def _mem_get_info(self) -> tuple[int, int]:
        return self.total_bytes - self.live_bytes - self.cached_bytes, self.total_bytes

    def _empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached_bytes = 0

    def _set_fraction(self, fraction: float) -> None:
        self.calls.append(f"set_fraction({fraction})")
        self.fraction = fraction


class FakePipeline:
    """Holds ``nbytes`` of the fake device until it is garbage collected."""

    def __init__(self, torch: FakeTorch, name: str, nbytes: int) -> None:
        self.torch, self.name, self.nbytes = torch, name, nbytes
        torch.calls.append(f"load({name})")
        torch.live_bytes += nbytes

    def to(self, device: str) -> FakePipeline:
        """As a diffusers pipeline's: moves every component onto ``device``."""
        self.device = device
        return self

    def __del__(self) -> None:
        self.torch.calls.append(f"free({self.name})")
        self.torch.live_bytes -= self.nbytes
        self.torch.cached_bytes += self.nbytes


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels (its IHDR rewritten, CRC
    fixed): a decompression bomb's first bytes, without its memory."""
    import struct
    import zlib

    data = bytearray(png(8, 8))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


@dataclass
class Received:
    """One request a :class:`WebhookReceiver` got: its arrival (``time.time()``), path, headers
    (lower-case names) and exact body bytes."""

    at_s: float
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class WebhookReceiver:
    """A real HTTP receiver on 127.0.0.1 (``url``): it records every POST and answers the
    statuses of ``statuses`` in turn, then ``then`` (the webhook tests), with a ``Location``
    header when ``location`` is set (a receiver that redirects)."""

    url: str
    statuses: list[int] = field(default_factory=list)
    then: int = 200
    received: list[Received] = field(default_factory=list)
    location: str | None = None

    def answer(self) -> int:
        return self.statuses.pop(0) if self.statuses else self.then


@contextmanager
def webhook_receiver(
    statuses: list[int] | None = None, then: int = 200, location: str | None = None
) -> Iterator[WebhookReceiver]:
    """Run a :class:`WebhookReceiver` (``http.server`` in a thread, on a free port) until the block ends."""
    receiver: WebhookReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            receiver.received.append(
                Received(time.time(), self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
            self.send_response(receiver.answer())
            if receiver.location is not None:
                self.send_header("Location", receiver.location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = WebhookReceiver(
        f"http://127.0.0.1:{server.server_address[1]}/hook", list(statuses or []), then, location=location
    )
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def served_api(ctx: ServerContext, port: int | None = None) -> Iterator[str]:
    """The real API over ``ctx`` served by uvicorn on ``port`` (default: a free one), in a thread,
    until the block ends; yields its base URL. No lifespan: no reconciliation pass or webhook loop
    runs meanwhile. ``ctx`` is not closed here."""
    import uvicorn

    from app.api.server import create_app
    from app.devtools.redis_server import free_port

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(ctx.settings, ctx), host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout_s=30, what="uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def held_bytes(pipeline: object) -> dict[str, int]:
    """Bytes per component that a loaded pipeline (or a ``TextModel``, as ``""``) holds, measured
    on its tensors: every parameter and buffer of every torch-module component, each tensor once,
    a torchao tensor subclass (``Int8Tensor``) counted by its inner tensors (``qdata`` +
    ``scale``, torchao's ``__tensor_flatten__``)."""
    import torch

    def size(tensor: torch.Tensor) -> int:
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
            return sum(size(getattr(tensor, n)) for n in names if getattr(tensor, n) is not None)
        return tensor.numel() * tensor.element_size()

    components = getattr(pipeline, "components", None)
    modules = components.items() if components is not None else [("", pipeline.model)]  # type: ignore[attr-defined]
    sizes: dict[str, int] = {}
    for name, module in modules:
        if isinstance(module, torch.nn.Module):
            tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
            sizes[name] = sum(size(t) for t in tensors.values())
    return sizes
