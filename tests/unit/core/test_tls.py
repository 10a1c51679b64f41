"""One TLS context per process for every HTTP client (app/core/tls.py): httpx would otherwise
parse certifi's CA bundle for each client it makes, ~45 ms of CPU each on the 2-core CI machine."""

from __future__ import annotations

import ast
import ssl
from pathlib import Path

import httpx

from app.client import HomefleetClient
from app.core.tls import tls_context
from tasks.server_client import ServerClient

ROOT = Path(__file__).resolve().parents[3]
#: httpx's calls that build a client, and with it a TLS context unless one is given
BUILDS_A_CLIENT = {
    "Client",
    "AsyncClient",
    "get",
    "post",
    "put",
    "patch",
    "delete",
    "head",
    "options",
    "request",
    "stream",
}


def test_the_context_is_built_once_and_verifies_as_httpx_does() -> None:
    context = tls_context()
    assert context is tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # certifi's bundle (or SSL_CERT_FILE's) is loaded


def test_the_homefleet_and_worker_clients_share_it() -> None:
    client = HomefleetClient("http://127.0.0.1:1")
    server = ServerClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], token="t", timeout_s=1)
    try:
        pools = [client.http._transport._pool] + [c._transport._pool for c in server.clients]  # type: ignore[attr-defined]
        assert all(pool._ssl_context is tls_context() for pool in pools)
    finally:
        client.close()
        server.close()


def _unshared_calls(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line`` (relative to ``root``) of each ``httpx.<call>(...)`` in ``path`` that builds a
    client without ``verify=``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "httpx"
            and node.func.attr in BUILDS_A_CLIENT
            and not any(keyword.arg == "verify" for keyword in node.keywords)
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno} httpx.{node.func.attr}")
    return found


def test_every_client_in_app_tasks_and_the_tests_passes_the_shared_context() -> None:
    """The tests' own calls too: their polling loops made thousands of clients a run."""
    files = [path for package in ("app", "tasks", "tests") for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100
    unshared = [call for path in files for call in _unshared_calls(path)]
    assert not unshared, f"pass verify=tls_context() (app/core/tls.py): {unshared}"


def test_the_check_finds_a_client_without_it(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import httpx\nhttpx.get('http://x')\nhttpx.Client(verify=False)\n")
    assert _unshared_calls(sample, tmp_path) == ["sample.py:2 httpx.get"]
    assert httpx.Client(verify=tls_context())._transport._pool._ssl_context is tls_context()  # type: ignore[attr-defined]
