"""Is a ``.bin`` weights file whole? Checked without unpickling anything.

``torch.save`` (torch 1.6 and newer, the format of every ``pytorch_model.bin`` and
``diffusion_pytorch_model.bin`` on the Hub since 2020) writes a zip archive: its central
directory, at the end of the file, lists each member's offset and size. A download cut short
loses that directory (or the members' bytes it points to); reading the directory and comparing
each member's extent with the file's size finds it, as ``torch.load`` would fail on it, without
reading the tensors. The older format (a bare pickle stream) has no such index and is not
checked here.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from app.core.errors import IntegrityFailure

ZIP_MAGIC = b"PK\x03\x04"
"""The first four bytes of a zip archive (a local file header), so of ``torch.save``'s format."""
PICKLE_MAGIC = b"\x80"
"""The first byte of a pickle of protocol 2 or later: torch's older format (before 1.6)."""


def check_archive(path: Path) -> None:
    """Check that the ``torch.save`` archive at ``path`` is whole: its central directory reads
    and every member lies inside the file. A file in torch's older, non-zip format passes.

    Raises:
        IntegrityFailure: naming the file and what is wrong (no central directory: truncated;
            a member past the end of the file; neither format: zeros, an HTML error page).
    """
    with path.open("rb") as handle:
        magic = handle.read(len(ZIP_MAGIC))
    if magic != ZIP_MAGIC:
        if magic[:1] == PICKLE_MAGIC:  # torch's older format: no index to check
            return
        raise IntegrityFailure(
            f"{path.name}: neither a torch archive (a zip) nor torch's older pickle format (it starts {magic!r})"
        )
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise IntegrityFailure(f"{path.name}: not a whole torch archive ({error})") from error
    for member in members:
        # a local header is 30 bytes + its name + its extra field (not read: bounded below)
        end = member.header_offset + 30 + len(member.orig_filename.encode()) + member.compress_size
        if end > size:
            raise IntegrityFailure(
                f"{path.name}: member {member.orig_filename} ends at byte {end} of a {size}-byte file"
            )
