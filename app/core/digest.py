"""Full-content digests: a file's identity is its content (R4, R5).

Digests are strings ``"<algorithm>:<hex>"`` so a manifest says how it was made.

Choice of algorithm (bench/digest.py measures it; docs/benchmarks.md has the
figures): BLAKE3 (the ``blake3`` package) on every core over a memory map of the file keeps
close to a cold sequential read of the same file and runs at several GB/s on a cached one,
so verification before a cold load costs little more than the read the load needs anyway
(and leaves the file in the page cache for that load). BLAKE3 on one core and SHA-256
(hashlib, one core) were slower, cold and cached. Files are therefore hashed with BLAKE3;
``sha256:<hex>`` digests are still understood (``file_digest`` takes the algorithm a
manifest names) so a manifest made with either can be checked.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3

ALGORITHM = "blake3"
"""The algorithm the server uses for new manifests and results."""

ALGORITHMS = ("blake3", "sha256")
"""Algorithms a digest string may name; both have 32-byte (64 hex digit) digests."""

CHUNK_BYTES = 1024 * 1024


def bytes_digest(data: bytes, algorithm: str = ALGORITHM) -> str:
    """Digest of ``data``: ``"<algorithm>:<64 hex>"``. Raises ``ValueError`` for an unknown algorithm."""
    return f"{algorithm}:{_hasher(algorithm, data).hexdigest()}"


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Digest of every byte of the file at ``path``: ``"<algorithm>:<64 hex>"``.

    BLAKE3 maps the file and hashes it on all cores (the package's ``update_mmap``);
    SHA-256 reads and hashes 1 MiB chunks on one core. A file truncated by someone else
    while it is being hashed ends the process with SIGBUS (as any mmap reader): Homefleet
    hashes only files it owns (the server's models, a worker's own copies).

    Raises:
        OSError: the file cannot be read.
        ValueError: unknown ``algorithm``.
    """
    if algorithm == "blake3":
        return f"{algorithm}:{_blake3_file(Path(path))}"
    sha = _hasher(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            sha.update(chunk)
    return f"{algorithm}:{sha.hexdigest()}"


_threads = {"max": blake3.blake3.AUTO}


def single_threaded() -> None:
    """Hash on one thread from now on in this process. Called in every forked pool process of
    a worker: BLAKE3's thread pool (Rayon) is created once per process, and a child forked
    after its parent used it inherits a pool without threads and would wait forever."""
    _threads["max"] = 1


def _blake3_file(path: Path) -> str:
    hasher = blake3.blake3(max_threads=_threads["max"])
    if os.stat(path).st_size:  # an empty file cannot be mapped
        # No MADV_SEQUENTIAL hint: the threads read different parts of the map at once, and
        # the hint halved cold throughput here (bench/digest.py).
        hasher.update_mmap(os.fspath(path))
    return str(hasher.hexdigest())


def algorithm_of(digest: str) -> str:
    """The algorithm named by ``"<algorithm>:<hex>"``. Raises ``ValueError`` on another form."""
    parse(digest)
    return digest.partition(":")[0]


def parse(digest: str) -> tuple[str, str]:
    """``(algorithm, hex)`` of ``"<algorithm>:<hex>"``.

    Raises:
        ValueError: unknown algorithm or not 64 lowercase hex digits (the message names both).
    """
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm not in ALGORITHMS or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(
            f"digest must be one of {', '.join(a + ':' for a in ALGORITHMS)} followed by 64 lowercase hex digits, "
            f"got {digest!r}"
        )
    return algorithm, hexdigest


def hex_part(digest: str) -> str:
    """The hex part of ``"<algorithm>:<hex>"``. Raises ``ValueError`` on another form."""
    return parse(digest)[1]


def _hasher(algorithm: str, data: bytes = b""):  # type: ignore[no-untyped-def]
    if algorithm == "blake3":
        return blake3.blake3(data)
    if algorithm == "sha256":
        return hashlib.sha256(data)
    raise ValueError(f"digest algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
