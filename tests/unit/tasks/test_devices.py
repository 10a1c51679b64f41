"""The worker's device adapters (R15, R18) against a fake torch module (no CUDA/MPS device here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.devices import CpuDevice, CudaDevice, MpsDevice, bind_device, device_for
from tests.helpers import FakeTorch

ROOT = Path(__file__).resolve().parents[3]
MB = 1_000_000


def test_r18_memory_fraction_is_set_only_by_the_mps_adapter() -> None:
    files = [
        p
        for folder in ("app", "tasks", "routing", "residency", "bench")
        for pattern in ("*.py", "*.sh")
        for p in (ROOT / folder).rglob(pattern)
    ]
    found = sorted(str(p.relative_to(ROOT)) for p in files if "set_per_process_memory_fraction" in p.read_text())
    assert found == ["tasks/devices.py"]
    source = (ROOT / "tasks/devices.py").read_text()
    calls = [m.start() for m in re.finditer(r"\.set_per_process_memory_fraction\(", source)]
    assert len(calls) == 1 and source.rindex("class MpsDevice", 0, calls[0]) > source.rindex("class CudaDevice")


def test_r18_cuda_guard_sets_no_fraction_and_mps_guard_does() -> None:
    torch = FakeTorch(8 * MB)
    CudaDevice(torch).guard()
    assert torch.fraction is None
    MpsDevice(torch, fraction=0.8).guard()
    assert torch.fraction == 0.8


def test_device_adapters_report_memory() -> None:
    torch = FakeTorch(100 * MB)
    torch.live_bytes, torch.cached_bytes = 30 * MB, 10 * MB
    cuda, mps = device_for("cuda", torch), device_for("mps", torch)
    assert (cuda.memory_kind, cuda.capacity_bytes(), cuda.available_bytes(), cuda.allocated_bytes()) == (
        "dedicated",
        100 * MB,
        60 * MB,
        30 * MB,
    )
    # MPS: driver-allocated memory includes the allocator's cache.
    assert (mps.memory_kind, mps.capacity_bytes(), mps.available_bytes(), mps.allocated_bytes()) == (
        "unified",
        100 * MB,
        60 * MB,
        40 * MB,
    )
    cpu = CpuDevice()
    assert cpu.memory_kind == "unified" and 0 < cpu.available_bytes() <= cpu.capacity_bytes()
    with pytest.raises(ValueError, match="cpu, cuda, mps"):
        device_for("tpu", torch)


def test_a_hosts_device_binds_its_worker_to_its_card_and_a_plain_machine_to_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ: dict[str, str] = {}
    assert bind_device("box:1", environ) == 1
    assert environ == {"CUDA_VISIBLE_DEVICES": "1"}
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}  # an inherited value is replaced, with a warning
    with caplog.at_level("WARNING", logger="tasks.devices"):
        assert bind_device("box:0", environ) == 0
    assert environ == {"CUDA_VISIBLE_DEVICES": "0"}
    assert "CUDA_VISIBLE_DEVICES was '0,1'; set to 0" in caplog.text
    for plain in ("box", "server", "Not_A_Machine"):  # the last one the server refuses
        environ = {"CUDA_VISIBLE_DEVICES": "3"}
        assert bind_device(plain, environ) is None
        assert environ == {"CUDA_VISIBLE_DEVICES": "3"}
