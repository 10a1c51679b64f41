"""A Hugging Face cache's blobs checked against their names before they are registered (R4).

``huggingface_hub`` stores each file of a repository once, as ``blobs/<name>``, and a snapshot
links to it (docs/operations.md, "What registration takes"). The name is the file's content
address on the Hub: for a file kept in Git LFS (weights, and anything large) the SHA-256 of its
bytes (64 hex digits); for a file kept in git itself (``config.json``, tokenizer files) its git
blob hash, the SHA-1 of ``blob <size>\\0`` and its bytes (40 hex digits). A blob whose bytes do
not match its name was damaged after the download (a disk error, an edit through the snapshot's
link, a copy cut short): registering it would sign the damage into the manifest, and every
machine would then verify the wrong bytes as right. Both hashes are ``huggingface_hub``'s own
(``huggingface_hub.utils.sha``); a blob costs one more read of its bytes (SHA-256 on one core:
about 0.7 s per GiB from the page cache on a 2-core host, beside 0.2 s for BLAKE3; the same
section).
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub.utils.sha import git_hash, sha_fileobj

from app.core.errors import IntegrityFailure

BLOBS = "blobs"
"""The folder of a cached repository that holds its files' bytes, each named by its hash."""

_LFS_NAME = re.compile(r"[0-9a-f]{64}")
_GIT_NAME = re.compile(r"[0-9a-f]{40}")

GIT_BLOB_MAX_BYTES = 64 * 1024 * 1024
"""The largest blob named by a git hash that is read whole to check it (bytes): the Hub keeps
files over 10 MB in LFS (named by SHA-256), so a git-named blob is small; a larger one is a
name this module does not know and is left unchecked rather than read into memory."""


class BlobMismatch(IntegrityFailure):
    """A cache blob's bytes do not hash to its name (the message says which and how to mend it)."""


def blob_of(origin: Path) -> Path | None:
    """The cache blob ``origin`` is (a snapshot's link to it, or the blob itself), or None when
    it is no file in a ``blobs/`` folder named by a hash :func:`check_blob` knows."""
    target = Path(origin).resolve()
    if target.parent.name != BLOBS or not (_LFS_NAME.fullmatch(target.name) or _GIT_NAME.fullmatch(target.name)):
        return None
    return target


def check_blob(path: str, origin: Path) -> None:
    """Check that the bytes of the cache blob behind ``origin`` (the file registered as
    ``path``) hash to the blob's name; nothing is checked for a file outside a cache's blobs.

    Raises:
        BlobMismatch: ``"<path> does not match its Hugging Face cache blob (...)"``, naming
            the blob, the hash its name says and the hash of its bytes.
        OSError: the blob cannot be read.
    """
    blob = blob_of(origin)
    if blob is None:
        return
    if _LFS_NAME.fullmatch(blob.name):
        with open(blob, "rb") as handle:
            found, what = sha_fileobj(handle).hex(), "SHA-256"
    else:
        if blob.stat().st_size > GIT_BLOB_MAX_BYTES:
            return
        found, what = git_hash(blob.read_bytes()), "git blob hash"
    if found != blob.name:
        raise BlobMismatch(
            f"{path} does not match its Hugging Face cache blob {blob} (its name is the {what} the Hub "
            f"gave the file; its bytes hash to {found}): the cached copy was damaged after the download; "
            "delete that blob and download the file again"
        )


def interrupted_downloads(snapshot: Path) -> list[Path]:
    """The partial downloads (``blobs/*.incomplete``: what ``huggingface_hub`` writes before it
    renames a finished file into place) in the cached repository of ``snapshot``
    (``…/models--org--name/snapshots/<commit>``), sorted; a snapshot that lacks a file whose
    download was cut short links to no blob for it, so registration takes what is left (e.g. a
    component's ``.bin`` in place of its missing safetensors)."""
    blobs = Path(snapshot).parent.parent / BLOBS
    return sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []


__all__ = ["BLOBS", "GIT_BLOB_MAX_BYTES", "BlobMismatch", "blob_of", "check_blob", "interrupted_downloads"]
