"""``homefleet demo``: the fleet on this one host, real pipelines, real results.

Uses the Redis at the configured URL if one answers, else an embedded one; starts the API,
the ``server`` worker and two more machines (each its own worker process, model folder
and token); registers the models and copies them to each machine; submits jobs to
``server``, to named machines and to ``auto`` -- one of each kind (txt2img, edit, upscale,
video; the edit and upscale inputs are uploaded first); shows progress; prints each result's
path, media type, digest, machine, seed and seconds; stops everything it started.

The txt2img jobs run the two trained demo models (``app/devtools/demo_models``,
trained by ``homefleet models train-shapes``): ``shapes-filled`` paints solid shapes,
``shapes-outlined`` their edges, so each picture shows what was asked and which model drew
it. Beside each such result the demo prints what was asked and what the picture shows (its
dominant colour, shape and style, read from its pixels: :func:`app.devtools.shapes.inspect`).
The other kinds run tiny random-weight pipelines (their pictures are noise).
"""

from __future__ import annotations

import io
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from app.client import HomefleetClient
from app.context import build_context
from app.core.config import Settings
from app.core.connections import redacted_url
from app.core.errors import ConfigError, NotFound
from app.core.secret_files import write_private
from app.core.states import ENDED
from app.devtools.localfleet import LocalFleet
from app.devtools.redis_server import (
    RedisProcess,
    free_port,
    redis_answers,
    start_redis_server,
)
from app.devtools.shapes import caption, draw, inspect_png
from app.devtools.tiny_models import make_tiny
from app.devtools.train_recolour import EDIT_SAMPLING, RECOLOUR_MODEL
from app.devtools.train_shapes import DEMO_MODELS_DIR, MODEL_NAMES, SAMPLING
from app.fleet.config import load_fleet, with_fresh_tokens
from app.fleet.pairing import unpair
from app.journal.jobs import Journal
from routing.placement import SERVER

#: kind -> the demo's tiny random-weight model for it (app/devtools/tiny_models.py)
TINY_DEMO_MODELS = {"upscale": "tiny-upscaler", "video": "tiny-animatediff"}
FILLED, OUTLINED = MODEL_NAMES["filled"], MODEL_NAMES["outlined"]
#: the trained models (txt2img: filled, outlined; edit: recolour): model id -> its committed folder
SHAPE_MODELS = {name: DEMO_MODELS_DIR / name for name in (FILLED, OUTLINED, RECOLOUR_MODEL)}
#: the trained models' own defaults (``models add --default``): the guidance they were tuned at and,
#: for the txt2img two, the 32 x 32 pixels they were trained on; applied to a job that does not set them
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {name: {"guidance_scale": 4.0} for name in SHAPE_MODELS} | {
    name: {"guidance_scale": 4.0, "width": 32, "height": 32} for name in (FILLED, OUTLINED)
}
#: every model the demo registers. No prompt expansion (params.expand_prompt): no trained text
#: model ships with the demo, and a random-weight one writes noise ("····") into the prompt.
DEMO_MODELS = (*SHAPE_MODELS, *TINY_DEMO_MODELS.values())


@dataclass(frozen=True)
class DemoJob:
    target: str
    kind: str
    params: dict[str, Any]
    model: str = ""  # "" = the kind's tiny model
    input_pixels: tuple[int, int] | None = None  # (width, height) of an uploaded gradient input image
    input_shape: tuple[str, str, str] | None = None  # or (colour, shape, background) of a drawn filled one
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return self.model or TINY_DEMO_MODELS[self.kind]


def _shapes(target: str, model: str, prompt: str, seed: int) -> DemoJob:
    sampling = {name: value for name, value in SAMPLING.items() if name != "guidance_scale"}  # the model's default
    return DemoJob(target, "txt2img", {"prompt": prompt, "seed": seed, **sampling}, model=model)


# Seeds that draw the prompt (a seed changes the picture, not whether a model can draw it: the
# filled model's squares come out rounded whatever the seed, docs/benchmarks.md)
DEMO_JOBS = (
    _shapes(SERVER, FILLED, "a red circle on a black background", 1),
    _shapes(SERVER, OUTLINED, "a blue square on a white background", 3),
    _shapes("box1", FILLED, "a yellow triangle on a gray background", 1),
    _shapes("box1", OUTLINED, "a green circle on a black background", 1),
    _shapes("box2", FILLED, "a purple circle on a white background", 1),
    _shapes("auto", OUTLINED, "a blue triangle on a gray background", 4),
    DemoJob(
        "box1",
        "edit",
        {"prompt": "make it blue", "seed": 1, **EDIT_SAMPLING},
        model=RECOLOUR_MODEL,
        input_shape=("red", "circle", "black"),
    ),
    DemoJob("box2", "upscale", {"prompt": "a sharp photo", "steps": 4}, input_pixels=(16, 16)),
    DemoJob("auto", "video", {"prompt": "a paper boat on waves", "steps": 4, "frames": 8, "fps": 8}),
)


def shape_input(colour: str, shape: str, background: str) -> bytes:
    """A PNG of a filled shape as the models were trained on (``app.devtools.shapes.draw``)."""
    buffer = io.BytesIO()
    draw(colour, shape, background, "filled").save(buffer, format="PNG")
    return buffer.getvalue()


def demo_input(width: int, height: int) -> bytes:
    """A gradient PNG of width x height pixels to upload as an edit/upscale input."""
    from PIL import Image

    image = Image.new("RGB", (width, height))
    image.putdata([(x * 255 // width, y * 255 // height, 140) for y in range(height) for x in range(width)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def run_demo(data_dir: Path, redis_url: str | None, console: Console, api_port: int | None = None) -> int:
    """Run the demo; return 0 when every job succeeded, else 1. ``redis_url``: a Redis to use
    when it answers; None (or no answer): an embedded one of its own under ``data_dir``, so
    the demo writes nothing into a Redis it was not pointed at. ``api_port``: the port its API
    listens on (the caller has checked it is free); None: a free one."""
    data_dir = data_dir.resolve()
    embedded: RedisProcess | None = None
    if redis_url is not None and redis_answers(redis_url):
        console.print(f"Redis: using {redacted_url(redis_url)}")
    else:
        embedded = start_redis_server(data_dir / "redis", password=secrets.token_urlsafe(24))  # requirepass
        why = "nothing answered at HOMEFLEET_REDIS_URL" if redis_url is not None else "its own"
        redis_url = embedded.url
        console.print(f"Redis: {why}; started an embedded one at {redacted_url(redis_url)} (with a password)")

    fleet = with_fresh_tokens(load_fleet(None))
    fleet_file = data_dir / "fleet.toml"
    data_dir.mkdir(parents=True, exist_ok=True)
    write_private(fleet_file, fleet.to_toml())
    api_key = secrets.token_urlsafe(24)
    settings = Settings(
        data_dir=data_dir,
        redis_url=redis_url,
        fleet_file=fleet_file,
        api_port=api_port or free_port(),
        api_keys=[api_key],
    )
    ctx = build_context(settings, fleet, migrate=True)  # the demo runs a server: it creates its journal
    local = LocalFleet(settings, fleet, fleet_file)
    journal: str | None = None
    borrowed = False  # an external Redis that this run pairs with the demo's journal
    try:
        borrowed = embedded is None and ctx.redis.get(ctx.keys.journal()) is None
        try:  # never take over the Redis of another journal: a fleet's, or an earlier demo's (app/fleet/pairing.py)
            journal = ctx.pairing.check()
        except ConfigError as error:
            raise ConfigError(
                f"the Redis at {redacted_url(redis_url)} runs with another journal than the demo's "
                f"({settings.journal_url}); unset HOMEFLEET_REDIS_URL and the demo starts a Redis of its "
                "own",
                reason=error.reason,
            ) from error
        with console.status("Building the tiny models and registering them with the trained ones…"):
            built = make_tiny(data_dir / "tiny", kinds=tuple(TINY_DEMO_MODELS))
            folders = {**SHAPE_MODELS, **{model_id: built[kind] for kind, model_id in TINY_DEMO_MODELS.items()}}
            for model_id, folder in folders.items():
                try:
                    ctx.registry.get(model_id)
                except NotFound:
                    ctx.registry.add(folder, model_id=model_id, defaults=MODEL_DEFAULTS.get(model_id))
                for machine in fleet.machines:
                    if ctx.registry.get(model_id).family in fleet.machines[machine].families:
                        local.copy_model(model_id, machine)
        with console.status("Starting the API and one worker per machine…"):
            local.start_api()
            for machine in fleet.machines:
                local.start_worker(machine)
            for model_id in DEMO_MODELS:
                family = ctx.registry.get(model_id).family
                local.wait_online(
                    [name for name, machine in fleet.machines.items() if family in machine.families], model_id=model_id
                )
        console.print(f"API at {local.api_url}; machines online: {', '.join(fleet.machines)}")
        console.print(f"API key of this demo: {api_key}")
        console.print(f"send: Authorization: Bearer {api_key}", soft_wrap=True)  # one line, for copy and paste
        with HomefleetClient(local.api_url, api_key=api_key) as client:
            jobs = _run_jobs(client, console)
        return _report(jobs, ctx.journal, console, data_dir)
    finally:
        with console.status("Stopping everything the demo started…"):
            local.stop()
            if borrowed and journal is not None and unpair(ctx.redis, ctx.keys, journal):
                console.print(
                    f"Redis {redacted_url(redis_url)}: the demo's journal is no longer recorded there; "
                    "a server of yours can use it as it found it"
                )
            ctx.close()
            if embedded is not None:
                embedded.stop()


def _run_jobs(client: HomefleetClient, console: Console) -> list[dict[str, Any]]:
    submitted = []
    for job in DEMO_JOBS:
        params = dict(job.params)
        if job.input_pixels is not None:
            uploaded = client.upload(demo_input(*job.input_pixels))
            params["image"] = uploaded["id"]
            console.print(
                f"uploaded a {job.input_pixels[0]}x{job.input_pixels[1]} input: {uploaded['id']}", soft_wrap=True
            )
        if job.input_shape is not None:
            uploaded = client.upload(shape_input(*job.input_shape))
            params["image"] = uploaded["id"]
            console.print(f"uploaded {caption(*job.input_shape)} (32x32): {uploaded['id']}", soft_wrap=True)
        accepted = client.submit(job.model_id, job.kind, params, target=job.target)
        submitted.append(accepted)
        console.print(
            f"submitted {accepted['id'][:8]} {job.kind:<7} {job.model_id:<16} target={job.target} -> "
            f"machine={accepted['machine']} position={accepted['position']}"
        )
    finished: dict[str, dict[str, Any]] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[state]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bars = {
            s["id"]: progress.add_task(f"{s['id'][:8]} on {s['machine']:<6}", total=1, state="queued")
            for s in submitted
        }
        deadline = time.monotonic() + 600
        while len(finished) < len(submitted) and time.monotonic() < deadline:
            for job_id, bar in bars.items():
                if job_id in finished:
                    continue
                seen = client.get(job_id)
                step = seen.get("progress") or {}
                if seen["state"] in ENDED:
                    finished[job_id] = seen
                    progress.update(bar, completed=1, total=1, state=seen["state"])
                elif step:
                    progress.update(bar, completed=step["step"], total=step["total"], state=seen["state"])
                else:
                    progress.update(bar, state=seen["state"])
            time.sleep(0.2)
    return [finished.get(s["id"]) or client.get(s["id"]) for s in submitted]


def asked_and_seen(job: dict[str, Any], png: bytes, on: tuple[str, str, str] | None = None) -> str:
    """``asked: "a red circle on a black background" (shapes-filled) -> shows: a red filled
    circle on black`` for a shapes model's result (its pixels read by :func:`inspect_png`);
    an edit's names its input (``on``: the drawn input's colour, shape, background)."""
    seen = inspect_png(png)
    if on is not None:
        return f'asked: "{job["params"]["prompt"]}" on {caption(*on)} ({job["model"]}) -> shows: ' + (
            f"a {seen.colour} {seen.style} {seen.shape} on {seen.background}"
            if seen.colour
            else f"no coloured shape (on {seen.background})"
        )
    shows = (
        f"a {seen.colour} {seen.style} {seen.shape} on {seen.background}"
        if seen.colour
        else f"no coloured shape (on {seen.background})"
    )
    return f'asked: "{printable(job["params"]["prompt"])}" ({job["model"]}) -> shows: {shows}'


def printable(text: str) -> str:
    """``text`` with each unprintable character (a random-weight model's output has them) as ``·``."""
    return "".join(char if char.isprintable() else "·" for char in text)


def contact_sheet(items: list[tuple[str, bytes]], scale: int = 4) -> bytes:
    """One PNG: each ``(label, png)`` picture enlarged ``scale`` times (nearest), its label (one
    or two lines) beneath it, side by side."""
    from PIL import Image, ImageDraw

    pictures = []
    for _, png in items:
        with Image.open(io.BytesIO(png)) as opened:
            pictures.append(
                opened.convert("RGB").resize((opened.width * scale, opened.height * scale), Image.Resampling.NEAREST)
            )
    cell = max(max(p.width for p in pictures), 200)
    height = max(p.height for p in pictures)
    sheet = Image.new("RGB", (cell * len(pictures), height + 34), "white")
    pen = ImageDraw.Draw(sheet)
    for index, ((label, _), picture) in enumerate(zip(items, pictures, strict=True)):
        sheet.paste(picture, (index * cell + (cell - picture.width) // 2, 0))
        pen.multiline_text((index * cell + 4, height + 4), label, fill="black")
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG")
    return buffer.getvalue()


def _report(jobs: list[dict[str, Any]], journal: Journal, console: Console, data_dir: Path) -> int:
    """Print one block per job; the path is read from the journal (the server's own storage).
    A shapes model's result also gets what was asked and what it shows; its PNG is copied,
    named by model and prompt, to ``data_dir/shapes/`` (the server's store names by digest)."""
    failed = 0
    drawn: list[tuple[str, bytes]] = []
    console.print("\nResults (verified and stored by the server, content-addressed):")
    for job, asked in zip(jobs, DEMO_JOBS, strict=True):
        result = job.get("result") or {}
        if job["state"] != "succeeded":
            failed += 1
            console.print(f"[red]{job['id']}[/] {job['state']} on {job['machine']}: {job['reason']}: {job['message']}")
            continue
        console.print(
            f"[green]{job['id']}[/] {job['kind']} machine={job['machine']} seed={job['seed']} "
            f"load_s={job['load_s']:.2f} run_s={job['run_s']:.2f}\n"
            f"  {result['media_type']} {result['size_bytes']} bytes, digest {result['digest']}\n"
            f"  path   {journal.get(job['id']).result_path}",
            soft_wrap=True,
        )
        if job["model"] in SHAPE_MODELS:
            png = Path(str(journal.get(job["id"]).result_path)).read_bytes()  # succeeded: it has a result
            console.print(f"  {asked_and_seen(job, png, asked.input_shape)}", soft_wrap=True)
            named = data_dir / "shapes" / f"{job['model']}--{asked.params['prompt'].replace(' ', '-')}.png"
            named.parent.mkdir(parents=True, exist_ok=True)
            named.write_bytes(png)
            label = asked.params["prompt"]
            drawn.append((f"{job['model'].removeprefix('shapes-')} on {job['machine']}\n{label}", png))
    if drawn:
        sheet = data_dir / "shapes" / "sheet.png"
        sheet.write_bytes(contact_sheet(drawn))
        console.print(f"the shapes results side by side, 4x: {sheet}", soft_wrap=True)
    console.print(f"{len(jobs) - failed} of {len(jobs)} jobs succeeded")
    return 1 if failed else 0
