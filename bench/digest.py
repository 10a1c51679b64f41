"""Digest throughput beside a plain sequential read of the same file, cold and page-cached,
and the overhead verification adds to a cold load of a model (R4, R5).

    .venv/bin/python bench/digest.py [--size-bytes 1000000000] [--dir /tmp] [--repeats 3]

It writes one safetensors file of ``--size-bytes`` random bytes (so the same file is both
"a file" and "a model") under ``--dir``, and deletes it at the end. "Cold" means the file
was evicted from the page cache right before the run with
``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` (no privileges needed; ``fincore`` from
util-linux, when present, shows the resident bytes after eviction). Every figure is the
median of ``--repeats`` runs in this one process, against a baseline measured in the same
run: the plain read for digests, the plain cold load for verification.

Candidates: BLAKE3 on every core over a memory map (``app.core.digest.file_digest``, what
Homefleet uses: the package's ``update_mmap``), the same with ``MADV_SEQUENTIAL`` on the map
(a hint that hurt here: the threads do not read in order), BLAKE3 on one core in 1 MiB
chunks, SHA-256 (hashlib) in 1 MiB chunks.
The cold load is ``safetensors.torch.load_file`` with every tensor copied into memory of
its own (what loading weights into a model's parameters does); "verify + load" hashes the
file first (which leaves it in the page cache), then loads it.

Last line: ``digest_vs_read=R verify_overhead=R cached_gbps=X`` where digest_vs_read is
Homefleet's digest's cold throughput / plain read cold throughput, verify_overhead is
(verify + load) / load - 1 (both cold), and cached_gbps is Homefleet's digest on a cached file,
in GB/s (1e9 bytes per second). Targets: digest_vs_read >= 0.9, verify_overhead <= 0.15.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.core.digest import file_digest

CHUNK_BYTES = 1024 * 1024
READ_BUFFER_BYTES = 8 * 1024 * 1024
TENSORS = 8


def write_model(path: Path, size_bytes: int) -> None:
    """A safetensors file of ``TENSORS`` uint8 tensors holding ``size_bytes`` random bytes in
    all (header: 8-byte little-endian length, then JSON), written in 1 MiB chunks and fsynced
    so that its pages can be evicted."""
    per = size_bytes // TENSORS
    header: dict[str, object] = {}
    for i in range(TENSORS):
        n = per if i < TENSORS - 1 else size_bytes - per * (TENSORS - 1)
        start = i * per
        header[f"t{i}"] = {"dtype": "U8", "shape": [n], "data_offsets": [start, start + n]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        left = size_bytes
        while left:
            chunk = os.urandom(min(CHUNK_BYTES * 16, left))
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path) -> str:
    """``fincore``'s resident size of the file, or '?' when fincore is not installed."""
    if not shutil.which("fincore"):
        return "?"
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "?"


def plain_read(path: Path) -> None:
    buffer = bytearray(READ_BUFFER_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(view):
            pass


def blake3_mmap_sequential(path: Path) -> None:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        hasher.update(mapped)
    hasher.hexdigest()


def blake3_one_core(path: Path) -> None:
    hasher = blake3.blake3()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    hasher.hexdigest()


def sha256_chunks(path: Path) -> None:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    hasher.hexdigest()


def load_model(path: Path) -> None:
    from safetensors.torch import load_file

    # load_file maps the file; copying every tensor into memory of its own is what loading
    # weights into a model's parameters does (and it reads every byte).
    tensors = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
    assert sum(t.numel() for t in tensors.values()) == path.stat().st_size - 8 - _header_bytes(path)
    del tensors


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as handle:
        return int(struct.unpack("<Q", handle.read(8))[0])


def verify_then_load(path: Path) -> None:
    file_digest(path)
    load_model(path)


def timed(fn: Callable[[Path], None], path: Path, cold: bool, repeats: int) -> float:
    """Median seconds of ``fn(path)`` over ``repeats`` runs (evicting first when ``cold``,
    else after one warm-up run)."""
    if not cold:
        fn(path)
    runs = []
    for _ in range(repeats):
        if cold:
            evict(path)
        started = time.perf_counter()
        fn(path)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-bytes", type=int, default=1_000_000_000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import safetensors.torch  # noqa: F401  (imported before timing: torch takes seconds to import)

    path = args.dir / f"homefleet-bench-digest-{os.getpid()}.safetensors"
    try:
        started = time.perf_counter()
        write_model(path, args.size_bytes)
        size = path.stat().st_size
        evict(path)
        print(
            f"file {path}: {size} bytes, written in {time.perf_counter() - started:.1f} s; "
            f"resident after eviction: {resident(path)} bytes; cores: {os.cpu_count()}"
        )
        gbps = lambda seconds: size / seconds / 1e9  # noqa: E731
        cases: dict[str, tuple[Callable[[Path], None], bool]] = {
            "read cold": (plain_read, True),
            "homefleet digest cold": (file_digest, True),
            "blake3 mmap + MADV_SEQUENTIAL cold": (blake3_mmap_sequential, True),
            "blake3 one core cold": (blake3_one_core, True),
            "sha256 cold": (sha256_chunks, True),
            "read cached": (plain_read, False),
            "homefleet digest cached": (file_digest, False),
            "blake3 mmap + MADV_SEQUENTIAL cached": (blake3_mmap_sequential, False),
            "blake3 one core cached": (blake3_one_core, False),
            "sha256 cached": (sha256_chunks, False),
            "load cold": (load_model, True),
            "verify + load cold": (verify_then_load, True),
        }
        seconds = {}
        for name, (fn, cold) in cases.items():
            seconds[name] = timed(fn, path, cold, args.repeats)
            print(f"{name:38s} {seconds[name]:7.3f} s  {gbps(seconds[name]):6.2f} GB/s")
        for name in ("homefleet digest", "blake3 mmap + MADV_SEQUENTIAL", "blake3 one core", "sha256"):
            print(f"{name + ' / read, cold':44s} {seconds['read cold'] / seconds[name + ' cold']:.2f}")
        digest_vs_read = seconds["read cold"] / seconds["homefleet digest cold"]
        verify_overhead = seconds["verify + load cold"] / seconds["load cold"] - 1
        cached = gbps(seconds["homefleet digest cached"])
        print(f"digest_vs_read={digest_vs_read:.2f} verify_overhead={verify_overhead:.2f} cached_gbps={cached:.2f}")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
