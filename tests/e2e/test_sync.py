"""Integrity and one-way sync end to end (R4, R5, R6; cases C06, C07) on real ``celery worker``
processes, the real API and real tiny pipelines.

Fleet of this module: ``server``, ``m1`` and ``m2`` (m2 downloads at most 1 MB/s, so a sync
can be killed halfway through a file). Models, all registered before the workers start:
``tiny-a`` on every machine, ``tiny-b`` and ``tiny-d`` on the server only, ``tiny-c`` on the
server and m1.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.client import ApiError, HomefleetClient
from app.context import ServerContext, build_context
from app.core.digest import file_digest
from app.core.tls import tls_context
from app.devtools.localfleet import LocalFleet
from tests.helpers import (
    LONG_SIZE,
    TEST_API_KEY,
    end_running,
    fleet_files,
    flip_keeping_stat,
    pause,
    run_cli,
    wait_for,
)

pytestmark = pytest.mark.e2e

UNET = "unet/diffusion_pytorch_model.safetensors"
M2_BYTES_PER_S = 1_000_000
SYNC_TTL_S = 3


@dataclass
class SyncFleet:
    local: LocalFleet
    ctx: ServerContext
    client: HomefleetClient
    env: dict[str, str]  # for running the CLI against this fleet

    def verified(self, machine: str) -> set[str]:
        return set(self.ctx.redis.smembers(self.ctx.keys.verified(machine)))

    def start_worker(self, machine: str) -> None:
        extra = {"HOMEFLEET_SYNC_MAX_BYTES_PER_S": str(M2_BYTES_PER_S)} if machine == "m2" else None
        self.local.start_worker(machine, extra_env=extra)

    def sync(self, machine: str, *models: str) -> dict:  # type: ignore[type-arg]
        response = httpx.post(
            f"{self.local.api_url}/v1/machines/{machine}/sync",
            json={"models": list(models)},
            headers=self.local.auth_headers,
            verify=tls_context(),
        )
        assert response.status_code == 202, response.text
        return response.json()  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def model_for_a_test(self, source: Path, model_id: str, machine: str) -> Iterator[Path]:
        """A model registered for one test, and its folder on ``machine`` (where the test puts
        it); afterwards retired and that folder removed, and ``machine`` no longer advertising
        it, as the module's other tests expect the machine."""
        self.ctx.registry.add(source, model_id=model_id)
        folder = self.local.models_dir(machine) / model_id
        try:
            yield folder
        finally:
            self.ctx.registry.retire(model_id)
            shutil.rmtree(folder, ignore_errors=True)
            wait_for(
                lambda: model_id not in self.ctx.machines.heartbeat(machine)["verified_models"],
                timeout_s=60,
                what=f"{machine} to stop advertising {model_id}",
            )

    def sync_state(self, sync_id: str) -> dict:  # type: ignore[type-arg]
        return httpx.get(
            f"{self.local.api_url}/v1/syncs/{sync_id}", headers=self.local.auth_headers, verify=tls_context()
        ).json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str, tiny_models_dir: Path) -> Iterator[SyncFleet]:
    files = fleet_files(
        tmp_path_factory.mktemp("syncfleet"), f"{redis_base_url}/2", "m1", "m2", sync_reservation_ttl_s=SYNC_TTL_S
    )
    config, settings = files.config, files.settings
    env = {**files.operator, "HOMEFLEET_SYNC_RESERVATION_TTL_S": str(SYNC_TTL_S)}
    local = LocalFleet(settings, config, files.fleet_file, forkserver=True)
    ctx = build_context(settings, config, migrate=True)
    for model in ("tiny-a", "tiny-b", "tiny-c", "tiny-d"):
        ctx.registry.add(tiny_models_dir / "tiny-sd", model_id=model)
    client = HomefleetClient(local.api_url, api_key=TEST_API_KEY)
    running = SyncFleet(local, ctx, client, env)
    try:
        for machine in ("m1", "m2"):
            local.copy_model("tiny-a", machine)
        local.copy_model("tiny-c", "m1")
        local.start_api(extra_env={"HOMEFLEET_SYNC_RESERVATION_TTL_S": str(SYNC_TTL_S)})
        for machine in ("server", "m1", "m2"):
            running.start_worker(machine)
        local.wait_online(["server", "m1", "m2"], model_id="tiny-a", timeout_s=120)
        yield running
    finally:
        client.close()
        local.stop()
        ctx.close()


def test_r4_the_heartbeat_carries_machine_boot_device_memory_warm_and_verified(fleet: SyncFleet) -> None:
    assert fleet.verified("server") == {"tiny-a", "tiny-b", "tiny-c", "tiny-d"}
    assert fleet.verified("m1") == {"tiny-a", "tiny-c"}
    assert fleet.verified("m2") == {"tiny-a"}
    job = fleet.client.submit("tiny-a", "txt2img", {"prompt": "x", "steps": 2}, target="m1")
    assert fleet.client.wait(job["id"], timeout_s=120)["state"] == "succeeded"
    beat = wait_for(
        lambda: (hb := fleet.ctx.machines.heartbeat("m1")) and hb["warm_models"] and hb,
        what="m1's heartbeat to show its warm model",
    )
    assert beat["machine"] == "m1" and len(beat["boot_id"]) == 32 and beat["device"] == "cpu"
    assert beat["memory_total_bytes"] > beat["memory_available_bytes"] > 0
    assert (beat["warm_models"], beat["verified_models"]) == (["tiny-a"], ["tiny-a", "tiny-c"])


def test_r4_r6_a_model_present_but_not_advertised_is_refused_pinned_skipped_by_auto_until_synced(
    fleet: SyncFleet,
) -> None:
    # Put tiny-b's files on m2 by hand: present, but m2 declared nothing about them (R4).
    fleet.local.copy_model("tiny-b", "m2")
    with pytest.raises(ApiError) as refused:
        fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="m2")
    assert (refused.value.status_code, refused.value.reason) == (422, "model_not_verified")
    assert "homefleet sync m2 tiny-b" in refused.value.message
    # Auto: m2 would win the tie on name if it were eligible; it is skipped.
    assert fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="auto")["machine"] == "server"
    # The operator's command: m2 checks what it holds, verifies, advertises.
    done = run_cli("sync", "m2", "tiny-b", env=fleet.env, timeout_s=120)
    assert "succeeded" in done.stdout and "tiny-b" in done.stdout, done.stdout
    assert "tiny-b" in fleet.verified("m2")
    accepted = fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="m2")
    assert fleet.client.wait(accepted["id"], timeout_s=120)["state"] == "succeeded"


def test_r6_sync_is_refused_with_409_while_the_machine_runs_a_job(fleet: SyncFleet) -> None:
    running = fleet.client.submit("tiny-a", "txt2img", {"prompt": "long", "steps": 150, **LONG_SIZE}, target="m1")
    queued = fleet.client.submit("tiny-a", "txt2img", {"prompt": "next", "steps": 2}, target="m1")
    pause(fleet.ctx, running["id"])  # the machine stays busy, at no CPU, until it is ended below
    response = httpx.post(
        f"{fleet.local.api_url}/v1/machines/m1/sync",
        json={"models": ["tiny-d"]},
        headers=fleet.local.auth_headers,
        verify=tls_context(),
    )
    assert response.status_code == 409
    assert response.json()["error"]["reason"] == "machine_busy"
    assert "job(s) queued or running" in response.json()["error"]["message"]
    cli = run_cli("sync", "m1", "tiny-d", env=fleet.env, check=False)  # the operator's command is refused too
    assert cli.returncode == 2 and "machine_busy" in cli.stderr, cli.stderr
    end_running(fleet.ctx, running["id"])
    assert fleet.client.wait(queued["id"], timeout_s=300)["state"] == "succeeded"
    assert not (fleet.local.models_dir("m1") / "tiny-d").exists()  # nothing was copied


def test_c07_a_file_changed_in_its_last_byte_is_refused_before_loading_and_withdrawn(fleet: SyncFleet) -> None:
    path = fleet.local.models_dir("m1") / "tiny-c" / UNET
    original = path.read_bytes()
    flip_keeping_stat(path, -1, fleet.local.processes["worker-m1"].pid)  # same size, inode and mtime
    assert "tiny-c" in fleet.verified("m1")  # not re-checked yet: still advertised
    accepted = fleet.client.submit("tiny-c", "txt2img", {"prompt": "x", "steps": 2}, target="m1")
    job = fleet.client.wait(accepted["id"], timeout_s=120)
    assert (job["state"], job["reason"]) == ("failed", "integrity")
    assert UNET in job["message"] and "homefleet sync m1 tiny-c" in job["message"]
    assert job["load_s"] is None and job["cold_load"] is None  # refused before loading: no load was timed
    assert "tiny-c" not in fleet.verified("m1")  # withdrawn (R5)
    wait_for(
        lambda: fleet.ctx.machines.heartbeat("m1")["verified_models"] == ["tiny-a"],
        what="m1's heartbeat to drop tiny-c",
    )
    with pytest.raises(ApiError) as refused:
        fleet.client.submit("tiny-c", "txt2img", {"prompt": "x"}, target="m1")
    assert refused.value.reason == "model_not_verified"
    assert fleet.client.submit("tiny-c", "txt2img", {"prompt": "x", "steps": 2}, target="auto")["machine"] == "server"
    # The repair the failure names works: the sync sets the differing file aside (never
    # deleting it, R6) and copies the registered bytes; the model is advertised again.
    changed = path.read_bytes()
    record = fleet.sync("m1", "tiny-c")
    done = wait_for(
        lambda: (s := fleet.sync_state(record["id"]))["state"] in ("succeeded", "failed") and s, what="the sync to end"
    )
    assert done["state"] == "succeeded", done
    assert [(r["path"], r["status"]) for r in done["results"] if r["status"] != "present"] == [(UNET, "replaced")]
    # the files found in place are counted apart, so that `homefleet sync`'s rate is the download's
    present = sum(r["size_bytes"] for r in done["results"] if r["status"] == "present")
    assert present > 0 and done["bytes_kept"] == present
    assert done["bytes_done"] == done["bytes_total"] == present + len(original)
    assert path.read_bytes() == original
    aside = list(path.parent.glob(f".{path.name}.*.superseded"))
    assert len(aside) == 1 and aside[0].read_bytes() == changed
    assert "tiny-c" in fleet.verified("m1")


def test_c06_a_sync_killed_mid_file_leaves_nothing_at_the_final_name_and_only_a_full_resync_advertises(
    fleet: SyncFleet,
) -> None:
    folder = fleet.local.models_dir("m2") / "tiny-d"
    final = folder / UNET
    size = (fleet.local.settings.models_dir / "tiny-d" / UNET).stat().st_size
    record = fleet.sync("m2", "tiny-d")

    def partial_halfway() -> Path | None:
        found = list(final.parent.glob(f".{final.name}.*.partial")) if final.parent.exists() else []
        return found[0] if found and found[0].stat().st_size >= 512 * 1024 else None

    partial = wait_for(partial_halfway, timeout_s=60, what="the unet copy to be under way")
    old_boot = fleet.ctx.machines.heartbeat("m2")["boot_id"]
    fleet.local.stop_worker("m2", signal.SIGKILL)  # the whole process group, mid-file
    assert 0 < partial.stat().st_size < size
    assert not final.exists()  # no partial data under the real name
    assert "tiny-d" not in fleet.verified("m2")

    fleet.start_worker("m2")
    # The killed worker's heartbeat lives on for its TTL: wait for the new boot's own.
    wait_for(
        lambda: (hb := fleet.ctx.machines.heartbeat("m2")) and hb["boot_id"] != old_boot,
        timeout_s=120,
        what="m2's new worker to beat",
    )
    assert "tiny-d" not in fleet.verified("m2")  # checked at start: files missing, not advertised
    assert wait_for(
        lambda: fleet.sync_state(record["id"])["state"] == "interrupted",
        timeout_s=SYNC_TTL_S + 30,
        what="the killed sync's reservation to expire",
    )
    # J1 on m2 with that model: refused before anything is queued or loaded, naming the fix.
    with pytest.raises(ApiError) as refused:
        fleet.client.submit("tiny-d", "txt2img", {"prompt": "x", "steps": 2}, target="m2")
    assert refused.value.reason == "model_not_verified" and "homefleet sync m2 tiny-d" in refused.value.message

    again = fleet.sync("m2", "tiny-d")
    done = wait_for(
        lambda: (s := fleet.sync_state(again["id"]))["state"] in ("succeeded", "failed") and s,
        timeout_s=120,
        what="the re-sync to end",
    )
    assert done["state"] == "succeeded", done
    statuses = {r["path"]: r["status"] for r in done["results"]}
    assert statuses[UNET] == "copied" and set(statuses.values()) <= {"copied", "present"}
    present = sum(r["size_bytes"] for r in done["results"] if r["status"] == "present")
    # what the first sync downloaded counts as kept: the files it finished and the unet's partial copy
    assert present + 512 * 1024 <= done["bytes_kept"] < done["bytes_done"] == done["bytes_total"]
    assert final.read_bytes() == (fleet.local.settings.models_dir / "tiny-d" / UNET).read_bytes()
    assert not list(folder.rglob("*.partial"))
    log = (fleet.local.logs_dir / "worker-m2.log").read_text()
    assert f"resuming tiny-d/{UNET} at byte" in log  # HTTP Range picked up the partial copy
    assert "tiny-d" in fleet.verified("m2")
    accepted = fleet.client.submit("tiny-d", "txt2img", {"prompt": "x", "steps": 2}, target="m2")
    assert fleet.client.wait(accepted["id"], timeout_s=120)["state"] == "succeeded"


def test_r5_the_servers_own_worker_verifies_at_cold_load_and_models_update_takes_new_content(fleet: SyncFleet) -> None:
    """A byte of tiny-d (never loaded on the server; m2 holds a synced copy, C06) flipped in the
    SERVER's folder, size and mtime kept: the registry's stat
    cache cannot see it, so the submission is accepted, but the server's worker hashes its
    files at cold load like any worker: the job fails ``integrity`` and the server withdraws
    tiny-d. ``models verify`` names the file (exit 1, nothing recorded); ``models update``
    takes the new content, tells m2 (which holds the old content) and the server's worker
    re-verifies; the next job's provenance carries the new digest."""
    path = fleet.local.settings.models_dir / "tiny-d" / UNET
    registered = next(f.digest for f in fleet.ctx.registry.registered_manifest("tiny-d").files if f.path == UNET)
    flip_keeping_stat(path, path.stat().st_size // 2, fleet.local.processes["worker-server"].pid)
    actual = file_digest(path)
    assert "tiny-d" in fleet.verified("server") and "tiny-d" in fleet.verified("m2")
    accepted = fleet.client.submit("tiny-d", "txt2img", {"prompt": "x", "steps": 2}, target="server")
    job = fleet.client.wait(accepted["id"], timeout_s=120)
    assert (job["state"], job["reason"]) == ("failed", "integrity"), job
    assert f"{UNET}: digest {actual}, manifest says {registered}" in job["message"]
    assert job["load_s"] is None  # refused before loading
    assert "tiny-d" not in fleet.verified("server")  # withdrawn (R4)

    verify = run_cli("models", "verify", "tiny-d", env={**fleet.env, "COLUMNS": "300"}, check=False)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert f"changed: tiny-d {UNET} registered {registered} actual {actual}" in verify.stdout, verify.stdout
    assert registered in {f.digest for f in fleet.ctx.registry.registered_manifest("tiny-d").files}  # nothing recorded

    update = run_cli("models", "update", "tiny-d", env={**fleet.env, "COLUMNS": "300"})
    assert "updated tiny-d: 1 changed, 0 added, 0 removed" in update.stdout, update.stdout
    assert f"changed: {UNET}" in update.stdout
    assert "advertised it" not in update.stdout and "server reads this folder itself" in update.stdout  # m2 had it
    started = re.search(r"m2 held the old content \(withdrawn there now\): sync ([0-9a-f]+) started", update.stdout)
    assert started, update.stdout
    synced = wait_for(
        lambda: (s := fleet.sync_state(started[1]))["state"] in ("succeeded", "failed") and s,
        timeout_s=120,
        what="m2's re-sync to end",
    )
    assert synced["state"] == "succeeded", synced
    assert [(r["path"], r["status"]) for r in synced["results"] if r["status"] != "present"] == [(UNET, "replaced")]
    copy = fleet.local.models_dir("m2") / "tiny-d" / UNET
    assert file_digest(copy) == actual  # the new content, and the old one set aside, not deleted (R6)
    assert [file_digest(p) for p in copy.parent.glob(f".{UNET.split('/')[-1]}.*.superseded")] == [registered]
    wait_for(
        lambda: "tiny-d" in fleet.verified("server") and "tiny-d" in fleet.verified("m2"),
        timeout_s=60,
        what="the server's worker and m2 to verify the new content",
    )
    done = fleet.client.wait(
        fleet.client.submit("tiny-d", "txt2img", {"prompt": "x", "steps": 2}, target="server")["id"], timeout_s=120
    )
    assert done["state"] == "succeeded", done
    assert done["provenance"]["model_files"][UNET] == actual
    assert done["provenance"]["model_files"] == {f.path: f.digest for f in fleet.ctx.registry.manifest("tiny-d").files}
    on_m2 = fleet.client.wait(
        fleet.client.submit("tiny-d", "txt2img", {"prompt": "x", "steps": 2}, target="m2")["id"], timeout_s=120
    )
    assert on_m2["state"] == "succeeded" and on_m2["provenance"]["model_files"][UNET] == actual, on_m2


def test_r5_a_warm_models_file_changed_on_disk_is_withdrawn_by_the_heartbeat_and_cold_loaded_once_restored(
    fleet: SyncFleet,
) -> None:
    """tiny-a is resident on m1; a byte of its copy there changes (a write: the mtime moves).
    The heartbeat thread sees the stat change, rehashes, and withdraws tiny-a from m1 without
    any job. Once the bytes are back (their stat moves again) the heartbeat hashes them and
    advertises tiny-a again, without a sync; the next job does not reuse the resident pipeline
    loaded before the change: it verifies and loads cold."""
    warm = fleet.client.wait(
        fleet.client.submit("tiny-a", "txt2img", {"prompt": "x", "steps": 2}, target="m1")["id"], timeout_s=120
    )
    assert warm["state"] == "succeeded"
    wait_for(lambda: "tiny-a" in fleet.ctx.machines.heartbeat("m1")["warm_models"], what="tiny-a warm on m1")
    path = fleet.local.models_dir("m1") / "tiny-a" / UNET
    original = path.read_bytes()
    path.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
    wait_for(lambda: "tiny-a" not in fleet.verified("m1"), timeout_s=30, what="m1's heartbeat to withdraw tiny-a")
    log = fleet.local.logs_dir / "worker-m1.log"  # written just after the withdrawal (tasks/verify.py)
    wait_for(
        lambda: "m1: model tiny-a changed on disk and was withdrawn" in log.read_text(),
        timeout_s=30,
        what="m1's log to say why tiny-a was withdrawn",
    )
    with pytest.raises(ApiError) as refused:
        fleet.client.submit("tiny-a", "txt2img", {"prompt": "x"}, target="m1")
    assert refused.value.reason == "model_not_verified"

    path.write_bytes(original)  # the right bytes again, a new mtime
    wait_for(lambda: "tiny-a" in fleet.verified("m1"), timeout_s=30, what="m1's heartbeat to advertise tiny-a again")
    assert "m1: model tiny-a matches its manifest again (every byte hashed): advertised" in log.read_text()
    again = fleet.client.wait(
        fleet.client.submit("tiny-a", "txt2img", {"prompt": "x", "steps": 2}, target="m1")["id"], timeout_s=120
    )
    assert again["state"] == "succeeded" and again["cold_load"] is True, again


def test_r6_the_repair_hint_replaces_a_damaged_file_reached_through_a_link_and_leaves_its_target_alone(
    fleet: SyncFleet,
    tmp_path: Path,
) -> None:
    """A model folder whose file is a link (a Hugging Face cache's snapshot links to its blobs)
    to damaged bytes: a job is refused naming ``homefleet sync m1 MODEL``, and that command (the CLI, as an
    operator runs it) replaces it, never answering ``conflict``: the
    link is set aside (``.superseded``, still a link), the blob it points to is untouched, the
    registered bytes are linked at the final name, and the model runs again."""
    fleet.local.copy_model("tiny-b", "m1")
    path = fleet.local.models_dir("m1") / "tiny-b" / UNET
    original = path.read_bytes()
    blob = tmp_path / "blob"
    blob.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))  # its last byte changed
    damaged = blob.read_bytes()
    path.unlink()
    path.symlink_to(blob)
    with pytest.raises(ApiError) as refused:  # m1 holds it, unverified: the refusal names the repair
        fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="m1")
    assert "homefleet sync m1 tiny-b" in refused.value.message, refused.value.message
    done = run_cli("sync", "m1", "tiny-b", env=fleet.env, timeout_s=120)
    assert "succeeded" in done.stdout and "conflict" not in done.stdout, done.stdout
    assert path.read_bytes() == original and not path.is_symlink()
    aside = list(path.parent.glob(f".{path.name}.*.superseded"))
    assert len(aside) == 1 and aside[0].is_symlink() and aside[0].resolve() == blob.resolve(), aside
    assert blob.read_bytes() == damaged  # what the link pointed to is never touched (R6)
    assert "tiny-b" in fleet.verified("m1")
    accepted = fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="m1")
    assert fleet.client.wait(accepted["id"], timeout_s=120)["state"] == "succeeded"


def test_r4_models_update_after_the_servers_files_are_put_back_brings_the_model_back_there(
    fleet: SyncFleet,
) -> None:
    """An operator edits a file of tiny-b in the server's folder (the server's worker withdraws
    it), puts the bytes back and runs ``models update``: no digest changed, so it records
    nothing and starts no sync, yet the server's worker hashes the withdrawn model again and
    advertises it (it stayed withdrawn until a sync of the server to itself)."""
    path = fleet.local.settings.models_dir / "tiny-b" / "unet" / "config.json"
    original = path.read_bytes()
    path.write_bytes(original + b" ")
    wait_for(lambda: "tiny-b" not in fleet.verified("server"), timeout_s=30, what="the server to withdraw tiny-b")
    path.write_bytes(original)
    update = run_cli("models", "update", "tiny-b", env={**fleet.env, "COLUMNS": "300"})
    assert update.stdout.splitlines() == [
        "tiny-b: no file changed; nothing to do (nothing recorded or withdrawn, no sync started)"
    ], update.stdout
    wait_for(lambda: "tiny-b" in fleet.verified("server"), timeout_s=60, what="the server's worker to verify tiny-b")
    done = fleet.client.wait(
        fleet.client.submit("tiny-b", "txt2img", {"prompt": "x", "steps": 2}, target="server")["id"], timeout_s=120
    )
    assert done["state"] == "succeeded", done


def test_r4_r5_a_server_file_put_back_as_it_was_brings_the_model_back_without_a_sync(fleet: SyncFleet) -> None:
    """An operator's stray edit of tiny-c in the server's folder: submissions are 409
    ``model_changed`` (its message says to restore the files) and the server's worker withdraws
    it. The file put back with its bytes and mtime (``cp -p`` from a backup) is all it takes: the
    server takes submissions again and its worker, whose heartbeat sees the stat move, hashes
    the files and advertises tiny-c again; the job runs. It used to stay withdrawn until a sync
    of the server to itself, which the 409's message did not name."""
    path = fleet.local.settings.models_dir / "tiny-c" / "unet" / "config.json"
    original, stat = path.read_bytes(), path.stat()
    path.write_bytes(original + b" ")
    wait_for(lambda: "tiny-c" not in fleet.verified("server"), timeout_s=30, what="the server to withdraw tiny-c")
    with pytest.raises(ApiError) as changed:
        fleet.client.submit("tiny-c", "txt2img", {"prompt": "x", "steps": 2}, target="server")
    assert (changed.value.status_code, changed.value.reason) == (409, "model_changed")
    assert "restore the files" in changed.value.message

    path.write_bytes(original)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as cp -p puts it back
    wait_for(lambda: "tiny-c" in fleet.verified("server"), timeout_s=30, what="the server's worker to advertise tiny-c")
    done = fleet.client.wait(
        fleet.client.submit("tiny-c", "txt2img", {"prompt": "x", "steps": 2}, target="server")["id"], timeout_s=120
    )
    assert done["state"] == "succeeded", done
    log = (fleet.local.logs_dir / "worker-server.log").read_text()
    assert "server: model tiny-c matches its manifest again (every byte hashed): advertised" in log


def test_r6_a_damaged_partial_copy_is_downloaded_again_within_the_same_sync(
    fleet: SyncFleet, tiny_models_dir: Path
) -> None:
    """A ``.partial`` left on the worker that is not a prefix of the file (damaged on its disk):
    the resume's digest does not match, so that file is downloaded again from byte 0 and the
    sync succeeds (it failed with a digest_mismatch naming "downloaded bytes" it never sent)."""
    from app.core.digest import hex_part

    model = "tiny-partial"
    with fleet.model_for_a_test(tiny_models_dir / "tiny-sd", model, "m1") as folder:
        [unet] = [f for f in fleet.ctx.registry.manifest(model).files if f.path == UNET]
        final = folder / UNET
        final.parent.mkdir(parents=True)
        damaged = final.parent / f".{final.name}.{hex_part(unet.digest)[:16]}.partial"
        damaged.write_bytes(os.urandom(100_000))  # shorter than the file: resumed, then found wrong
        record = fleet.sync("m1", model)
        done = wait_for(
            lambda: (s := fleet.sync_state(record["id"]))["state"] in ("succeeded", "failed") and s,
            timeout_s=120,
            what="the sync to end",
        )
        assert done["state"] == "succeeded", done
        assert {r["path"]: r["status"] for r in done["results"]}[UNET] == "copied"
        assert final.read_bytes() == (fleet.local.settings.models_dir / model / UNET).read_bytes()
        assert not list(folder.rglob("*.partial"))
        assert done["bytes_done"] == done["bytes_total"] and done["bytes_kept"] == 0  # nothing was in place
        log = (fleet.local.logs_dir / "worker-m1.log").read_text()
        assert f"{model}/{UNET}: the partial copy resumed at byte 100000 did not match" in log
        assert model in fleet.verified("m1")


def test_r6_ctrl_c_stops_following_a_sync_not_the_sync(fleet: SyncFleet, tiny_models_dir: Path) -> None:
    """``homefleet sync`` interrupted (SIGINT, as Ctrl-C sends) while it follows the copy: it says
    the sync goes on and where to follow it, exits 130, and the worker finishes the copy."""
    import subprocess
    import sys

    model = "tiny-followed"
    with fleet.model_for_a_test(tiny_models_dir / "tiny-sd", model, "m2") as folder:  # m2 copies at 1 MB/s
        cli = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "sync", "m2", model],
            env={**os.environ, **fleet.env, "COLUMNS": "120"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # as from a terminal: a pytest-xdist worker ignores SIGINT, and a child inherits that
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert cli.stdout is not None
        first = cli.stdout.readline()  # printed once it follows the sync: Ctrl-C from here stops following
        assert first.startswith("sync ") and " to m2: " in first, first
        wait_for(lambda: list(folder.rglob("*.partial")), timeout_s=60, what="the copy to be under way")
        cli.send_signal(signal.SIGINT)
        rest, _ = cli.communicate(timeout=30)
        out = first + rest
        assert cli.returncode == 130, out
        [sync_id] = re.findall(r"stopped following sync ([0-9a-f]{32}): it goes on on m2", out)
        assert f"GET /v1/syncs/{sync_id} follows it" in out
        done = wait_for(
            lambda: (s := fleet.sync_state(sync_id))["state"] in ("succeeded", "failed") and s,
            timeout_s=120,
            what="the sync to end",
        )
        assert done["state"] == "succeeded", done  # the worker copied on
        assert model in fleet.verified("m2")
