"""Making a model resident on this worker, one way for a job and for the start-up preload:
verify its files (R5), price its variant, load it by the residency policy (R15), publish the
warm set (R12).

R5: the claim (or the preload's manifest) carries the server's CURRENT digests. A resident
model is reused only if it was verified against exactly these (its manifest key); otherwise
every file is hashed here, before anything is loaded, and a mismatch withdraws the model from
the machine's advertised set until it is synced again. The server's own worker reads the
server's own files, which the server hashes itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from app.core.errors import IntegrityFailure
from app.core.protocol import Manifest
from app.core.pricing import loaded_bytes
from routing.placement import SERVER
from tasks import runtime
from tasks.verify import model_problems

log = logging.getLogger("homefleet.worker")


@dataclass(frozen=True)
class Loaded:
    """A resident pipeline: ``load_s`` seconds its load took (0 when warm), ``cold`` when it was loaded now."""

    pipeline: Any
    load_s: float
    cold: bool


def check_files(rt: runtime.WorkerRuntime, manifest: Manifest) -> None:
    """Hash the local copy of the model against ``manifest`` unless it is resident under this
    very manifest (R5); on any mismatch withdraw the model (R4).

    Raises:
        IntegrityFailure: a file is missing or differs (reason ``integrity``); nothing is loaded.
    """
    settings = rt.settings
    if settings.machine == SERVER or rt.cache.is_warm(manifest.model_id, manifest.key()):
        return
    problems = model_problems(settings.models_dir, manifest)
    if problems:
        rt.withdraw(manifest.model_id)
        raise IntegrityFailure(f"model {manifest.model_id} on {settings.machine} does not match the manifest "
                               f"(withdrawn until `homefleet sync {settings.machine} {manifest.model_id}`): "
                               + "; ".join(problems[:5]))


def make_resident(rt: runtime.WorkerRuntime, manifest: Manifest, working_bytes: int = 0) -> Loaded:
    """The model's pipeline, verified (:func:`check_files`) and resident by the policy; the
    warm set is published after a cold load. ``working_bytes``: the job's working memory
    beyond the weights (bytes; 0 for a preload), which the policy makes room for.

    Raises:
        IntegrityFailure: the local files do not match the manifest (the model is withdrawn).
        residency.errors.ResidencyRefused: only evicting a protected model would make room.
        OSError: a file cannot be read.
    """
    check_files(rt, manifest)
    folder = rt.settings.models_dir / manifest.model_id
    weights = manifest.weights_bytes  # R15: the server's price of the variant (app.core.pricing)
    if weights is None:  # an older server's manifest: the same function on the same (verified) files
        weights = loaded_bytes(folder, manifest.variant)
    variant = {"precision": manifest.precision, "quantization": manifest.quantization}
    pipeline, load_s, cold = rt.cache.get(manifest.model_id, manifest.key(), folder, variant, weights, working_bytes)
    if cold:
        rt.record_warm()
    return Loaded(pipeline, load_s, cold)
