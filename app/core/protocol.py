"""The internal API's bodies (``/internal/v1``), typed once for both ends: the server answers
with these models and the worker parses its answers into them (``tasks/server_client.py``).

Sizes are bytes; times are seconds; digests are ``"<algorithm>:<64 hex>"`` (``app.core.digest``).
Unknown fields are ignored when parsing, so a newer server can add fields older workers skip.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from app.core.digest import ALGORITHM, bytes_digest
from app.core.request_body import RequestBody
from app.core.variants import Variant

REVOCATIONS_PER_REPORT = 100
"""At most this many job ids in one :class:`Revocations` report (a worker sends more in several)."""


class Body(RequestBody):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # "NaN" and "inf" are no numbers


class ManifestFile(Body):
    """One file of a model, relative to its folder (``/`` separators)."""

    path: str = Field(max_length=1024)
    size: int = Field(ge=0, description="bytes")
    digest: str = Field(max_length=80, description="full-content digest, e.g. 'blake3:<hex>'")


class Manifest(Body):
    """A registered model as workers check it (R4, R5): its family, kinds, variant and every
    file with its size and the server's current digest."""

    model_id: str
    family: str
    kinds: list[str]
    precision: str = "fp32"
    quantization: str | None = None
    algorithm: str = ALGORITHM
    files: list[ManifestFile]
    weights_bytes: int | None = Field(
        None,
        ge=0,
        description=(
            "bytes the loaded variant holds, priced once at registration (app.core.pricing); the worker's residency "
            "uses this figure, as placement does (R15)"
        ),
    )
    source_digest: str | None = Field(
        None,
        max_length=80,
        description=(
            "digest of the single-file checkpoint the folder was converted from at registration; None for a folder"
        ),
    )

    @property
    def variant(self) -> Variant:
        return Variant(self.precision, self.quantization)

    def key(self) -> str:
        """Digest of the file list and the variant: a resident pipeline is reused only under the
        same key (R5: a changed server file forces a verified reload; a bf16 copy is not the fp32
        one)."""
        body = {
            "files": [f.model_dump() for f in self.files],
            "precision": self.precision,
            "quantization": self.quantization,
        }
        return bytes_digest(json.dumps(body, sort_keys=True).encode())


class Manifests(Body):
    """``GET /internal/v1/manifest``: every registered model the server can hand out, and the
    families the asking machine's fleet entry supports (sorted; None from a server that does not
    say): the models a worker counts as the ones it runs (R4, ``tasks/verify.py``)."""

    models: dict[str, Manifest]
    families: list[str] | None = Field(
        default=None, description="the families the asking machine runs (its fleet entry), sorted"
    )


class AdapterClaim(Body):
    """One LoRA adapter of a claimed job: its manifest (the server's current digests,
    checked before it is loaded, R5) and its weight in ``set_adapters``."""

    manifest: Manifest
    scale: float


class Claim(Body):
    """``POST /internal/v1/jobs/{id}/claim`` (R19): what a worker needs to run the job it claimed;
    ``adapters``: its ``params.adapters`` in order, each with its manifest."""

    job_id: str
    model_id: str
    kind: str
    params: dict[str, Any]
    manifest: Manifest
    working_bytes: int | None = Field(None, description="the server's working-memory estimate (fleet config), bytes")
    adapters: list[AdapterClaim] = Field(default_factory=list)


class ProgressReport(Body):
    """``POST /internal/v1/jobs/{id}/progress``: steps done of ``total``; a text job also sends
    ``text``, the text generated so far, ``tokens``, the ids generated so far, and ``logprobs``,
    each one's natural-log probability (streamed to SSE clients as they grow; TGI's
    stream names each token's id and logprob)."""

    step: int = Field(ge=0)
    total: int = Field(ge=1)
    text: str | None = Field(None, max_length=4 * 1024 * 1024)
    tokens: list[int] | None = Field(None, max_length=1_000_000)
    logprobs: list[float] | None = Field(None, max_length=1_000_000)


class FailureReport(Body):
    """``POST /internal/v1/jobs/{id}/failure``: why a claimed job ended without a result."""

    reason: str = Field(min_length=1, max_length=64)
    message: str = Field(max_length=4000)
    load_s: float | None = None
    run_s: float | None = None


class Revocations(Body):
    """``POST /internal/v1/revocations`` (C11): job ids a worker's main process learned were
    revoked (Flower, ``celery control revoke``). ``terminated``: Celery killed the pool process
    running the job (revoke with terminate). ``announced``: Celery's worker already sent the
    task's ``task-revoked`` event (the message arrived revoked), so the server sends none."""

    job_ids: list[Annotated[str, Field(max_length=64)]] = Field(min_length=1, max_length=REVOCATIONS_PER_REPORT)
    terminated: bool = False
    announced: bool = False


class RevocationReceipt(Body):
    """The server's answer to :class:`Revocations`: the jobs it ended, job id -> new state
    (``cancelled``, ``interrupted``). Ids of other machines' jobs, unknown ids and jobs that
    had moved on are left out."""

    ended: dict[str, str]


class ResultReceipt(Body):
    """What the worker reads of the server's answer to a result upload (the job as stored)."""

    id: str
    state: str


class SyncGrant(Body):
    """``POST /internal/v1/syncs/{id}/claim`` (R6): the manifests of the models to copy."""

    sync_id: str
    models: dict[str, Manifest]


class JoinRequest(Body):
    """``POST /internal/v1/join`` (``homefleet worker join``): the joining host's device as it
    detected it (``backend`` cpu, cuda or mps; ``memory_bytes``: the device's total memory)."""

    backend: str = Field(max_length=8)
    memory_bytes: int = Field(ge=0)


class JoinGrant(Body):
    """The answer to a join: the machine's name, its own token (to be kept in a file readable by
    its owner only, never on a command line), what it was registered with, and the broker
    settings every process of the fleet must share (``app.core.config.BrokerSettings``)."""

    machine: str
    token: str = Field(repr=False)
    backend: str
    memory_bytes: int
    families: list[str]
    broker: dict[str, Any]


class SyncProgress(Body):
    """``POST /internal/v1/syncs/{id}/progress``: renews the sync's reservation (R6)."""

    files_done: int = Field(ge=0)
    bytes_done: int = Field(ge=0)
    bytes_kept: int = Field(0, ge=0)
    """Of ``bytes_done``, those not downloaded: files already present with their digest, and the
    part of a partial copy a resumed download starts after (a progress bar's rate leaves them out)."""
    file: str = Field("", max_length=1024)


SYNC_FILE_DONE: tuple[str, ...] = ("present", "copied", "replaced")
"""The outcomes of a sync's file that leave the manifest's bytes at its final name (tasks/sync.py):
already there, copied, or copied after the file of other content there was set aside (R6)."""


class SyncFileResult(Body):
    """One file's outcome in a sync: ``present`` | ``copied`` | ``replaced`` | ``conflict`` |
    ``digest_mismatch`` (:data:`SYNC_FILE_DONE`: the first three)."""

    model_id: str
    path: str
    status: str
    size_bytes: int
    message: str = ""


class SyncFinish(Body):
    """``POST /internal/v1/syncs/{id}/finish``: every file's outcome and the re-verified models (R4)."""

    succeeded: bool
    message: str = Field("", max_length=4000)
    results: list[SyncFileResult] = Field(default_factory=list, max_length=100_000)
    verified: list[str] = Field(default_factory=list)
