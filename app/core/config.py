"""Settings, built once in an entry point (CLI, ``create_app``, worker start-up) and passed down.

Every field can be set from the environment with the ``HOMEFLEET_`` prefix, e.g.
``HOMEFLEET_REDIS_URL=redis://10.0.0.2:6379/0``. Nothing here connects to anything.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.limits import (
    KEY_NAME_PATTERN,
    FamilyLimits,
    KeyQuota,
    check_key_quotas,
    default_limits,
    key_id,
)

DEFAULT_API_PORT = 8787
"""The port ``homefleet serve`` listens on unless ``HOMEFLEET_API_PORT`` says otherwise."""


class BrokerSettings(BaseSettings):
    """What every process of the fleet (server, API, workers) must agree on.

    ``visibility_timeout_s`` must be the SAME everywhere: kombu restores unacked
    messages after the shortest timeout among its clients (docs/design.md, "Devices and queues").
    """

    model_config = SettingsConfigDict(env_prefix="HOMEFLEET_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    visibility_timeout_s: int = Field(3600, ge=1)
    key_prefix: str = "hf"
    # kombu's ``global_keyprefix``: put before every key of the broker's own structures (the
    # machines' queue lists, kombu's unacked hash and its bindings), e.g. ``"homefleet:"`` when
    # one Redis database serves several apps. "" (kombu's default): the queue of machine m1 is
    # the list ``machine.m1``. Every process (server, workers, the celery CLI, Flower) reads it
    # from here (app/core/celery_app.py); Homefleet reads the broker's keys through
    # ``app.core.keys.Keys``. Changing it strands the messages queued under the old one.
    broker_key_prefix: str = ""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    heartbeat_ttl_s: float = Field(6.0, gt=0)
    # The master's name that the Sentinels of a ``sentinel://h1:26379;sentinel://h2:26379/0`` redis_url
    # monitor (their ``sentinel monitor NAME ...``): the broker (kombu's Sentinel transport), the server's
    # own keys (redis-py's Sentinel.master_for) and every worker follow the master they name
    # (docs/operations.md, "Redis Sentinel"). Unused with a redis://, rediss:// or unix:// URL.
    redis_sentinel_master: str = ""

    @field_validator("broker_key_prefix")
    @classmethod
    def _printable_prefix(cls, value: str) -> str:
        if not value.isprintable() or any(c.isspace() for c in value) or len(value) > 64:
            raise ValueError(f"broker_key_prefix must be at most 64 printable characters without spaces, got {value!r}")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
            raise ValueError(f"redis_url must start with redis://, rediss://, unix:// or sentinel://, got {value!r}")
        if value.startswith("sentinel://") and any(not part.startswith("sentinel://") for part in value.split(";")):
            raise ValueError(
                f"redis_url with Sentinels names each as sentinel://host:port, separated by ';', got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _sentinel_master_named(self) -> BrokerSettings:
        if self.redis_url.startswith("sentinel://") and not self.redis_sentinel_master:
            raise ValueError(
                "redis_sentinel_master (HOMEFLEET_REDIS_SENTINEL_MASTER) must name the master the "
                "Sentinels of redis_url monitor (their `sentinel monitor NAME ...`)"
            )
        return self


class Settings(BrokerSettings):
    """The server's settings (API, journal, registry, storage).

    Paths are resolved against the working directory at start-up.
    """

    data_dir: Path = Path("var/homefleet")
    database_url: str | None = None  # default: sqlite:///<data_dir>/journal.db
    fleet_file: Path | None = None  # default: the fleet embedded in the package
    api_host: str = "127.0.0.1"
    api_port: int = Field(DEFAULT_API_PORT, ge=1, le=65535)
    max_result_bytes: int = Field(64 * 1024 * 1024, gt=0)
    max_input_bytes: int = Field(16 * 1024 * 1024, gt=0)  # one uploaded input file (POST /v1/files)
    max_request_bytes: int = Field(1024 * 1024, gt=0)  # a request body other than an upload (app/api/body_limit.py)
    max_concurrent_uploads: int = Field(4, ge=1)  # uploads in progress at once; one more is 429 (app/api/auth.py)
    fleet_lock_ttl_s: float = Field(10.0, gt=0)
    fleet_lock_wait_s: float = Field(5.0, gt=0)
    reconcile_interval_s: float = Field(5.0, gt=0)
    lost_grace_s: float = Field(10.0, ge=0)  # a queued job missing from Redis this long is `lost`
    # A running job cancelled by request stops between steps (its worker reads Keys.cancel); one
    # still running this many seconds after the request is ended `cancelled` and its pool
    # process killed (the watchdog's restart request, R19).
    cancel_grace_s: float = Field(10.0, gt=0)
    # A job predicted (placement's run seconds, R12) to run longer than this on every eligible
    # machine is refused 422 `job_too_long`: an hour-long job on a home fleet is a mistake more
    # often than a wish. The dry run shows the fastest prediction beside the limit.
    max_job_s: float = Field(3600.0, gt=0)
    hung_after_s: float = Field(900.0, gt=0)  # a running job without progress this long is `hung`
    idempotency_ttl_s: float = Field(24 * 3600, ge=24 * 3600)  # kept at least 24 h (R20)
    # Serving front (R22-R24). Limits per model family; families not listed use "default".
    limits: dict[str, FamilyLimits] = Field(default_factory=default_limits)
    max_queued_per_machine: int = Field(32, ge=1)  # R23: reserved jobs (queued + running) per machine
    max_pending_total: int = Field(256, ge=1)  # R23: reserved jobs in the whole fleet
    retry_after_s: int = Field(5, ge=1)  # the Retry-After of a 429, and of a 503 without its own (seconds)
    # Bearer API keys of the public routes. Empty: the server refuses to start unless
    # allow_open_api is set (then the routes are open and start-up says so).
    api_keys: list[str] = Field(default_factory=list)
    allow_open_api: bool = False
    # Per-key quotas, by name: the keys of api_keys that start with a quota's
    # key_prefix share its limits and are journaled under its name (app/core/limits.py
    # KeyQuota), e.g. '{"ci": {"key_prefix": "ci-", "max_queued_jobs": 3,
    # "max_gpu_seconds_per_hour": 600}}'. A key under no quota is unlimited.
    api_key_quotas: dict[str, KeyQuota] = Field(default_factory=dict)
    # How long the OpenAI/HF image routes wait for their jobs (seconds), at most. Well below the
    # OpenAI SDK's read timeout (openai.DEFAULT_TIMEOUT: 600 s); a client that announces a
    # shorter one (`x-stainless-read-timeout`, `Prefer: wait=N`) is answered before it gives up
    # (app/api/routes/images.py). When the wait ends the answer is 409 `job_pending` naming the
    # jobs, which keep running, with `x-should-retry: false` (R20, C10).
    images_wait_s: float = Field(480.0, gt=0)
    # On SIGTERM, how long `homefleet serve` lets requests in progress end (seconds) before it
    # cuts them and stops (uvicorn's timeout_graceful_shutdown): without it the server stayed up
    # minutes after SIGTERM, its port already closed, while workers could not claim or report. An
    # image or text call waiting for its jobs is answered at once, 503 server_stopping with
    # Retry-After (retry_after_s): the SDKs resend it then and get its first call's jobs from the
    # next server (C10); the jobs themselves run on.
    api_shutdown_grace_s: int = Field(5, ge=0)  # whole seconds, as uvicorn takes it
    # The server's address as clients reach it (e.g. "https://fleet.example", behind a proxy): the
    # image routes' result URLs and join commands start with it. None: http://api_host:api_port
    # (Settings.base_url). Never taken from the request's Host header, which the client chooses.
    public_base_url: str | None = Field(None, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$", max_length=2048)
    # A client's automatic retry of an image call (`x-stainless-retry-count` > 0) with the same
    # key, route and body within this many seconds gets the first call's jobs (app/jobs/calls.py).
    sdk_retry_window_s: float = Field(3600.0, gt=0)
    # How long a result URL of the image routes (response_format "url") opens without the API key,
    # in seconds after the answer (app/api/result_urls.py; OpenAI's last an hour too).
    result_url_ttl_s: float = Field(3600.0, gt=0)
    # R6: a sync's reservation on its machine expires this long after the worker's last
    # progress report, so a worker killed mid-copy frees its machine. The worker reports
    # every 0.5 s from claim to finish, from a thread of its own, also while it hashes a
    # large file (tasks/sync.py, Renewal and REPORT_EVERY_S).
    sync_reservation_ttl_s: float = Field(30.0, gt=0)
    # R6: until its worker claims it, a published sync's reservation lasts this long instead: a
    # worker that is starting (it verifies its model folder first) or slow to read its queue does
    # not turn the sync `interrupted` before it began. A worker that dies meanwhile is offline,
    # and placement skips an offline machine anyway.
    sync_claim_wait_s: float = Field(120.0, gt=0)
    # Webhooks (docs/api.md "Webhooks", docs/operations.md): the secret that signs the
    # webhooks of the jobs each API key submits, by key id (:meth:`api_key_id`: its quota's name,
    # which the keys of a quota share, else key:<12 hex>; `homefleet keys` lists them), e.g.
    # HOMEFLEET_WEBHOOK_SECRETS='{"key:3f2a9c01b4de": "<secret>"}'. A key without a secret cannot
    # name a webhook_url (422). The fleet file's [webhooks] allow_hosts says where a webhook may go.
    webhook_secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    # The retry schedule: a receiver down for hours still gets its webhook. The defaults pause
    # 5, 10, 20 … 2560 s, then 3600 s: 18 attempts over about 8.5 hours (app/jobs/webhooks.py ``schedule``).
    webhook_attempts: int = Field(18, ge=1, le=100)  # POSTs per delivery at most, the first included
    webhook_backoff_s: float = Field(5.0, ge=0)  # pause after the first failed attempt; doubled after each
    webhook_backoff_max_s: float = Field(3600.0, ge=0)  # the longest pause between two attempts
    webhook_timeout_s: float = Field(10.0, gt=0)  # one attempt's connect + read timeout
    webhook_poll_s: float = Field(2.0, gt=0)  # how often the delivery loop looks for deliveries made elsewhere
    webhook_concurrency: int = Field(4, ge=1)  # attempts in flight at once
    # Adding a machine (docs/operations.md, "Add a machine"): how long a join token of `homefleet
    # machines add` stays valid (seconds; single use), how often the server looks at the fleet
    # file's mtime (seconds; SIGHUP reloads at once), and the broker URL a joining worker is
    # handed (None: redis_url, which a host elsewhere cannot reach when it names 127.0.0.1).
    join_token_ttl_s: float = Field(900.0, ge=1)
    fleet_watch_s: float = Field(1.0, gt=0)
    worker_redis_url: str | None = None
    # Two or more `homefleet serve` on one PostgreSQL journal and one Redis (docs/operations.md,
    # "A standby server"): every one answers the API; the one holding PostgreSQL's advisory lock
    # leads (reconciliation, webhooks); the others try to take it every leader_poll_s seconds.
    leader_election: bool = False
    leader_poll_s: float = Field(1.0, gt=0)

    @field_validator("webhook_secrets")
    @classmethod
    def _webhook_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        for named, secret in value.items():
            if len(secret) < 16:
                raise ValueError(
                    f"webhook_secrets[{named!r}] is {len(secret)} characters; a webhook secret needs "
                    "at least 16 (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
                )
        return value

    @model_validator(mode="after")
    def _secrets_name_keys(self) -> Settings:
        ids = {self.api_key_id(key) for key in self.api_keys}
        for named in self.webhook_secrets:
            if named not in ids:
                raise ValueError(
                    f"webhook_secrets names key id {named!r}, which is the id of none of api_keys "
                    f"(their ids: {', '.join(sorted(ids)) or 'none: no API key configured'}); "
                    "`homefleet keys` lists them"
                )
        return self

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @model_validator(mode="after")
    def _leader_election_needs_postgresql(self) -> Settings:
        if self.leader_election and not self.journal_url.startswith("postgresql"):
            raise ValueError(
                "leader_election (two servers on one journal) needs a PostgreSQL journal "
                "(HOMEFLEET_DATABASE_URL=postgresql+psycopg://...): SQLite has no lock that a second "
                "server's process can wait on, and two servers writing one SQLite file would each "
                'reconcile and deliver webhooks; docs/operations.md, "A standby server"'
            )
        return self

    @field_validator("api_key_quotas")
    @classmethod
    def _quota_names(cls, value: dict[str, KeyQuota]) -> dict[str, KeyQuota]:
        for name in value:
            if not re.fullmatch(KEY_NAME_PATTERN, name):
                raise ValueError(
                    f"api_key_quotas: the name {name!r} must be 1-32 letters, digits, '_', '.' or '-', "
                    "starting with a letter or digit"
                )
        return value

    @model_validator(mode="after")
    def _quotas_apply(self) -> Settings:
        check_key_quotas(self.api_key_quotas, self.api_keys)
        return self

    def api_key_id(self, key: str) -> str:
        """The id the jobs of API key ``key`` are journaled under: its quota's name, else a short
        digest (``key:<12 hex>``); see :func:`app.core.limits.key_id`."""
        return key_id(self.api_key_quotas, key)

    @property
    def journal_url(self) -> str:
        """SQLAlchemy URL of the journal: ``database_url`` or a SQLite file in ``data_dir``."""
        # Escaped, not pasted: a URL's path is percent-decoded, so a "%" in the folder's name is written "%25"
        # (what SQLAlchemy's URL.create renders for the same path).
        return self.database_url or "sqlite:///" + quote(str(self.data_dir / "journal.db"), safe="/:~._-+ ")

    @property
    def base_url(self) -> str:
        """The server's address as clients and workers reach it, without a trailing slash:
        ``public_base_url``, else ``http://<api_host>:<api_port>`` with a wildcard host (0.0.0.0,
        ::) named by this host's fully qualified name. Never from a request's ``Host`` header,
        which the client chooses."""
        if self.public_base_url:
            return self.public_base_url.rstrip("/")
        host = self.api_host
        if host in ("0.0.0.0", "::", ""):  # every address of this host: name it as others reach it
            host = socket.getfqdn()
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.api_port}"

    @property
    def models_dir(self) -> Path:
        """The server's own model folder: ``<models_dir>/<model_id>/<file>``."""
        return self.data_dir / "models"

    @property
    def results_dir(self) -> Path:
        """Content-addressed result storage (R2)."""
        return self.data_dir / "results"

    @property
    def inputs_dir(self) -> Path:
        """Content-addressed uploaded inputs (images for edit and upscale)."""
        return self.data_dir / "inputs"


def split_server_urls(value: str) -> list[str]:
    """The URLs in ``HOMEFLEET_SERVER_URL``: one, or several comma-separated (standby servers).

    Raises:
        ValueError: none given, or one that is not an ``http://`` or ``https://`` URL.
    """
    urls = [url.strip().rstrip("/") for url in value.split(",") if url.strip()]
    if not urls:
        raise ValueError("HOMEFLEET_SERVER_URL names no server")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HOMEFLEET_SERVER_URL: {url!r} is not an http:// or https:// URL")
    return urls


WORKER_TOKEN_MIN_CHARS = 16
"""A machine token's least length, in characters: the fleet file refuses a machine with a shorter
one (``app.fleet.config.Fleet.require_tokens``), so a worker's can be no shorter; a token the
server makes is 32 random bytes, base64: 43 characters."""


def token_from_file(token_file: str | Path, token: str | None = None) -> str:
    """The machine token in ``token_file``: its text, stripped of surrounding white space (the
    worker's ``HOMEFLEET_WORKER_TOKEN_FILE``, ``homefleet worker --token-file``; checked by
    ``homefleet doctor`` the same way).

    Raises:
        ValueError: ``token`` (HOMEFLEET_WORKER_TOKEN) is set too, the file cannot be read
            (absent, a folder, no permission), or it holds fewer than ``WORKER_TOKEN_MIN_CHARS``
            characters, naming it.
    """
    if token:
        raise ValueError("set one of HOMEFLEET_WORKER_TOKEN and HOMEFLEET_WORKER_TOKEN_FILE (--token-file), not both")
    path = Path(token_file).expanduser()
    try:
        found = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) else "not text"
        raise ValueError(f"HOMEFLEET_WORKER_TOKEN_FILE {str(path)!r} cannot be read: {why}") from error
    if len(found) < WORKER_TOKEN_MIN_CHARS:
        raise ValueError(
            f"HOMEFLEET_WORKER_TOKEN_FILE {str(path)!r} holds {len(found)} characters, a machine token at least "
            f"{WORKER_TOKEN_MIN_CHARS} (`homefleet worker join` writes it)"
        )
    return found


def local_server_url(environ: Mapping[str, str]) -> str:
    """The URL of a server on this host: ``http://127.0.0.1:<port>``, the port the server's
    ``HOMEFLEET_API_PORT`` in ``environ`` names (:data:`DEFAULT_API_PORT` when unset or not a
    number). A worker, or ``homefleet doctor``, given no ``HOMEFLEET_SERVER_URL`` uses it: on the
    server's host both read the same environment."""
    port = environ.get("HOMEFLEET_API_PORT", "").strip()
    return f"http://127.0.0.1:{int(port) if port.isdigit() and 0 < int(port) < 65536 else DEFAULT_API_PORT}"


class WorkerSettings(BrokerSettings):
    """A worker's settings: its machine name, its own model folder, its token, the server's URL.

    A worker knows no other machine and no address but the server's (R3).
    """

    machine: str
    models_dir: Path
    # The machine's token: from HOMEFLEET_WORKER_TOKEN, or read from the file HOMEFLEET_WORKER_TOKEN_FILE
    # names (`homefleet worker --token-file`; e.g. a secret mounted by systemd or Docker): never
    # needed on a command line, where `ps` shows it to every user of the host.
    worker_token: str = Field(min_length=WORKER_TOKEN_MIN_CHARS)
    worker_token_file: Path | None = None
    # The server's URL; with standby servers (docs/operations.md, "A standby server"), every
    # server's, comma-separated: a call the current one does not answer goes to the next.
    server_url: str = Field(default_factory=lambda: local_server_url(os.environ))
    http_timeout_s: float = Field(60.0, gt=0)
    # how long idempotent calls wait out an unreachable server, or its 503 redis_down / journal_down,
    # and a pool process's own Redis commands a Redis outage (app/core/connections.py outage_retry)
    server_retry_s: float = Field(120.0, ge=0)
    # R6: cap on a sync's download rate (bytes per second), e.g. to spare a home network;
    # None = as fast as the link allows.
    sync_max_bytes_per_s: int | None = Field(None, gt=0)
    # R15: a cap on the memory the model cache may fill (bytes), instead of the device's free
    # memory; e.g. to share a machine, or in tests to force real eviction with tiny models.
    memory_cap_bytes: int | None = Field(None, gt=0)
    # Threads of torch's CPU thread pool in this worker's pool process; None: torch's default
    # (one per core). Several workers on one host (the demo, the tests, drills) each take a share
    # of its cores: on 2 cores, two workers of 2 threads each ran a tiny step 2.5x slower than
    # two of 1 thread (0.65 against 0.26 s; docs/benchmarks.md).
    torch_threads: int | None = Field(None, ge=1)
    # A result the server cannot store (507, 5xx) is kept in spool_dir (default: beside
    # models_dir, spool/) and its upload tried result_upload_attempts times, pausing
    # result_retry_s seconds, then twice as long each time; then the job fails result_not_stored
    # and `homefleet results recover` uploads the spooled file later. A running worker also
    # tries its spool every result_recover_interval_s seconds (tasks/spool.py SpoolRecovery).
    spool_dir: Path | None = None
    result_upload_attempts: int = Field(4, ge=1)
    result_retry_s: float = Field(1.0, ge=0)
    result_recover_interval_s: float = Field(30.0, gt=0)
    # A job terminated from Flower or `celery control terminate` (C11): its pool process is
    # SIGKILLed this many seconds after Celery's signal if it still lives (a SIGTERM caught, or
    # not acted on inside a long native step), so the machine takes its next job.
    terminate_kill_after_s: float = Field(3.0, gt=0)

    @property
    def server_urls(self) -> list[str]:
        """Every server this worker may talk to, in the order given by ``server_url``."""
        return split_server_urls(self.server_url)

    @field_validator("server_url")
    @classmethod
    def _server_urls(cls, value: str) -> str:
        split_server_urls(value)
        return value

    @property
    def result_spool(self) -> Path:
        """Where this worker keeps the results the server could not store."""
        return self.spool_dir or self.models_dir.parent / "spool"

    @field_validator("models_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @model_validator(mode="before")
    @classmethod
    def _token_from_file(cls, data: Any) -> Any:
        """``worker_token`` from ``worker_token_file`` (its text, stripped of surrounding white space)."""
        if not isinstance(data, dict) or not data.get("worker_token_file"):
            return data
        return {**data, "worker_token": token_from_file(data["worker_token_file"], data.get("worker_token"))}


OTHER_VARIABLES = frozenset(
    {
        "HOMEFLEET_API_KEY",  # `homefleet bench --api-key`
        "HOMEFLEET_TEST_POSTGRES",
        "HOMEFLEET_FUZZ_EXAMPLES",  # the test suite's (tests/conftest.py, tests/fuzz)
    }
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per ``HOMEFLEET_*`` variable in ``environ`` that names no setting of the server
    or a worker, with the closest setting: a misspelt variable is otherwise ignored silently
    (settings read the environment with ``extra="ignore"``, because the server and the workers
    share one environment but not one set of settings)."""
    known = {f"HOMEFLEET_{name.upper()}" for name in (*Settings.model_fields, *WorkerSettings.model_fields)}
    known |= OTHER_VARIABLES
    lines = []
    for name in sorted(v for v in environ if v.startswith("HOMEFLEET_") and v not in known):
        close = closest(name, sorted(known))
        lines.append(
            f"{name} is not a Homefleet setting; it is ignored"
            + (f" (did you mean {' or '.join(close)}?)" if close else "")
        )
    return lines


def closest(name: str, known: list[str]) -> list[str]:
    """The names of ``known`` closest to ``name`` (``difflib``'s ratio, at least 0.6): the
    closest and every one within 0.05 of its ratio (a character more or less on a name of ~20
    moves the ratio ~0.03), best first. ``HOMEFLEET_API_KEYZ`` is a typo of ``HOMEFLEET_API_KEY``
    as much as of ``HOMEFLEET_API_KEYS``: naming one only may name the wrong one."""
    ranked = difflib.get_close_matches(name, known, n=len(known))
    if not ranked:
        return []

    def ratio(other: str) -> float:
        return difflib.SequenceMatcher(None, name, other).ratio()

    best = ratio(ranked[0])
    return [other for other in ranked if ratio(other) >= best - 0.05]
