"""A result's provenance: where it came from, in enough detail to reproduce it.

Two parts:

* the **embedded** record (written into the file: PNG text chunk ``homefleet``, MP4
  ``comment`` tag, WebP XMP, GIF comment) holds what determines the output: model id,
  variant, every model file's digest, its LoRA adapters (id, scale, files' digests; issue
  22), the digest of the single-file checkpoint it was converted from (``source_digest``, when
  it was), kind, params, seed, inputs' digests, machine and device. It holds no job id and no timings, so the same
  seed on the same machine gives
  byte-identical files (and the same content digest);
* the **journaled** record (``Job.provenance``, shown by ``GET /v1/jobs/{id}``) is the
  embedded one plus job id, load/run seconds, cold load, actual and predicted seconds,
  which the server adds when it stores the result.
"""

from __future__ import annotations

import platform
from typing import Any

from app.core.protocol import Manifest


def embedded_provenance(*, model_id: str, manifest: Manifest, kind: str, params: dict[str, Any],
                        inputs: dict[str, str], machine: str, device: str,
                        adapters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The deterministic record embedded in the output file.

    ``manifest`` is the server's manifest the files were verified against (R5): its digests
    are copied as they are, so the record's ``model_files`` equal the manifest's exactly.
    ``inputs`` maps an input field to its digest (``{"image": "blake3:…"}``). ``adapters``: the
    job's LoRA adapters, each ``{"id", "scale", "files": {path: digest}}`` as their
    manifests give them (``tasks.adapters.provenance_entries``); the key is left out without any.
    """
    record: dict[str, Any] = {
        "homefleet": 1,  # provenance format version
        "model_id": model_id,
        "precision": manifest.precision,
        "quantization": manifest.quantization,
        "model_files": {f.path: f.digest for f in manifest.files},
        "kind": kind,
        "params": params,
        "seed": params.get("seed"),
        "inputs": inputs,
        "machine": machine,
        "device": device,
        "host": platform.node(),
    }
    if manifest.source_digest:
        record["source_digest"] = manifest.source_digest  # the checkpoint file it was converted from
    if adapters:
        record["adapters"] = adapters
    return record
