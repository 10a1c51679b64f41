"""The server's memory under unauthenticated uploads (the key or token is checked before any body
is read): RSS of a real ``homefleet serve`` before and after N chunked 64 MiB POSTs without a key
or token.

Each upload is sent as an attacker sends it, over a raw socket: the request line and headers
(``Transfer-Encoding: chunked``, no ``Content-Length``, a wrong bearer token), then 1 MiB
chunks until the whole body is sent or the server answers first. Its status line is read. The
server must answer 401 without reading the body, and its RSS must not grow.

    python -m bench.upload_rss            # its own server (a LocalFleet with no worker)
    python -m bench.upload_rss --count 20 --mib 64 [--forkserver]

The last line reads ``uploads=N mib=M status=401 rss_before_mb=… rss_after_mb=… growth_mb=…``.
"""

from __future__ import annotations

import argparse
import select
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

CHUNK = 1024 * 1024
PATHS = ("/internal/v1/jobs/0123456789abcdef0123456789abcdef/result", "/v1/files", "/v1/images/edits")


@dataclass(frozen=True)
class UploadRss:
    uploads: int
    mib: int
    statuses: tuple[int, ...]
    sent_mib: tuple[float, ...]  # how much of each body the server let the client send before answering
    rss_before: int  # bytes
    rss_after: int

    @property
    def growth_mb(self) -> float:
        return (self.rss_after - self.rss_before) / 1e6

    def line(self) -> str:
        statuses = ",".join(sorted({str(s) for s in self.statuses}))
        return (
            f"uploads={self.uploads} mib={self.mib} status={statuses} "
            f"sent_before_answer_mib={max(self.sent_mib):.0f} rss_before_mb={self.rss_before / 1e6:.1f} "
            f"rss_after_mb={self.rss_after / 1e6:.1f} growth_mb={self.growth_mb:.1f}"
        )


def chunked_upload(api_url: str, path: str, mib: int, timeout_s: float = 60.0) -> tuple[int, float]:
    """POST ``mib`` MiB, chunked, with a wrong token; returns (status, MiB sent before the answer)."""
    parts = urlsplit(api_url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\nAuthorization: Bearer not-a-token-of-this-fleet\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = f"{CHUNK:x}\r\n".encode() + b"\0" * CHUNK + b"\r\n"
    part = b'--x\r\nContent-Disposition: form-data; name="file"; filename="r.png"\r\nContent-Type: image/png\r\n\r\n'
    sent = 0
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s) as sock:
        sock.sendall(head + f"{len(part):x}\r\n".encode() + part + b"\r\n")  # a well-formed file part: 64 MiB of it
        try:
            for _ in range(mib):
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break  # the server answered (or closed) before the body was sent
                sock.sendall(chunk)
                sent += 1
            else:
                end = b"\r\n--x--\r\n"
                sock.sendall(f"{len(end):x}\r\n".encode() + end + b"\r\n0\r\n\r\n")
        except OSError:
            pass  # the server closed the connection on its unread body
        answer = b""
        deadline = time.monotonic() + timeout_s
        while b"\r\n" not in answer and time.monotonic() < deadline:
            try:
                data = sock.recv(4096)
            except OSError:
                break
            if not data:
                break
            answer += data
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, sent


def measure(api_url: str, pid: int, count: int = 20, mib: int = 64, settle_s: float = 1.0) -> UploadRss:
    """Send ``count`` unauthenticated uploads of ``mib`` MiB to the server with process ``pid``,
    cycling over :data:`PATHS`; RSS before and after (after ``settle_s`` seconds)."""
    process = psutil.Process(pid)
    before = process.memory_info().rss
    results = [chunked_upload(api_url, PATHS[index % len(PATHS)], mib) for index in range(count)]
    time.sleep(settle_s)
    return UploadRss(
        uploads=count,
        mib=mib,
        statuses=tuple(status for status, _ in results),
        sent_mib=tuple(float(sent) for _, sent in results),
        rss_before=before,
        rss_after=process.memory_info().rss,
    )


def main(argv: list[str] | None = None) -> None:
    from app.core.config import Settings
    from app.core.secret_files import write_private
    from app.devtools.localfleet import LocalFleet
    from app.devtools.redis_server import free_port, start_redis_server
    from app.fleet.config import load_fleet, with_fresh_tokens
    from bench import add_forkserver_flag

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--mib", type=int, default=64)
    add_forkserver_flag(parser, "; the server's RSS then counts the fork server's preloaded modules (torch)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="upload-rss-"))
    redis_process = start_redis_server(root / "redis")
    fleet = with_fresh_tokens(load_fleet(None))
    fleet_file = root / "fleet.toml"
    write_private(fleet_file, fleet.to_toml())
    settings = Settings(
        data_dir=root / "server",
        redis_url=redis_process.url,
        fleet_file=fleet_file,
        api_port=free_port(),
        api_keys=["bench-upload-rss-key-0123"],
    )
    local = LocalFleet(settings, fleet, fleet_file, forkserver=args.forkserver)
    try:
        local.start_api()
        measure(local.api_url, local.processes["api"].pid, count=2, mib=4)  # warm the server's code paths
        print(measure(local.api_url, local.processes["api"].pid, args.count, args.mib).line())
    finally:
        local.stop()
        redis_process.stop()


if __name__ == "__main__":
    main()
