"""A real-HTTP fuzz run of the public API (R22, R24): schemathesis, with all its
checks, against ``homefleet serve`` and a real ``celery worker`` for machine ``server`` that
holds a verified tiny model of every kind (:data:`MODELS`: txt2img/img2img/inpaint, edit,
upscale, video, text), so that schema-valid bodies of every kind really queue and run. Its
stateful phase follows the OpenAPI links from a submission to the job, its events, its
result and its cancel.

The server runs with narrow limits (:data:`FUZZ_LIMITS`) so that every valid job is small;
the schema states those limits, as it states any. After the run, every job the journal
accepted must reach a terminal state (the worker drains the queue).

``homefleet fuzz`` (``make fuzz``) runs it; ``tests/fuzz`` runs a bounded one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from PIL import Image

from app.context import build_context
from app.core.config import Settings
from app.core.limits import DEFAULT_FAMILY, FamilyLimits
from app.core.secret_files import write_private
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.fuzz_hooks import INPUTS_ENV
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import free_port, start_redis_server
from app.devtools.tiny_models import make_tiny
from app.devtools.tiny_text import make_tiny_text
from app.fleet.config import Fleet, Machine
from routing.placement import SERVER

MODEL = "tiny-sd"
#: model id -> (family, kind it is built as): one of every kind the API runs (app/core/kinds.py)
MODELS: dict[str, tuple[str, str]] = {
    MODEL: ("sd1", "txt2img"),  # txt2img, img2img, inpaint
    "tiny-pix2pix": ("sd1-pix2pix", "edit"),
    "tiny-upscaler": ("sd-upscale", "upscale"),
    "tiny-animatediff": ("animatediff", "video"),
    "tiny-llama": ("llama", "text"),
}
FUZZ_LIMITS = FamilyLimits(max_pixels=64 * 64, max_steps=2, max_frames=2, max_batch=2, max_prompt_chars=64)
CHECKS = "all"
CONFIG = Path(__file__).resolve().parents[2] / "tests" / "fuzz" / "schemathesis.toml"
HOOKS = "app.devtools.fuzz_hooks"  # the check that reads a 422's reason (schema-valid bodies are accepted)
#: sides (px) of the input images uploaded before the run: within FUZZ_LIMITS for every image kind
#: (the upscaler's x4 output of 16 px is 64 x 64 = max_pixels), multiples of 8
INPUT_SIDES = (16, 32)
#: text in a schemathesis runtime error (its NDJSON NonFatalError: "TYPE: message") -> why it says
#: nothing about the server. Any other runtime error fails the run.
BENIGN_RUNTIME_ERRORS: dict[str, str] = {
    "SystemError: AST constructor recursion depth mismatch": "CPython 3.11's AST constructor raced in two of "
    "schemathesis' worker threads while hypothesis described a strategy (CPython gh-106905; "
    "app/devtools/fuzz_hooks.py serializes ast.parse against it): a crash of the client, before any request",
}


@dataclass
class FuzzReport:
    """What one run saw: cases sent, responses by status, schemathesis' failures and the
    journal's jobs by state afterwards (``unended``: accepted jobs not in a terminal state)."""

    cases: int = 0
    routes: Counter[str] = field(default_factory=Counter)  # "METHOD /path/{template}" -> cases sent to it
    operations: int = 0  # operations (method, path) in the OpenAPI document
    other_methods: int = 0  # cases of a method the document does not list for the path (405 probes)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: int = 0
    errors: int = 0  # schemathesis' runtime errors (not answers of the server): see ``output``
    runtime_errors: list[str] = field(default_factory=list)  # each: "TYPE: message (phase, operation)"
    exit_code: int = 0
    states: Counter[str] = field(default_factory=Counter)
    succeeded_kinds: Counter[str] = field(default_factory=Counter)  # jobs that ran and succeeded, by kind
    unended: list[str] = field(default_factory=list)
    output: str = ""

    @property
    def unknown_runtime_errors(self) -> list[str]:
        """schemathesis' runtime errors not in :data:`BENIGN_RUNTIME_ERRORS`."""
        return [error for error in self.runtime_errors if not any(known in error for known in BENIGN_RUNTIME_ERRORS)]

    @property
    def sound(self) -> bool:
        """schemathesis passed: it exited 0, or it exited 1 for runtime errors of its own that are
        all known-benign (:data:`BENIGN_RUNTIME_ERRORS`) with no failure. 5xx, failures, unended
        jobs and the route count are judged apart (``homefleet fuzz``)."""
        if self.exit_code == 0:
            return True
        return (
            self.exit_code == 1
            and self.failures == 0
            and len(self.runtime_errors) == self.errors > 0
            and not self.unknown_runtime_errors
        )

    @property
    def server_errors(self) -> int:
        """5xx answers other than the documented 503 (machine offline or syncing, R10)."""
        return sum(count for status, count in self.statuses.items() if status >= 500 and status != 503)

    def summary(self) -> str:
        return (
            f"fuzz: {self.cases} cases over {len(self.routes)} of {self.operations} routes (and {self.other_methods} "
            f"of undocumented methods), {self.server_errors} 5xx other than 503 "
            f"({self.statuses.get(503, 0)} documented 503), {self.failures} failures, {self.errors} runtime errors "
            f"({len(self.unknown_runtime_errors)} not known-benign), exit {self.exit_code}, "
            f"statuses {dict(sorted(self.statuses.items()))}; journal {dict(sorted(self.states.items()))}, "
            f"{len(self.unended)} accepted jobs not ended; "
            f"succeeded by kind {dict(sorted(self.succeeded_kinds.items()))}"
        )

    def route_lines(self) -> list[str]:
        """One line per route: its cases, the most first."""
        return [
            f"{count:6d}  {route}" for route, count in sorted(self.routes.items(), key=lambda item: (-item[1], item[0]))
        ]


def fuzz_fleet(data_dir: Path) -> tuple[Settings, Fleet]:
    """Settings and a one-machine fleet (``server``) for the fuzz run, under ``data_dir``."""
    fleet = Fleet(
        machines={
            SERVER: Machine(
                name=SERVER,
                backend="cpu",
                memory_kind="unified",
                memory_bytes=8_000_000_000,
                families=frozenset(family for family, _ in MODELS.values()),
                token=secrets.token_urlsafe(32),
            )
        }
    )
    settings = Settings(
        data_dir=data_dir,
        fleet_file=data_dir / "fleet.toml",
        api_port=free_port(),
        api_keys=[secrets.token_urlsafe(24)],
        limits={DEFAULT_FAMILY: FUZZ_LIMITS},
        images_wait_s=20,
        max_queued_per_machine=64,
        max_pending_total=64,
    )
    return settings, fleet


def build_models(out_dir: Path) -> dict[str, Path]:
    """The tiny folders of :data:`MODELS` under ``out_dir``: model id -> folder."""
    image_kinds = [kind for _, kind in MODELS.values() if kind != "text"]
    built = make_tiny(out_dir, kinds=image_kinds)
    text = make_tiny_text(out_dir, families=[family for family, kind in MODELS.values() if kind == "text"])
    return {model_id: text[family] if kind == "text" else built[kind] for model_id, (family, kind) in MODELS.items()}


def run_fuzz(
    data_dir: Path,
    max_examples: int,
    phases: str = "examples,coverage,fuzzing,stateful",
    extra_args: list[str] | None = None,
    drain_timeout_s: float = 1800.0,
    wait_s: int = 5,
    workers: int = 1,
    forkserver: bool = False,
) -> FuzzReport:
    """Run schemathesis against a fresh fleet under ``data_dir``; return what it saw.
    ``workers``: schemathesis' concurrent requests (``--workers``).
    ``forkserver``: fork the fleet's API and worker from this process's preloaded interpreter
    (app/devtools/forkserver.py; the test suite's way) instead of exec'ing them.
    ``max_examples``: per operation and phase (schemathesis' ``--max-examples``).
    ``wait_s``: each request's ``Prefer: wait`` (seconds): how long an image or text route waits
    for its job before answering 409 ``job_pending`` (C10).
    ``drain_timeout_s``: how long the worker may take to end the accepted jobs afterwards (the
    stateful phase queues dozens; on a loaded 2-core host a tiny 4-step job took ~20 s)."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    redis = start_redis_server(data_dir / "redis")
    settings, fleet = fuzz_fleet(data_dir)
    settings = settings.model_copy(update={"redis_url": redis.url})
    write_private(settings.fleet_file, fleet.to_toml())  # type: ignore[arg-type]
    ctx = build_context(settings, fleet, migrate=True)
    local = LocalFleet(settings, fleet, settings.fleet_file, forkserver=forkserver)  # type: ignore[arg-type]
    report = FuzzReport()
    try:
        for model_id, folder in build_models(data_dir / "tiny").items():
            ctx.registry.add(folder, model_id=model_id)
        local.start_api()
        local.start_worker(SERVER)
        for model_id in MODELS:
            local.wait_online([SERVER], model_id=model_id, timeout_s=300)
        inputs = upload_inputs(local, data_dir / "inputs")
        report = schemathesis_run(local, max_examples, phases, data_dir, extra_args or [], wait_s, workers, inputs)
        report.unended = drain(ctx, drain_timeout_s)
        jobs = ctx.journal.list()
        report.states = Counter(str(job.state) for job in jobs)
        report.succeeded_kinds = Counter(job.kind for job in jobs if job.state == JobState.succeeded)
    finally:
        local.stop()
        ctx.close()
        redis.stop()
    return report


def upload_inputs(local: LocalFleet, out_dir: Path) -> dict[str, object]:
    """Upload an image and its mask of each side in :data:`INPUT_SIDES` (``POST /v1/files``), for
    the hooks to name in edit, img2img, inpaint and upscale bodies (app/devtools/fuzz_hooks.py,
    ``INPUTS_ENV``): ``{"pairs": [[image id, mask id], ...], "png": path of the first image}``.
    Raises ``httpx.HTTPStatusError`` when an upload is refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {local.settings.api_keys[0]}"}
    pairs: list[list[str]] = []
    paths: list[Path] = []
    for side in INPUT_SIDES:
        ids = []
        for name, image in (
            (f"image-{side}.png", Image.new("RGB", (side, side), (200, 80, 40))),
            (f"mask-{side}.png", Image.new("L", (side, side), 255)),
        ):
            path = out_dir / name
            image.save(path)
            paths.append(path)
            answer = httpx.post(
                f"{local.api_url}/v1/files",
                headers=headers,
                timeout=60,
                verify=tls_context(),
                files={"file": (name, path.read_bytes(), "image/png")},
            )
            answer.raise_for_status()
            ids.append(answer.json()["id"])
        pairs.append(ids)
    return {"pairs": pairs, "png": str(paths[0])}


def schemathesis_run(
    local: LocalFleet,
    max_examples: int,
    phases: str,
    data_dir: Path,
    extra_args: list[str],
    wait_s: int = 5,
    workers: int = 1,
    inputs: dict[str, object] | None = None,
) -> FuzzReport:
    """``schemathesis run`` over real HTTP, with every check; the statuses from its NDJSON report.
    ``inputs``: uploaded inputs for the hooks (:func:`upload_inputs`)."""
    report_dir = data_dir / "schemathesis"
    key = local.settings.api_keys[0]
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file",
        str(CONFIG),
        "run",
        f"{local.api_url}/openapi.json",
        "--checks",
        CHECKS,
        "--phases",
        phases,
        "--max-examples",
        str(max_examples),
        "--workers",
        str(workers),
        "-H",
        f"Authorization: Bearer {key}",
        "-H",
        f"Prefer: wait={wait_s}",  # the image routes answer 409 job_pending after wait_s (C10), not images_wait_s
        "--seed",
        "1",
        "--report",
        "ndjson",
        "--report-dir",
        str(report_dir),
        "--no-color",
        "--suppress-health-check",
        "all",
        "--continue-on-failure",
        *extra_args,
    ]
    document = httpx.get(
        f"{local.api_url}/openapi.json", headers={"Authorization": f"Bearer {key}"}, timeout=60, verify=tls_context()
    ).json()
    documented = {
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post", "put", "delete", "patch")
    }
    root = str(Path(__file__).resolve().parents[2])  # where app.devtools.fuzz_hooks is imported from
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": HOOKS,
        INPUTS_ENV: json.dumps(inputs or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=7200, env=env)
    report = FuzzReport(exit_code=done.returncode, output=done.stdout[-20000:] + done.stderr[-5000:])
    for path in report_dir.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if "NonFatalError" in event:
                error = event["NonFatalError"]
                value = error.get("value", {})
                report.runtime_errors.append(
                    f"{value.get('type')}: {value.get('message')} ({error.get('phase')}, {error.get('label')})"
                )
            for status in re.findall(r'"status_code": ?(\d{3})', json.dumps(event)):
                report.statuses[int(status)] += 1
            for case in event.get("ScenarioFinished", {}).get("recorder", {}).get("cases", {}).values():
                route = f"{case['value']['method'].upper()} {case['value']['path']}"
                if route in documented:
                    report.routes[route] += 1
                else:
                    report.other_methods += 1
    report.operations = len(documented)
    generated = re.search(r"(\d+) generated", done.stdout)
    report.cases = int(generated.group(1)) if generated else sum(report.statuses.values())
    failed = re.search(r"(\d+) (?:unique )?failures?", done.stdout)
    errored = re.search(r"(\d+) errors?(?:,| in )", done.stdout)  # schemathesis' own runtime errors
    report.errors = int(errored.group(1)) if errored else 0
    report.failures = int(failed.group(1)) if failed else (0 if done.returncode == 0 or report.errors else -1)
    return report


def drain(ctx: object, timeout_s: float) -> list[str]:
    """Wait until every accepted job has ended; return the ids of those that did not."""
    journal = ctx.journal  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while True:
        unended = [job.id for job in journal.list([JobState.queued, JobState.running])]
        if not unended or time.monotonic() > deadline:
            return unended
        time.sleep(0.5)
