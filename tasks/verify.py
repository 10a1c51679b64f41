"""The worker's side of "a file's identity is its content" (R4, R5): hash the local copy of
a model's files and compare every one with the server's manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.core.digest import algorithm_of, file_digest


def model_problems(models_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """What is wrong with the local copy of one model: missing files, other sizes, other
    digests (every byte is read, with the algorithm the manifest names; no cache, so a
    same-size same-mtime change is found too, C07). Empty when the copy matches exactly."""
    folder = models_dir / manifest["model_id"]
    problems = []
    for entry in manifest["files"]:
        path = folder / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{entry['path']}: {path.stat().st_size} bytes, manifest says {entry['size']}")
        elif (actual := file_digest(path, algorithm_of(entry["digest"]))) != entry["digest"]:
            problems.append(f"{entry['path']}: digest {actual}, manifest says {entry['digest']}")
    return problems


def verified_models(models_dir: Path, manifests: dict[str, dict[str, Any]]) -> set[str]:
    """Ids of the models whose local copy matches the manifest in full (R4)."""
    return {model_id for model_id, manifest in manifests.items() if not model_problems(models_dir, manifest)}
