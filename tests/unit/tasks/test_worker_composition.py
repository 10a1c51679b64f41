"""The worker's composition root (tasks/worker.py, tasks/hooks.py): its server clients are built
in one place, ``ServerClient.for_worker`` (tasks/server_client.py), and its parent's signal
handlers come from one table. An AST scan of the code that ships (not the tests, which talk to
test servers with clients of their own)."""

from __future__ import annotations

import ast
from pathlib import Path

from app.core.config import WorkerSettings
from tasks.hooks import SIGNALS, WorkerParent
from tasks.server_client import ServerClient

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ("app", "tasks", "routing", "residency", "bench")
HOMES = {Path("tasks/server_client.py")}  # ServerClient.for_worker: the one constructor call


def _constructions(path: Path) -> list[int]:
    """Lines of ``path`` that call ``ServerClient(...)`` (by name or as ``cls(...)`` is not counted)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "ServerClient")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "ServerClient")
        )
    ]


def test_server_clients_are_built_only_by_for_worker() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for package in SHIPPED
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT) not in HOMES and (lines := _constructions(path))
    }
    assert found == {}, f"ServerClient(...) built outside ServerClient.for_worker: {found}"


def test_the_scan_sees_a_construction() -> None:
    """The scan is not blind: it finds a direct call, and for_worker's own is in its home."""
    assert _constructions(ROOT / "tests/integration/tasks/test_claim_during_outage.py")
    home = ast.parse((ROOT / "tasks/server_client.py").read_text())
    for_worker = next(
        node for node in ast.walk(home) if isinstance(node, ast.FunctionDef) and node.name == "for_worker"
    )
    assert any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "cls" for n in ast.walk(for_worker)
    )


def test_for_worker_sends_the_machine_its_token_and_boot(tmp_path: Path) -> None:
    settings = WorkerSettings(
        machine="m1",
        server_url="http://127.0.0.1:9/",
        worker_token="t" * 32,
        http_timeout_s=7.0,
        server_retry_s=45.0,
        models_dir=tmp_path,
    )
    patient = ServerClient.for_worker(settings, "boot-1", patient=True)
    once = ServerClient.for_worker(settings)
    try:
        assert str(patient.http.base_url) == "http://127.0.0.1:9/internal/v1/"
        assert patient.http.headers["Authorization"] == "Bearer " + "t" * 32
        assert patient.http.headers["X-Homefleet-Machine"] == "m1"
        assert patient.http.headers["X-Homefleet-Boot-Id"] == "boot-1"
        assert patient.retry_s == 45.0 and patient.http.timeout.read == 7.0
        assert once.retry_s == 0.0 and "X-Homefleet-Boot-Id" not in once.http.headers
    finally:
        patient.close()
        once.close()


def test_every_signal_handler_is_a_named_method_connected_once() -> None:
    names = [name for _, name in SIGNALS]
    assert len(set(zip([id(sig) for sig, _ in SIGNALS], names, strict=True))) == len(SIGNALS) == 14
    assert all(callable(getattr(WorkerParent, name, None)) for name in names), names
