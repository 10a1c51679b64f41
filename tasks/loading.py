"""Making a model resident on this worker, one way for a job and for the start-up preload:
verify its files (R5), price its variant, load it by the residency policy (R15), publish the
warm set (R12).

R5: the claim (or the preload's manifest) carries the REGISTERED digests. A resident
model is reused only if it was verified against exactly these (its manifest key); otherwise
every file is hashed here, before anything is loaded, and a mismatch withdraws the model from
the machine's advertised set until it is synced again. The server's own worker checks the same
way: it reads the server's folder, and the registry never adopts a changed file's digest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from app.core.errors import IntegrityFailure
from app.core.pricing import loaded_bytes
from app.core.protocol import Manifest
from routing.placement import SERVER
from tasks import runtime
from tasks.verify import file_stats, model_problems

log = logging.getLogger("homefleet.worker")


@dataclass(frozen=True)
class Loaded:
    """A resident pipeline: ``load_s`` seconds its load took (0 when warm), ``cold`` when it was loaded now."""

    pipeline: Any
    load_s: float
    cold: bool


def check_files(rt: runtime.WorkerRuntime, manifest: Manifest) -> None:
    """Hash the local copy of the model against ``manifest`` unless it is resident under this
    very manifest and its files' (size, mtime_ns, inode) are as they were when they were
    hashed (R5); on any mismatch withdraw the model (R4). Every machine checks, the server's
    own worker too: it reads the server's folder, whose digests the registry never adopts
    (a changed file there is a mismatch like anywhere else). A resident model whose files'
    stat changed is dropped from the residency cache and checked like a cold load.

    Raises:
        IntegrityFailure: a file is missing or differs (reason ``integrity``); nothing is loaded.
    """
    settings = rt.settings
    model_id = manifest.model_id
    stats = file_stats(settings.models_dir, manifest)  # before hashing: a change meanwhile shows next time
    if rt.cache.is_warm(model_id, manifest.key()):
        if rt.verified_stats.get(model_id) == stats:
            return
        log.warning(
            "%s: resident model %s changed on disk since it was verified; dropped, verifying again",
            settings.machine,
            model_id,
        )
        rt.cache.drop(model_id)
        rt.record_warm()
    rt.verified_stats.pop(model_id, None)
    problems = model_problems(settings.models_dir, manifest)
    if problems:
        rt.withdraw(model_id)
        fix = (
            f"the server's own copy, which a sync copies from: restore the file, or take the new content with "
            f"`homefleet models update {model_id}`; `homefleet models verify {model_id}` names every changed file"
            if settings.machine == SERVER
            else f"withdrawn until its files match again or `homefleet sync {settings.machine} {model_id}`"
        )
        raise IntegrityFailure(
            f"model {model_id} on {settings.machine} does not match the manifest ({fix}): " + "; ".join(problems[:5])
        )
    rt.verified_stats[model_id] = stats


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
