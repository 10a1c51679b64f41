"""A server behind TLS with a certificate of its own CA (or self-signed), joined as
docs/operations.md "Add a machine" says: ``homefleet worker join https://…`` on a host that does
not trust it names the certificate and ``SSL_CERT_FILE`` (it said "cannot be reached … give the
URL `homefleet machines add` printed", the very URL given), ``homefleet doctor`` says the same,
and a supervisor file printed with ``SSL_CERT_FILE`` set carries it (without it the supervised
worker could never reach the server the join reached). A real TLS listener of a certificate made
by ``openssl``, ``homefleet`` as subprocesses."""

from __future__ import annotations

import configparser
import plistlib
import shlex
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core.secret_files import write_private
from tests.helpers import run_cli


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``https://127.0.0.1:PORT`` of a listener whose certificate is self-signed, and that certificate."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:  # handshakes only: a client that trusts nothing of it fails there
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                context.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}", cert
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=10)


def bare(**more: str | None) -> dict[str, str | None]:
    """A worker host's environment: no HOMEFLEET_* of the test's, no CA of its own."""
    return {"SSL_CERT_FILE": None, "SSL_CERT_DIR": None, "HOMEFLEET_WORKER_TOKEN": None, **more}


def test_a_join_and_doctor_against_an_untrusted_certificate_name_it_and_ssl_cert_file(
    tls_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = tls_server
    models = tmp_path / "host" / "models"
    joined = run_cli("worker", "join", url, "hfj_" + "x" * 43, "--models-dir", str(models), env=bare(), check=False)
    assert joined.returncode == 2, joined.stdout + joined.stderr
    said = " ".join(joined.stderr.split())
    assert said.startswith("error (certificate_untrusted): the server at"), said
    assert "self-signed certificate" in said and "SSL_CERT_FILE=/path/ca.pem" in said, said
    assert "give the URL" not in said, said
    assert not (tmp_path / "host" / "worker-token").exists()
    doctored = run_cli("doctor", env=bare(HOMEFLEET_SERVER_URL=url, COLUMNS="200"), check=False)
    said = " ".join(doctored.stdout.split())
    assert doctored.returncode == 1 and f"{url}: certificate not trusted (self-signed certificate)" in said, said
    assert "SSL_CERT_FILE=/path/ca.pem" in said, said


def test_a_supervisor_file_printed_with_ssl_cert_file_set_carries_it(
    tls_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, cert = tls_server
    token_file = tmp_path / "token"
    write_private(token_file, "secret-token-0123456789\n")
    worker = ("worker", "--machine", "box1", "--models-dir", str(tmp_path / "models"), "--token-file", str(token_file))
    env = bare(SSL_CERT_FILE=str(cert), HOMEFLEET_REDIS_URL="redis://127.0.0.1:6390/3")
    unit = run_cli(*worker, "--server-url", url, "--print-systemd-unit", env=env)
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(unit.stdout)
    assert f"SSL_CERT_FILE={cert.resolve()}" in shlex.split(parser["Service"]["Environment"]), unit.stdout
    plist = plistlib.loads(run_cli(*worker, "--server-url", url, "--print-launchd-plist", env=env).stdout.encode())
    assert plist["EnvironmentVariables"]["SSL_CERT_FILE"] == str(cert.resolve()), plist
