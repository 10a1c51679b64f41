"""Every table of the journal's database, in one place: the schema that SQLModel's metadata (and
so Alembic's autogenerate, ``app/db/migrations``) knows. The modules that read and write them
(``app/journal``, ``app/store/registry.py``, ``app/fleet/residency_store.py``,
``app/fleet/pairing.py``) hold no table of their own.

Times are UTC; durations in seconds; sizes in bytes; a job's size is pixels x frames x batch.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index
from sqlmodel import Field, SQLModel

from app.core.states import JobState
from app.core.variants import Variant


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(UTC)


class Job(SQLModel, table=True):
    """One job, as journaled (R19)."""

    # A key's quota check (app/jobs/quotas.py) seeks its queued and running jobs, and its jobs ended
    # in the last hour, under the fleet lock: two ranges of these, however many jobs it has had.
    __table_args__ = (
        Index("ix_job_api_key_id_state", "api_key_id", "state"),
        Index("ix_job_api_key_id_finished_at", "api_key_id", "finished_at"),
    )

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, primary_key=True)
    state: JobState = Field(index=True)
    model_id: str
    kind: str
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    target: str  # what the client asked for: a machine name or "auto"
    machine: str | None = Field(default=None, index=True)  # where it was placed
    reason: str | None = None  # why it was rejected, failed or interrupted
    message: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    result_digest: str | None = None
    result_path: str | None = None
    result_media_type: str | None = None
    result_bytes: int | None = Field(default=None, sa_type=BigInteger)
    # Every result in order (n images per job), each {digest, path, media_type, bytes, seed};
    # the first is also result_*. None for a job stored before (its one result_*).
    results: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    requeued_from: str | None = None  # the job this one repeats (POST /v1/jobs/{id}/requeue)
    # Who submitted it (per-key quotas, webhook secrets): its API key's quota name, or "key:<12 hex>" of the
    # key's digest (app/core/limits.py key_id); never the key. None: open API, or a job from before.
    api_key_id: str | None = None
    load_s: float | None = None
    run_s: float | None = None
    cold_load: bool | None = None
    worker_boot_id: str | None = None  # boot id of the worker process that claimed it (reconciliation)
    claim_id: str | None = None  # the delivery that claimed it: lets that delivery repeat its claim safely
    idempotency_key: str | None = Field(default=None, unique=True)  # client's Idempotency-Key (R20)
    request_fingerprint: str | None = None  # digest of the submitted body, to tell a retry from a reuse
    # Placement's prediction at submission (R12, R13), shown beside the measured load_s/run_s.
    predicted_start_s: float | None = None  # seconds after submission until it starts
    predicted_load_s: float | None = None  # cold load expected (0 = warm)
    predicted_run_s: float | None = None
    # Memory estimate at submission (R10, R11): exact weights from the safetensors headers plus
    # working memory by kind and size from the fleet config's coefficients (bytes).
    weights_bytes: int | None = Field(default=None, sa_type=BigInteger)
    working_bytes: int | None = Field(default=None, sa_type=BigInteger)
    memory_estimate_bytes: int | None = Field(default=None, sa_type=BigInteger)
    # Provenance of the result: model files' digests, variant, kind, params, seed, inputs'
    # digests, machine, device, load/run seconds; reported by the worker, kept here.
    provenance: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # Where the job's record is POSTed when it ends (checked against the fleet file's
    # [webhooks] allow_hosts), signed with the secret of its api_key_id (webhook_secrets). None: no webhook.
    webhook_url: str | None = None


class WebhookDelivery(SQLModel, table=True):
    """One webhook to deliver: written with the job's terminal transition, in the
    same transaction (``app/journal/jobs.py``), then POSTed by the server's delivery loop
    (``app/jobs/webhooks.py``) until delivered or ``webhook_attempts`` are spent. The journal
    is the truth: a server restarted finds its pending deliveries here. Times in unix seconds."""

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    url: str
    job_state: str  # the ended state that made it
    state: str = Field(default="pending", index=True)  # pending | delivered | failed (gave up)
    attempts: int = 0  # POSTs made so far
    due_s: float = 0.0  # the next attempt is due at this time
    lease_s: float | None = None  # an attempt in flight until this time (a server killed mid-attempt: resumed after it)
    created_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    detail: str = ""  # the last attempt's outcome, e.g. "attempt 2: HTTP 500"


class JobEvent(SQLModel, table=True):
    """An append-only line of a job's history: created, claimed, claim_refused, succeeded…"""

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    at: datetime = Field(default_factory=utcnow)
    event: str
    detail: str = ""


class LearnedTiming(SQLModel, table=True):
    """Measured timing of (machine, model, kind) (R13): seconds for a cold load and per step at
    the reference size (1024 x 1024 pixels x 1 frame x batch 1)."""

    machine: str = Field(primary_key=True)
    model_id: str = Field(primary_key=True)
    kind: str = Field(primary_key=True)
    load_s: float
    step_s: float
    samples: int  # runs folded into step_s
    load_samples: int = Field(default=0)  # cold loads folded into load_s; 0: load_s is the guess
    prompt_s: float = Field(default=0.0)  # text kind: seconds per prompt token (step_s: per new token)
    size_exp: float = Field(default=1.0)  # run seconds grow with size ** size_exp (routing/timings.py)
    size_samples: int = Field(default=0)  # pairs of runs folded into size_exp; 0: still linear
    anchor_size: int = Field(default=0, sa_type=BigInteger)  # the last run's size (floored, as job_size); 0: none
    anchor_step_s: float = Field(default=0.0)  # its seconds per step, as measured at that size
    misses: int = Field(default=0)  # large misses in a row, signed (routing/timings.py SHIFT_RATIO)
    small_step_s: float = Field(default=0.0)  # seconds a step of one image under 256x256; 0: none measured
    updated_at: datetime = Field(default_factory=utcnow)


class ModelRecord(SQLModel, table=True):
    """A registered model (R1). ``total_bytes`` sums every file of the model."""

    id: str = Field(primary_key=True)
    family: str
    kinds: list[str] = Field(sa_column=Column(JSON, nullable=False))
    pipeline_class: str
    total_bytes: int = Field(sa_type=BigInteger)
    created_at: datetime = Field(default_factory=utcnow)
    precision: str = "fp32"  # fp32 | bf16 | fp16: the dtype every component is loaded with (app/core/variants.py)
    quantization: str | None = None  # e.g. torchao-int8wo: the denoiser quantized at load time
    # Bytes the loaded variant holds (every component at its real dtype, a quantized denoiser at its
    # quantized bytes), priced once at registration from the files taken (app/store/pricing.py); None
    # for a model registered before it was kept, priced from its files when first asked.
    weights_bytes: int | None = Field(default=None, sa_type=BigInteger)
    # What it was registered from: "diffusers" (a folder), "hf-cache" (a Hugging Face cache snapshot),
    # "single-file" (a checkpoint converted at registration), "transformers", "lora-diffusers" or
    # "lora-kohya" (a LoRA file); None before this was kept.
    source_format: str | None = None
    # The digest of the file a single-file checkpoint or a LoRA file was registered from (provenance:
    # the converted folder's files have digests of their own); None for a folder.
    source_digest: str | None = None
    # For a Hugging Face cache snapshot ("hf-cache"): the repository (org/name) and the commit of
    # the snapshot registered (its folder's name), so a later download can be told apart; else None.
    source_repo: str | None = None
    source_revision: str | None = None
    # The model's own default job params ({param: value}), given at registration (`models add
    # --default`), checked against the param spec of its kinds (app/store/registry.py
    # check_defaults) and applied to a job that does not set the param; None: none.
    defaults: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # When `homefleet models retire` took it out of service (UTC); None: in service. A retired
    # record stays (its jobs name it, its id stays taken) but is listed, defaulted to, submitted
    # to, priced and advertised no more (app/store/registry.py Registry.retire).
    retired_at: datetime | None = None

    @property
    def variant(self) -> Variant:
        return Variant(self.precision, self.quantization)


class ModelFile(SQLModel, table=True):
    """One file of a model, relative to the model folder. The server caches its digest keyed
    by (size, mtime_ns, inode) because it owns the file (R5); any change forces a rehash."""

    model_id: str = Field(primary_key=True)
    path: str = Field(primary_key=True)
    size: int = Field(sa_type=BigInteger)  # bytes
    digest: str
    mtime_ns: int = Field(sa_type=BigInteger)
    inode: int = Field(sa_type=BigInteger)


class ResidencyCommitment(SQLModel, table=True):
    """One model a machine is committed to keep resident (R16)."""

    machine: str = Field(primary_key=True)
    model_id: str = Field(primary_key=True)


class RememberedOom(SQLModel, table=True):
    """The smallest size (pixels x frames x batch) of ``kind`` with ``model_id`` that ran out of
    memory on ``machine`` (R21); ``at_s`` in unix seconds."""

    machine: str = Field(primary_key=True)
    model_id: str = Field(primary_key=True)
    kind: str = Field(primary_key=True)
    size: int = Field(sa_type=BigInteger)
    job_id: str
    at_s: float


class MachineDrain(SQLModel, table=True):
    """A machine drained by ``homefleet drain`` or ``machines remove`` (nothing new is placed
    there): the durable copy of ``Keys.draining``, written back to Redis when Redis lost its data
    (app/fleet/drains.py); ``since_s`` in unix seconds."""

    machine: str = Field(primary_key=True)
    since_s: float


class JournalIdentity(SQLModel, table=True):
    """The one row naming this journal (written by migration ``b7c4e2f19a30``; app/fleet/pairing.py)."""

    id: str = Field(primary_key=True)  # 32 hex characters


__all__ = [
    "Job",
    "JobEvent",
    "JournalIdentity",
    "LearnedTiming",
    "MachineDrain",
    "ModelFile",
    "ModelRecord",
    "RememberedOom",
    "ResidencyCommitment",
    "WebhookDelivery",
    "utcnow",
]
