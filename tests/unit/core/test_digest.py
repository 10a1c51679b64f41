"""Full-content digests (R4, R5, C07) and the resident-model check of R5, as pure unit tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest

from app.core.digest import algorithm_of, bytes_digest, file_digest, parse
from app.core.protocol import Manifest, ManifestFile
from residency.cache import ModelCache
from tasks.devices import CpuDevice
from tasks.verify import model_problems, verified_models


def manifest_of(model_id: str, files: list[dict[str, object]]) -> Manifest:
    return Manifest(
        model_id=model_id, family="sd1", kinds=["txt2img"], files=[ManifestFile.model_validate(f) for f in files]
    )


def write_with_last_byte_changed(original: Path, copy: Path) -> None:
    """``copy`` = ``original`` with its LAST byte changed; same size and same mtime_ns."""
    data = bytearray(original.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    stat = original.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("size_bytes", [1, 3 * 1024 * 1024 + 17, 16 * 1024 * 1024, 17 * 1024 * 1024 + 5])
def test_c07_a_digest_reads_the_last_byte(tmp_path: Path, algorithm: str, size_bytes: int) -> None:
    original = tmp_path / "a.bin"
    original.write_bytes(os.urandom(size_bytes))
    copy = tmp_path / "b.bin"
    write_with_last_byte_changed(original, copy)
    assert (copy.stat().st_size, copy.stat().st_mtime_ns) == (original.stat().st_size, original.stat().st_mtime_ns)
    assert file_digest(original, algorithm) != file_digest(copy, algorithm)
    assert file_digest(original, algorithm) == bytes_digest(original.read_bytes(), algorithm)


def test_digests_name_their_algorithm_and_match_the_reference_libraries(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"homefleet" * 1000)
    assert file_digest(path) == "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()
    assert file_digest(path, "sha256") == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_digest(empty) == bytes_digest(b"")
    assert algorithm_of(file_digest(path, "sha256")) == "sha256"
    for bad in ("md5:" + "0" * 64, "blake3:" + "0" * 63, "blake3:" + "G" * 64, "nonsense"):
        with pytest.raises(ValueError, match="64 lowercase hex digits"):
            parse(bad)


def test_c07_the_worker_check_finds_a_same_size_same_mtime_change(tmp_path: Path) -> None:
    models = tmp_path / "models"
    folder = models / "x" / "unet"
    folder.mkdir(parents=True)
    weights = folder / "w.safetensors"
    weights.write_bytes(os.urandom(200_000))
    (folder / "config.json").write_text("{}")
    manifest = manifest_of(
        "x",
        [
            {"path": f"unet/{p.name}", "size": p.stat().st_size, "digest": file_digest(p)}
            for p in sorted(folder.iterdir())
        ],
    )
    assert model_problems(models, manifest) == []
    assert verified_models(models, {"x": manifest}) == {"x"}
    backup = tmp_path / "orig"
    backup.write_bytes(weights.read_bytes())
    os.utime(backup, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))
    write_with_last_byte_changed(backup, weights)
    problems = model_problems(models, manifest)
    assert len(problems) == 1 and problems[0].startswith("unet/w.safetensors: digest blake3:")
    assert verified_models(models, {"x": manifest}) == set()
    (folder / "config.json").unlink()
    assert "unet/config.json: missing" in model_problems(models, manifest)


def test_r5_a_resident_model_is_reused_only_while_the_server_digests_are_unchanged() -> None:
    loads: list[Path] = []
    cache = ModelCache(lambda folder: loads.append(folder) or object(), CpuDevice())
    files = [{"path": "unet/w.safetensors", "size": 10, "digest": bytes_digest(b"one")}]
    key = manifest_of("x", files).key()
    changed_key = manifest_of("x", [{**files[0], "digest": bytes_digest(b"two")}]).key()
    assert manifest_of("x", files).key() == key  # the same manifest: the same key
    assert key != changed_key
    _, _, cold = cache.get("x", key, Path("/m/x"))
    assert cold and cache.is_warm("x", key)
    _, _, cold = cache.get("x", key, Path("/m/x"))
    assert not cold and len(loads) == 1
    # The server's file changed: the recorded digest no longer matches, so it is not warm
    # (run_job then re-verifies the worker's files) and it is loaded again.
    assert not cache.is_warm("x", changed_key)
    _, _, cold = cache.get("x", changed_key, Path("/m/x"))
    assert cold and len(loads) == 2
