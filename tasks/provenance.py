"""A result's provenance: where it came from, in enough detail to reproduce it.

Two parts:

* the **embedded** record (written into the file: PNG text chunk ``homefleet``, MP4
  ``comment`` tag, WebP XMP, GIF comment) holds what determines the output: model id,
  variant, every model file's digest, its LoRA adapters (id, scale, files' digests), the
  digest of the single-file checkpoint it was converted from (``source_digest``, when
  it was), kind, params, seed, inputs' digests, machine and device. It holds no job id and no timings, so the same
  seed on the same machine gives
  byte-identical files (and the same content digest);
* the **A1111 ``parameters``** PNG text chunk (:func:`a1111_parameters`), the same facts in the
  form AUTOMATIC1111 writes and Civitai, SwarmUI and most image viewers read;
* the **journaled** record (``Job.provenance``, shown by ``GET /v1/jobs/{id}``) is the
  embedded one plus job id, load/run seconds, cold load, actual and predicted seconds,
  which the server adds when it stores the result.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from typing import Any

from app.core.digest import bytes_digest, hex_part
from app.core.kinds import spec
from app.core.protocol import Manifest

#: A1111's sampler names of diffusers' scheduler classes; another class is named as it is
A1111_SAMPLERS = {
    "EulerDiscreteScheduler": "Euler",
    "EulerAncestralDiscreteScheduler": "Euler a",
    "DPMSolverMultistepScheduler": "DPM++ 2M",
    "DPMSolverSinglestepScheduler": "DPM++ 2S",
    "DDIMScheduler": "DDIM",
    "PNDMScheduler": "PLMS",
    "LMSDiscreteScheduler": "LMS",
    "HeunDiscreteScheduler": "Heun",
    "KDPM2DiscreteScheduler": "DPM2",
    "KDPM2AncestralDiscreteScheduler": "DPM2 a",
    "UniPCMultistepScheduler": "UniPC",
    "LCMScheduler": "LCM",
    "DDPMScheduler": "DDPM",
    "FlowMatchEulerDiscreteScheduler": "Euler",
}


def embedded_provenance(
    *,
    model_id: str,
    manifest: Manifest,
    kind: str,
    params: dict[str, Any],
    inputs: dict[str, str],
    machine: str,
    device: str,
    adapters: list[dict[str, Any]] | None = None,
    sampler: str | None = None,
) -> dict[str, Any]:
    """The deterministic record embedded in the output file.

    ``manifest`` is the server's manifest the files were verified against (R5): its digests
    are copied as they are, so the record's ``model_files`` equal the manifest's exactly.
    ``inputs`` maps an input field to its digest (``{"image": "blake3:…"}``). ``adapters``: the
    job's LoRA adapters, each ``{"id", "scale", "files": {path: digest}}`` as their
    manifests give them (``tasks.adapters.provenance_entries``); the key is left out without any.
    ``sampler``: the class name of the pipeline's scheduler (left out when None).
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
    if sampler:
        record["sampler"] = sampler
    return record


def model_hash(record: Mapping[str, Any]) -> str:
    """A1111's ``Model hash`` (10 hex digits): of the single-file checkpoint the model was
    converted from (its blake3 digest), else the blake3 of its files' digests (JSON, sorted).
    Not A1111's own SHA-256 of a checkpoint: Homefleet hashes with blake3 (R5)."""
    source = record.get("source_digest")
    if source:
        return hex_part(str(source))[:10]
    files = json.dumps(record.get("model_files") or {}, sort_keys=True).encode()
    return hex_part(bytes_digest(files))[:10]


def adapter_hash(adapter: Mapping[str, Any]) -> str:
    """The 10 hex digits A1111's ``Lora hashes`` gives an adapter of the embedded record
    (``{"id", "scale", "files": {path: digest}}``): its one file's blake3 digest, else the blake3
    of its files' digests (JSON, sorted), as :func:`model_hash` does for a model."""
    files = adapter.get("files") or {}
    if len(files) == 1:
        return hex_part(str(next(iter(files.values()))))[:10]
    return hex_part(bytes_digest(json.dumps(files, sort_keys=True).encode()))[:10]


def a1111_parameters(record: Mapping[str, Any], size: tuple[int, int]) -> str:
    """The AUTOMATIC1111 ``parameters`` text of an image made with the embedded ``record``,
    ``size`` its (width, height) in pixels (an edit's ``Image CFG scale`` follows ``CFG scale``)::

        <prompt>[ <lora:ID:SCALE>...]
        Negative prompt: <negative prompt>          (left out when there is none)
        Steps: N, Sampler: X, CFG scale: G, Seed: S, Size: WxH, Model hash: H, Model: NAME
        [, Denoising strength: D][, Lora hashes: "ID: H, ..."]     (one line)

    The job's LoRA adapters are written as A1111 users write them, one ``<lora:id:scale>`` tag
    each after the prompt, and listed with their hashes (:func:`adapter_hash`), so viewers that
    read this text (Civitai's, SwarmUI's) show them. Params the job did not set take its kind's
    defaults (app/core/kinds.py)."""
    params = record.get("params") or {}
    try:
        kind_spec = spec(str(record.get("kind")))

        def value(name: str) -> Any:
            return kind_spec.value(params, name)
    except KeyError:
        value = params.get  # type: ignore[assignment]
    adapters = [a for a in record.get("adapters") or () if isinstance(a, Mapping) and a.get("id")]
    tags = "".join(f" <lora:{a['id']}:{float(a.get('scale', 1.0)):g}>" for a in adapters)
    lines = [str(value("prompt") or "") + tags]
    if negative := value("negative_prompt"):
        lines.append(f"Negative prompt: {negative}")
    scheduler = str(record.get("sampler") or "")
    fields = [
        ("Steps", value("steps")),
        ("Sampler", A1111_SAMPLERS.get(scheduler, scheduler) or None),
        ("CFG scale", value("guidance_scale")),
        ("Image CFG scale", value("image_guidance_scale")),  # an instruct-pix2pix edit's, as A1111 names it
        ("Seed", record.get("seed")),
        ("Size", f"{size[0]}x{size[1]}"),
        ("Model hash", model_hash(record)),
        ("Model", record.get("model_id")),
        ("Denoising strength", params.get("strength")),
        ("Lora hashes", '"' + ", ".join(f"{a['id']}: {adapter_hash(a)}" for a in adapters) + '"' if adapters else None),
    ]
    lines.append(
        ", ".join(
            f"{name}: {shown:g}" if isinstance(shown, float) else f"{name}: {shown}"
            for name, shown in fields
            if shown is not None
        )
    )
    return "\n".join(lines)
