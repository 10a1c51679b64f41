"""Strict routing through the HTTP API on a real Redis and journal (R10–R14): every refusal
reason, Auto and its dry run, predicted vs measured times and learned timings."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.api.server import create_app
from app.context import ServerContext, build_context
from app.core.config import Settings
from app.core.digest import bytes_digest
from app.core.pricing import loaded_bytes
from app.core.safetensors import model_weight_bytes, safetensors_weight_bytes
from app.core.secret_files import write_private
from app.core.states import JobState
from app.core.variants import Variant
from app.fleet.config import Fleet, Machine, ModelGuess
from app.fleet.machines import StaticResidencyFacts
from routing.estimate import readable_bytes
from routing.timings import MIN_SCALED_SIZE
from tests.helpers import FAMILIES, bring_online, run_cli, write_safetensors

MODEL = "tiny-sd"
VIDEO = "tiny-video"
PIXELS = 64 * 64


def machine(
    name: str, *, memory_bytes: int = 4_000_000_000, families: frozenset[str] = FAMILIES, dedicated: bool = False
) -> Machine:
    return Machine(
        name=name,
        backend="cuda" if dedicated else "cpu",
        memory_kind="dedicated" if dedicated else "unified",
        memory_bytes=memory_bytes,
        families=families,
        token=f"token-{name}-".ljust(32, "x"),
    )


def cli_env(ctx: ServerContext, settings: Settings, tmp_path: Path) -> dict[str, str]:
    """The environment that points a `homefleet` command at this test's fleet, Redis and journal."""
    fleet_file = tmp_path / "fleet.toml"
    write_private(fleet_file, ctx.fleet.to_toml())
    env = {
        "HOMEFLEET_DATA_DIR": str(settings.data_dir),
        "HOMEFLEET_REDIS_URL": settings.redis_url,
        "HOMEFLEET_FLEET_FILE": str(fleet_file),
        "COLUMNS": "200",
    }
    if settings.database_url:
        env["HOMEFLEET_DATABASE_URL"] = settings.database_url
    return env


@pytest.fixture
def api(settings: Settings, tiny_models_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, ServerContext]]:
    fleet = Fleet(
        machines={
            m.name: m
            for m in [
                machine("server"),
                machine("m1"),
                machine("m2"),
                machine("off"),
                machine("small", memory_bytes=200_000_000),
                machine("nosd", families=frozenset({"sd-upscale"})),
                machine("gpu", dedicated=True),
                machine("resv"),
                machine("oomy"),
            ]
        }
    )
    ctx = build_context(settings, fleet, migrate=True)
    ctx.machines.residency = StaticResidencyFacts(
        committed={"gpu": frozenset({VIDEO}), "resv": frozenset({MODEL})},
        ooms={"oomy": {(MODEL, "txt2img"): PIXELS}},
    )
    ctx.registry.add(tiny_models_dir / MODEL, MODEL)
    ctx.registry.add(tiny_models_dir / "tiny-animatediff", VIDEO)
    both = {MODEL, VIDEO}
    for name in ("server", "m1", "m2", "small", "nosd", "gpu", "resv", "oomy"):
        bring_online(ctx, name, set() if name == "m1" else both)
    with TestClient(create_app(settings, ctx), headers={"Authorization": f"Bearer {settings.api_keys[0]}"}) as client:
        yield client, ctx


def nothing_enqueued(ctx: ServerContext) -> bool:
    return all(
        ctx.redis.llen(ctx.keys.queue_list(m)) == 0 and ctx.machines.reservations.count(m) == 0
        for m in ctx.fleet.machines
    )


REFUSALS = [
    ("nope", MODEL, 422, "unknown_machine"),
    ("off", MODEL, 503, "machine_unavailable"),
    ("m1", MODEL, 422, "model_not_verified"),
    ("nosd", MODEL, 422, "family_not_supported"),
    ("small", MODEL, 422, "too_large"),
    ("gpu", MODEL, 422, "residency_conflict"),
    ("resv", VIDEO, 422, "video_on_reserved_machine"),
    ("oomy", MODEL, 422, "remembered_oom"),
]


@pytest.mark.parametrize(("target", "model", "status", "reason"), REFUSALS, ids=[r[3] for r in REFUSALS])
def test_r10_explicit_target_refusals_through_the_api(
    api: tuple[TestClient, ServerContext], target: str, model: str, status: int, reason: str
) -> None:
    client, ctx = api
    kind = "video" if model == VIDEO else "txt2img"
    answer = client.post("/v1/jobs", json={"model": model, "kind": kind, "params": {"prompt": "x"}, "target": target})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["reason"] == reason and target in error["message"]
    assert error["param"] == "target", error  # the field whose machine was refused
    [journaled] = ctx.journal.list()
    assert (journaled.state, journaled.reason, journaled.machine) == (JobState.rejected, reason, None)
    assert nothing_enqueued(ctx)
    shown = client.get(f"/v1/jobs/{error['job_id']}").json()  # the refusal's journal entry, by the id in the 422/503
    assert (shown["id"], shown["state"], shown["reason"]) == (journaled.id, "rejected", reason)


def test_a_misspelt_request_field_is_refused_naming_it_not_ignored(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    typo = client.post("/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "targt": "m2"})
    assert typo.status_code == 422 and "targt" in typo.json()["error"]["message"]
    sync = client.post("/v1/machines/m2/sync", json={"modelz": [MODEL]})  # would have synced every model
    assert sync.status_code == 422 and "modelz" in sync.json()["error"]["message"]
    residency = client.put("/v1/machines/m2/residency", json={"model": [MODEL]})
    assert residency.status_code == 422 and "model" in residency.json()["error"]["message"]
    assert ctx.journal.list([JobState.queued]) == [] and not ctx.redis.exists(ctx.keys.syncing("m2"))


def test_r16_a_commitment_to_a_model_the_machine_cannot_hold_is_refused(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    refused = client.put("/v1/machines/nosd/residency", json={"models": [MODEL]})  # nosd runs sd-upscale only
    assert refused.status_code == 422 and refused.json()["error"]["reason"] == "family_not_supported"
    assert "'sd1'" in refused.json()["error"]["message"] and not ctx.redis.exists(ctx.keys.residency("nosd"))


def test_r10_pinned_offline_machine_errors_even_when_others_are_idle(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    answer = client.post(
        "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "off"}
    )
    assert answer.status_code == 503 and answer.json()["error"]["reason"] == "machine_unavailable"
    assert answer.headers["retry-after"] == str(ctx.settings.retry_after_s)  # temporary: say when to retry
    assert nothing_enqueued(ctx)  # not rerouted to an idle machine


def test_r11_auto_with_every_able_machine_offline_or_draining_is_a_503_to_retry(
    api: tuple[TestClient, ServerContext],
) -> None:
    # Every machine that could run the model is offline (its verified set kept) or drained: the
    # same temporary 503 with Retry-After a pinned target gets (R10), not a 422 no_machine.
    client, ctx = api
    ctx.redis.sadd(ctx.keys.verified("off"), MODEL)  # verified before it went offline
    for name in ("server", "m2", "resv"):
        ctx.redis.set(ctx.keys.draining(name), "1")
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "auto"}
    answer = client.post("/v1/jobs", json=body)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["reason"] == "machine_unavailable"  # the machines' reasons differ
    for named in ("off: machine_unavailable", "server: machine_draining", "m2: machine_draining"):
        assert named in error["message"]
    assert answer.headers["retry-after"] == str(ctx.settings.retry_after_s)
    assert nothing_enqueued(ctx)
    ctx.redis.delete(ctx.keys.verified("off"))  # none of the drained or offline ones could run it once back:
    for name in ("server", "m2", "resv"):
        ctx.redis.srem(ctx.keys.verified(name), MODEL)  # nothing to wait for, a 422 naming every reason
    refused = client.post("/v1/jobs", json=body)
    assert refused.status_code == 422 and refused.json()["error"]["reason"] == "no_machine", refused.text
    assert "retry-after" not in refused.headers


def test_r11_r12_dry_run_shows_every_machine_and_enqueues_nothing(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "auto"}
    answer = client.post("/v1/jobs?dry_run=true", json=body)
    assert answer.status_code == 200, answer.text
    decision = answer.json()
    rows = decision["machines"]
    assert set(rows) == set(ctx.fleet.machines)
    reasons = {name: row.get("reason") for name, row in rows.items() if not row["eligible"]}
    assert reasons == {
        "off": "machine_unavailable",
        "m1": "model_not_verified",
        "nosd": "family_not_supported",
        "small": "too_large",
        "gpu": "residency_conflict",
        "oomy": "remembered_oom",
    }
    assert {name for name, row in rows.items() if row["eligible"]} == {"server", "m2", "resv"}
    assert decision["machine"] in {"server", "m2", "resv"}
    assert all(rows[n]["run_s"] > 0 and rows[n]["cold_load_s"] > 0 for n in ("server", "m2", "resv"))
    assert ctx.journal.list() == [] and nothing_enqueued(ctx)


def test_r11_r12_the_dry_run_shows_every_machines_memory_figures_in_readable_units(
    api: tuple[TestClient, ServerContext],
) -> None:
    """Every machine, eligible or not, with the figures that decided: the model's weights as its
    variant loads (priced at registration), the job's working memory, what its warm models hold
    and its usable memory, in bytes and as text in MiB/GiB (never "0.0 GB" for a tiny model)."""
    client, ctx = api
    bring_online(ctx, "m2", {MODEL, VIDEO}, warm=(MODEL,))
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "x", "width": 64, "height": 64}, "target": "auto"}
    decision = client.post("/v1/jobs?dry_run=true", json=body).json()
    weights = ctx.registry.weights_bytes(MODEL)
    memory = ctx.dispatcher.costs.estimator().memory(MODEL, "txt2img", 64 * 64)
    assert weights == memory.weights_bytes and 4 * 2**20 < weights < 5 * 2**20  # the tiny fp32 pipeline: 4.5 MiB
    for name, row in decision["machines"].items():
        figures = row["memory"]
        assert (figures["weights_bytes"], figures["working_bytes"]) == (weights, memory.working_bytes), name
        usable = 200_000_000 if name == "small" else 4_000_000_000
        assert figures["usable_bytes"] == (usable if name != "off" else figures["usable_bytes"])
        assert figures["text"].startswith(f"weights {readable_bytes(weights)} + working "), name
        assert "0.0 GB" not in figures["text"] and "GB" not in row.get("message", ""), name
    m2 = decision["machines"]["m2"]["memory"]
    assert m2["warm_bytes"] == weights and f"warm models hold {readable_bytes(weights)}" in m2["text"]
    assert decision["machines"]["m2"]["eligible"] and not decision["machines"]["small"]["eligible"]
    assert decision["machines"]["small"]["memory"]["text"].endswith("; 191 MiB usable")
    assert decision["machines"]["server"]["memory"]["text"] == (
        f"weights {readable_bytes(weights)} + working {readable_bytes(memory.working_bytes)}; "
        "warm models hold 0 B; 3.7 GiB usable"
    )
    assert readable_bytes(weights) == "4.5 MiB"


def test_r11_r17_auto_skips_a_machine_holding_a_commitment_for_video(api: tuple[TestClient, ServerContext]) -> None:
    client, _ctx = api
    body = {"model": VIDEO, "kind": "video", "params": {"prompt": "x"}, "target": "auto"}
    rows = client.post("/v1/jobs?dry_run=true", json=body).json()["machines"]
    assert rows["resv"]["reason"] == "video_on_reserved_machine" and not rows["resv"]["eligible"]
    placed = {client.post("/v1/jobs", json=body).json()["machine"] for _ in range(4)}
    assert placed and "resv" not in placed and placed <= {"server", "m2", "small", "oomy"}


def test_r12_auto_picks_the_machine_with_the_model_warm_and_counts_reservations(
    api: tuple[TestClient, ServerContext],
) -> None:
    client, ctx = api
    bring_online(ctx, "m2", {MODEL, VIDEO}, warm=(MODEL,))
    body = {"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "auto"}
    first = client.post("/v1/jobs", json=body)
    assert first.status_code == 202, first.text
    assert first.json()["machine"] == "m2" and first.json()["position"] == 0
    assert first.json()["predicted_start_s"] == 0  # the expected start (docs/design.md): nothing ahead
    job = client.get(first.json()["url"]).json()
    assert job["predicted_load_s"] == 0 and job["predicted_run_s"] > 0 and job["predicted_start_s"] == 0
    assert ctx.machines.reservations.count("m2") == 1 == ctx.redis.llen(ctx.keys.queue_list("m2"))
    dry = client.post("/v1/jobs?dry_run=true", json=body).json()
    assert dry["machines"]["m2"]["queued"] == 1 and dry["machines"]["m2"]["work_ahead_s"] > 0
    second = client.post("/v1/jobs", json={**body, "target": "m2"}).json()  # behind the first
    assert second["position"] == 1 and second["predicted_start_s"] == pytest.approx(
        dry["machines"]["m2"]["work_ahead_s"], abs=1e-3
    )


def _claimed(
    client: TestClient, ctx: ServerContext, target: str = "m2", steps: int = 4, side: int | None = None
) -> tuple[dict, dict[str, str]]:
    """A job pinned to ``target`` (``side`` x ``side`` pixels, else the model's default size) and
    claimed by its worker: (the 202 body, the worker's auth header)."""
    params: dict[str, object] = {"prompt": "x", "steps": steps}
    if side is not None:
        params |= {"width": side, "height": side}
    accepted = client.post(
        "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": params, "target": target}
    ).json()
    token = {"Authorization": f"Bearer {ctx.fleet.machines[target].token}"}
    assert client.post(f"/internal/v1/jobs/{accepted['id']}/claim", headers=token).status_code == 200
    assert json.loads(ctx.redis.hget(ctx.keys.reservations(target), accepted["id"]))["started_at"] is not None
    return accepted, token


def _upload(client: TestClient, job_id: str, token: dict[str, str], *, load_s: float, run_s: float, cold: bool) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    form = {
        "digest": bytes_digest(buffer.getvalue()),
        "load_s": str(load_s),
        "run_s": str(run_s),
        "cold_load": str(cold).lower(),
    }
    done = client.post(
        f"/internal/v1/jobs/{job_id}/result",
        headers=token,
        data=form,
        files={"file": ("result", buffer.getvalue(), "image/png")},
    )
    assert done.status_code == 200, done.text


def test_r13_measured_times_are_learned_and_survive_a_restart(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    client, ctx = api
    accepted, token = _claimed(client, ctx, side=256)
    _upload(client, accepted["id"], token, load_s=0.5, run_s=2.0, cold=True)
    assert ctx.machines.reservations.count("m2") == 0  # released when the job ended
    shown = client.get(accepted["url"]).json()
    assert shown["state"] == "succeeded"
    assert (
        shown["predicted_run_s"] > 0 and shown["run_s"] == 2.0 and shown["load_s"] == 0.5
    )  # predicted beside measured
    thumbnail, token = _claimed(client, ctx, side=64)  # a small image: its own figure, a second a step
    _upload(client, thumbnail["id"], token, load_s=0.0, run_s=4 * 0.1, cold=False)
    restarted = build_context(settings, ctx.fleet, migrate=True)
    try:
        timing = restarted.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
    finally:
        restarted.close()
    assert timing.samples == 1  # the 256x256 run; the thumbnail taught its own figure
    assert timing.step_s == pytest.approx(2.0 / 4 * (1024 * 1024) / MIN_SCALED_SIZE)  # per step at 1024x1024
    assert timing.load_s == pytest.approx(0.5)  # the cold load, measured: replaces the guess
    assert timing.small_step_s == pytest.approx(0.1)


def test_r13_the_size_exponent_learned_from_two_sizes_survives_a_restart_and_prices_the_next_job(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    """A 256x256 run (0.5 s a step) and a 1024x1024 one (16x the pixels, 16^1.25 = 32x the
    seconds a step) teach the exponent 1.25, kept in the journal: a restarted server prices a
    512x512 job at 4^1.25 x the small one's step (linear pricing said 4x)."""
    client, ctx = api
    small, token = _claimed(client, ctx, side=256)
    _upload(client, small["id"], token, load_s=0.5, run_s=4 * 0.5, cold=True)
    large, token = _claimed(client, ctx, side=1024)
    _upload(client, large["id"], token, load_s=0.0, run_s=4 * 0.5 * 16**1.25, cold=False)
    restarted = build_context(settings, ctx.fleet, migrate=True)
    try:
        timing = restarted.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
        predicted = restarted.dispatcher.costs.estimator().run_s("m2", MODEL, "txt2img", 4, 512 * 512)
    finally:
        restarted.close()
    assert (timing.size_exp, timing.size_samples) == (pytest.approx(1.25), 1)
    assert (timing.anchor_size, timing.anchor_step_s) == (1024 * 1024, pytest.approx(0.5 * 16**1.25))
    assert predicted == pytest.approx(4 * 0.5 * 4**1.25)  # linear would say 4 x 0.5 x 4 = 8 s
    shown = client.post(
        "/v1/jobs",
        json={
            "model": MODEL,
            "kind": "txt2img",
            "target": "m2",
            "params": {"prompt": "x", "steps": 4, "width": 512, "height": 512},
        },
    ).json()
    predicted_here = client.get(shown["url"]).json()["predicted_run_s"]  # this server learned it live
    assert predicted_here == pytest.approx(4 * 0.5 * 4**1.25, rel=1e-3)


def test_r13_a_large_miss_is_kept_in_the_journal_and_the_next_one_replaces_the_figure(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    """A run 100x slower than learned is one large miss, stored with the timing (a restarted
    server reads it); the next such run makes the figure the measurement (SHIFT_RUNS in a
    row), where the moving average alone would have moved it by EMA_WEIGHT."""
    client, ctx = api
    for run_s in (2.0, 200.0):
        accepted, token = _claimed(client, ctx, side=256)
        _upload(client, accepted["id"], token, load_s=0.5, run_s=run_s, cold=run_s == 2.0)
    restarted = build_context(settings, ctx.fleet, migrate=True)
    try:
        after_one = restarted.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
    finally:
        restarted.close()
    assert after_one.misses == 1 and after_one.samples == 2
    assert after_one.step_s == pytest.approx((0.7 * 2.0 + 0.3 * 200.0) / 4 * (1024 * 1024) / MIN_SCALED_SIZE)
    accepted, token = _claimed(client, ctx, side=256)
    _upload(client, accepted["id"], token, load_s=0.0, run_s=200.0, cold=False)
    after_two = ctx.dispatcher.timings.load().get("m2", MODEL, "txt2img")
    assert after_two is not None and after_two.misses == 0 and after_two.samples == 3
    assert after_two.step_s == pytest.approx(200.0 / 4 * (1024 * 1024) / MIN_SCALED_SIZE)


def test_r13_timings_forget_prices_a_repaired_machine_by_its_guess_again(
    api: tuple[TestClient, ServerContext], settings: Settings, tmp_path: Path
) -> None:
    """Two runs 100x slow replace m2's figure (a GPU fallen back to its CPU); Auto then sends m2
    nothing, so it would never see a repair. ``homefleet timings forget m2`` (another process)
    puts m2 back on the fleet file's guess for this server's next decision; ``timings list``
    shows what was learned."""
    client, ctx = api
    guess = ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
    for run_s in (2.0, 200.0, 200.0):
        accepted, token = _claimed(client, ctx, side=256)
        _upload(client, accepted["id"], token, load_s=0.5, run_s=run_s, cold=run_s == 2.0)
    slow = ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
    assert slow.samples == 3 and slow.step_s == pytest.approx(200.0 / 4 * (1024 * 1024) / MIN_SCALED_SIZE)
    env = cli_env(ctx, settings, tmp_path)
    listed = run_cli("timings", "list", "--machine", "m2", env=env).stdout
    rows = [
        [cell.strip() for cell in line.strip("│").split("│")] for line in listed.splitlines() if line.startswith("│")
    ]
    assert rows == [["m2", MODEL, "txt2img", "0.5 (1)", f"{slow.step_s:.3g} per step (3)", "-", "0"]], listed
    with pytest.raises(AssertionError, match="unknown_kind"):
        run_cli("timings", "forget", "m2", "--kind", "txt2imag", env=env)  # a typo forgets nothing
    assert ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img") == slow
    done = run_cli("timings", "forget", "m2", env=env)
    assert "m2: 1 learned timings forgotten; priced by the fleet file's guesses until measured again" in done.stdout
    assert ctx.timings.load().get("m2", MODEL, "txt2img") is None
    assert ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img") == guess  # this process re-read
    assert (
        "no learned timings of m2 of models in service yet"
        in run_cli("timings", "list", "--machine", "m2", env=env).stdout
    )
    again = run_cli("timings", "forget", "m2", "--model", MODEL, env=env).stdout
    assert f"m2: no learned timing of model {MODEL} to forget (homefleet timings list shows what was learned)" in again
    # a retired model's timings price nothing (its id is never used again): listed on request only
    accepted, token = _claimed(client, ctx, side=256)
    _upload(client, accepted["id"], token, load_s=0.5, run_s=2.0, cold=True)
    ctx.registry.retire(MODEL)
    hidden = run_cli("timings", "list", env=env).stdout
    assert "no learned timings of models in service yet (1 of retired models: --retired lists them)" in hidden, hidden
    shown = run_cli("timings", "list", "--retired", env=env).stdout
    assert f"{MODEL} (retired)" in shown and "m2" in shown, shown


def test_r8_a_job_whose_machine_went_offline_says_so_and_what_to_do(api: tuple[TestClient, ServerContext]) -> None:
    """A queued job whose machine lost its heartbeat (its worker stopped) waits in that line; its
    record says so, and how to run it elsewhere, instead of nothing (a user pass). A running one
    says it ends interrupted unless its worker reports again; an online machine's jobs say nothing."""
    client, ctx = api
    running, _ = _claimed(client, ctx)
    queued = client.post(
        "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "m2"}
    ).json()
    assert client.get(queued["url"]).json()["note"] is None and client.get(running["url"]).json()["note"] is None
    ctx.redis.delete(ctx.keys.heartbeat("m2"))
    note = client.get(queued["url"]).json()["note"]
    assert note.startswith("machine m2 is offline (no live heartbeat): the job waits in its line"), note
    assert f"`homefleet jobs requeue {queued['id']} --target auto`" in note
    assert "ends interrupted (worker_lost)" in client.get(running["url"]).json()["note"]
    bring_online(ctx, "m2", {MODEL, VIDEO})
    assert client.get(queued["url"]).json()["note"] is None
    ctx.journal.transition(queued["id"], [JobState.queued], JobState.cancelled)
    ctx.redis.delete(ctx.keys.heartbeat("m2"))
    assert client.get(queued["url"]).json()["note"] is None  # ended: nothing keeps it waiting


@pytest.mark.parametrize("reported", [{}, {"load_s": 0.5}, {"load_s": 0.5, "run_s": 0.0}])
def test_r13_a_failed_job_whose_run_did_not_finish_teaches_no_timing(
    api: tuple[TestClient, ServerContext], reported: dict[str, float]
) -> None:
    """A run cut short (an exception, an OOM) has no run time: its 0 s or missing run time must
    not become "this machine takes 0 s per step", which would draw every Auto job to it."""
    client, ctx = api
    guess = ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img")
    accepted, token = _claimed(client, ctx)
    failed = client.post(
        f"/internal/v1/jobs/{accepted['id']}/failure",
        headers=token,
        json={"reason": "error", "message": "boom", **reported},
    )
    assert failed.status_code == 200, failed.text
    assert failed.json()["state"] == "failed" and ctx.machines.reservations.count("m2") == 0
    assert ctx.dispatcher.costs.estimator().timing("m2", MODEL, "txt2img") == guess
    assert ctx.dispatcher.timings.load().get("m2", MODEL, "txt2img") is None  # nothing stored


def test_r14_reconciliation_releases_reservations_of_ended_jobs(api: tuple[TestClient, ServerContext]) -> None:
    client, ctx = api
    ids = [
        client.post(
            "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x"}, "target": "server"}
        ).json()["id"]
        for _ in range(2)
    ]
    ctx.journal.transition(ids[0], [JobState.queued], JobState.cancelled)  # ended without a release
    assert ctx.machines.reservations.reconcile(ctx.fleet.machines, ctx.journal) == [ids[0]]
    assert [job_id for job_id, _ in ctx.machines.reservations.records("server")] == [ids[1]]


def test_r13_the_fleet_configs_model_guesses_price_a_job_until_it_is_measured(
    settings: Settings, tiny_models_dir: Path
) -> None:
    fleet = Fleet(
        machines={m.name: m for m in [machine("server"), machine("m1")]},
        models={MODEL: ModelGuess(step_s=16.0, load_s=3.0)},
    )  # 1 s per step at 64x64 (as at 256x256)
    ctx = build_context(settings, fleet, migrate=True)
    try:
        ctx.registry.add(tiny_models_dir / MODEL, MODEL)
        bring_online(ctx, "m1", {MODEL})
        job = ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "x", "steps": 4, "width": 64, "height": 64}, "m1").job
        assert job.predicted_run_s == pytest.approx(4.0)  # 16 s/step at 1024x1024 x 4 steps x 256*256/1024^2
        assert job.predicted_load_s == pytest.approx(3.0)  # m1 reads at the reference 2.5 GB/s
        plain = build_context(
            settings, Fleet(machines=fleet.machines), migrate=True
        )  # no guess: the sd1 family's figure
        try:
            other = plain.dispatcher.submit(
                MODEL, "txt2img", {"prompt": "x", "steps": 4, "width": 64, "height": 64}, "m1"
            ).job
        finally:
            plain.close()
        assert other.predicted_run_s <= 0.25 and other.predicted_load_s < 0.1  # the family figure: 16x smaller
    finally:
        ctx.close()


def test_r13_a_timing_learned_by_another_server_process_prices_the_next_decision(
    api: tuple[TestClient, ServerContext], settings: Settings
) -> None:
    _, ctx = api
    body = (MODEL, "txt2img", {"prompt": "x", "steps": 4})
    guessed = ctx.dispatcher.submit(*body, "m2").job  # this process now holds an Estimator
    other = build_context(settings, ctx.fleet, migrate=True)  # another API process sharing Redis and the journal
    try:
        claimed = other.journal.claim(guessed.id, "m2")
        other.endings.finished(other.journal.fail(claimed.id, "m2", "error", "boom", load_s=None, run_s=40.0))
    finally:
        other.close()
    learned = ctx.dispatcher.submit(*body, "m2").job
    assert guessed.predicted_run_s != pytest.approx(40.0)
    assert learned.predicted_run_s == pytest.approx(40.0)  # the same job size: exactly the measured run


def test_r11_a_model_registered_by_another_server_process_is_placed_with_its_weights(
    api: tuple[TestClient, ServerContext], settings: Settings, tiny_models_dir: Path
) -> None:
    _, ctx = api
    ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": "x"}, "auto")  # this process now holds an Estimator
    other = build_context(settings, ctx.fleet, migrate=True)
    try:
        other.registry.add(tiny_models_dir / MODEL, "tiny-sd-copy")
    finally:
        other.close()
    # Auto's scarcity data prices every model with demand, not only the one submitted: the
    # registry's change mark makes this process re-read its model profiles.
    assert "tiny-sd-copy" in ctx.dispatcher.snapshot(MODEL).estimator.models
    bring_online(ctx, "m2", {MODEL, "tiny-sd-copy"})
    placed = ctx.dispatcher.submit("tiny-sd-copy", "txt2img", {"prompt": "x"}, "auto").job
    assert placed.machine == "m2"
    assert placed.weights_bytes == loaded_bytes(ctx.registry.folder("tiny-sd-copy"), Variant()) > 0


def test_r14_a_started_reservation_is_read_first_with_its_elapsed_time(api: tuple[TestClient, ServerContext]) -> None:
    _, ctx = api
    ids = [ctx.dispatcher.submit(MODEL, "txt2img", {"prompt": f"p{i}"}, "m2").job.id for i in range(3)]
    assert [item.elapsed_s for item in ctx.machines.view("m2").queue] == [None, None, None]
    ctx.machines.reservations.start("m2", ids[1], at_s=time.time() - 5.0)
    queue = ctx.machines.view("m2").queue
    assert len(queue) == 3 and queue[0].elapsed_s is not None and queue[0].elapsed_s >= 5.0
    assert [item.elapsed_s for item in queue[1:]] == [None, None]
    ctx.machines.reservations.release("m2", ids[0])
    assert len(ctx.machines.view("m2").queue) == 2


def test_weight_bytes_come_from_safetensors_headers(tmp_path: Path, tiny_models_dir: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": 1000, "b": 234})
    assert safetensors_weight_bytes(path) == 1234
    # The tiny real pipeline: headers agree with the tensors' bytes (no load needed).
    from safetensors import safe_open

    total = 0
    for file in (tiny_models_dir / MODEL).rglob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as handle:
            total += sum(handle.get_tensor(k).nbytes for k in handle.keys())  # noqa: SIM118 (safe_open is not iterable)
    assert model_weight_bytes(tiny_models_dir / MODEL) == total > 0


def test_r8_status_shows_queued_as_llen_and_running_apart_and_the_drain_time(
    api: tuple[TestClient, ServerContext], settings: Settings, tmp_path: Path
) -> None:
    from tests.helpers import run_cli

    client, ctx = api
    bring_online(ctx, "m2", {MODEL, VIDEO}, warm=(MODEL,))
    ids = [
        client.post(
            "/v1/jobs", json={"model": MODEL, "kind": "txt2img", "params": {"prompt": "x", "steps": 4}, "target": "m2"}
        ).json()["id"]
        for _ in range(3)
    ]
    token = {"Authorization": f"Bearer {ctx.fleet.machines['m2'].token}"}
    client.post(f"/internal/v1/jobs/{ids[0]}/claim", headers=token)
    ctx.redis.rpop(ctx.keys.queue_list("m2"))  # the worker took the first message
    rows = {row["name"]: row for row in ctx.status()}
    assert (rows["m2"]["queued"], rows["m2"]["running"], rows["m2"]["backlog"]) == (2, 1, 3)
    assert rows["m2"]["warm_models"] == [MODEL] and rows["m2"]["drain_s"] > 0
    assert (rows["off"]["online"], rows["off"]["backlog"], rows["off"]["drain_s"]) == (False, 0, 0)
    env = cli_env(ctx, settings, tmp_path)
    shown = run_cli("status", env=env).stdout
    later = {row["name"]: row for row in ctx.status()}["m2"]["drain_s"]  # the running job ran on meanwhile
    [line] = [line for line in shown.splitlines() if " m2 " in line]
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    assert cells[1] == "yes" and cells[3] == f"{MODEL}*"  # verified, and warm (*)
    assert (cells[4], cells[5]) == ("2", "1") and int(cells[4]) == ctx.redis.llen(ctx.keys.queue_list("m2"))
    assert round(later, 1) - 0.05 <= float(cells[6]) <= round(rows["m2"]["drain_s"], 1) + 0.05
    machines = {row["name"]: row for row in client.get("/v1/machines").json()}
    assert (machines["m2"]["queued"], machines["m2"]["running"], machines["m2"]["backlog"]) == (2, 1, 3)


def test_status_shows_a_draining_and_a_syncing_machine(
    api: tuple[TestClient, ServerContext], settings: Settings, tmp_path: Path
) -> None:
    from tests.helpers import run_cli

    client, ctx = api
    bring_online(ctx, "m1", {MODEL})
    bring_online(ctx, "m2", {MODEL})
    env = cli_env(ctx, settings, tmp_path)
    run_cli("drain", "m1", "--no-wait", env=env)
    ctx.redis.set(ctx.keys.syncing("m2"), "sync-1", px=30_000)  # what Syncs.start holds while copying (R6)
    rows = {row["name"]: row for row in ctx.status()}
    assert (rows["m1"]["draining"], rows["m1"]["syncing"], rows["m1"]["state"]) == (True, False, "draining")
    assert (rows["m2"]["draining"], rows["m2"]["syncing"], rows["m2"]["state"]) == (False, True, "syncing")
    assert rows["server"]["state"] == "-"
    machines = {row["name"]: row for row in client.get("/v1/machines").json()}
    assert (machines["m1"]["draining"], machines["m2"]["syncing"], machines["server"]["draining"]) == (
        True,
        True,
        False,
    )
    shown = run_cli("status", env=env).stdout
    assert "state" in shown.splitlines()[1]
    [m1] = [line for line in shown.splitlines() if " m1 " in line]
    [m2] = [line for line in shown.splitlines() if " m2 " in line]
    assert " draining " in m1 and " syncing " not in m1 and " syncing " in m2
    piped = run_cli("status", env={**env, "COLUMNS": None}).stdout  # no terminal, no COLUMNS
    assert [line for line in piped.splitlines() if " m1 " in line] == [m1]
    listed = run_cli("models", "list", env={**env, "COLUMNS": None}).stdout  # a table wider than 80 columns
    assert max(len(line) for line in listed.splitlines()) > 80 and "│" in listed  # not cut at rich's default
    run_cli("drain", "m1", "--undo", env=env)
    assert {row["name"]: row for row in ctx.status()}["m1"]["state"] == "-"
