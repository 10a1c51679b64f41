"""``homefleet models add`` on faithful tiny replicas of real repositories (app/devtools/replicas.py),
from a plain folder and with ``--from-hf-cache`` (R1, R4; docs/operations.md, "What registration
takes"): only the files the pipeline loads are recorded, copied and priced, and the command says
what it took and what it left out, and why."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from app.context import ServerContext
from app.core.digest import file_digest
from app.core.errors import Rejected
from app.core.pricing import loaded_bytes
from app.devtools.replicas import Replica, as_hf_cache, make_replica
from app.store.selection import select_files
from tests.helpers import run_cli, settings_env

CASES = [  # (replica, from the cache?, precision)
    ("sd15", False, "fp32"),
    ("sd15", True, "fp16"),
    ("sdxl", False, "fp16"),
    ("sdxl", True, "fp32"),
    ("flux", True, "fp16"),
    ("flux", False, "bf16"),
    ("wan", False, "fp32"),
    ("wan", True, "fp16"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Replica], Path]:
    out = tmp_path_factory.mktemp("replicas")
    replicas = {name: make_replica(name, out / "plain") for name in ("sd15", "sdxl", "flux", "wan")}
    for replica in replicas.values():
        as_hf_cache(replica, out / "hub")
    return replicas, out / "hub"


def _parameters(path: Path) -> int:
    with safe_open(str(path), "pt") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118 (safe_open is not iterable)


def _readable(path: Path) -> bool:
    try:
        _parameters(path)
    except SafetensorError:  # a dummy file of the download
        return False
    return True


def _human_free(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(("name", "cached", "precision"), CASES)
def test_r1_models_add_takes_records_and_prices_only_what_the_pipeline_loads(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], name: str, cached: bool, precision: str
) -> None:
    replicas, hub = built
    replica = replicas[name]
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    source = ["--from-hf-cache", replica.repo_id] if cached else [str(replica.folder)]
    done = run_cli("models", "add", *source, "--precision", precision, env=env)
    model_id = replica.repo_id.split("/")[-1].lower()
    expected = replica.expected[precision]

    record = ctx.registry.get(model_id)
    manifest = ctx.registry.manifest(model_id)
    assert {f.path for f in manifest.files} == set(expected)
    for entry in manifest.files:  # the real bytes (the cache's links followed), digests of the source's files
        assert entry.size == (replica.folder / entry.path).stat().st_size
        assert entry.digest == file_digest(replica.folder / entry.path)
    stored = ctx.registry.folder(model_id)
    on_disk = {p.relative_to(stored).as_posix() for p in stored.rglob("*")}
    assert {p for p in on_disk if (stored / p).is_file()} == set(expected)
    assert not any((stored / p).is_symlink() for p in on_disk)
    assert record.total_bytes == sum((replica.folder / p).stat().st_size for p in expected)
    assert record.source_format == ("hf-cache" if cached else "diffusers")
    assert (record.precision, record.family) == (precision, replica.family)

    # priced from the weights taken only, not from every *.safetensors of the download
    taken_parameters = sum(_parameters(replica.folder / p) for p in expected if p.endswith(".safetensors"))
    # (the price is what the loaded pipeline holds, tests/integration/fleet/test_family_memory.py:
    # its buffers too, and the modules a family keeps in fp32, e.g. Wan's, so not a bare count)
    assert ctx.registry.weights_bytes(model_id) == loaded_bytes(stored, record.variant)
    # every real *.safetensors of the download (the dummy root checkpoints have no header; a
    # pricing that read them would fail outright)
    all_parameters = sum(_parameters(p) for p in replica.folder.rglob("*.safetensors") if _readable(p))
    if name in ("sd15", "sdxl"):  # twins, other-precision files and copies beside the loaded ones
        assert all_parameters >= 2 * taken_parameters

    out = _human_free(done.stdout)
    selection = select_files(replica.folder, precision)
    for path in expected:
        assert f" {path}" in out and f"taken {path}" not in out  # each listed, with its size
    for path, (_, why) in selection.left_out.items():
        assert f" {path} ({_human_free(why)})" in out
    assert f"taken: {len(expected)} files" in out
    assert f"left out: {len(selection.left_out)} files" in out
    assert f"registered {model_id} family={replica.family}" in out
    assert f"files={len(expected)} bytes={record.total_bytes} variant={precision} " in out
    if cached:
        assert f"{replica.repo_id}: snapshot {hub}" in out


def test_r1_taken_and_left_out_lines_carry_human_sizes(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path]
) -> None:
    replica = built[0]["sd15"]
    done = run_cli("models", "add", str(replica.folder), "--precision", "fp16", env=settings_env(ctx.settings))
    lines = done.stdout.splitlines()
    unet = next(line for line in lines if line.endswith("unet/diffusion_pytorch_model.fp16.safetensors"))
    size = (replica.folder / "unet/diffusion_pytorch_model.fp16.safetensors").stat().st_size
    assert 2**20 < size < 2**21 and unet.split()[:3] == ["taken", f"{size / 2**20:.1f}", "MiB"]
    index = next(line for line in lines if line.endswith(" model_index.json"))
    assert index.split()[0] == "taken" and index.split()[2] == "B"
    left = next(line for line in lines if " unet/diffusion_pytorch_model.bin " in line)
    size = (replica.folder / "unet/diffusion_pytorch_model.bin").stat().st_size
    assert left.split()[:4] == ["left", "out", f"{size / 2**20:.1f}", "MiB"]
    assert left.endswith("(.bin twin of the safetensors weights taken)")


def test_r5_the_cached_snapshot_of_a_registered_folder_is_the_same_model(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path]
) -> None:
    """Duplicates are found on the files taken: the snapshot (links) and the plain download (with
    other extras) take the same files, so the second registration names the first."""
    replicas, hub = built
    replica = replicas["flux"]
    (replica.folder / "notes.txt").write_text("an extra file nobody loads")
    try:
        first = ctx.registry.add(replica.folder, precision="fp16")
        env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
        done = run_cli("models", "add", "--from-hf-cache", replica.repo_id, "--precision", "fp16", env=env, check=False)
    finally:
        (replica.folder / "notes.txt").unlink()
    assert done.returncode != 0
    assert f"is already registered as {first.id!r}" in _human_free(done.stdout + done.stderr)


def test_r1_a_repository_missing_from_the_cache_is_refused_naming_the_cache(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path]
) -> None:
    hub = built[1]
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    done = run_cli("models", "add", "--from-hf-cache", "org/absent", env=env, check=False)
    assert done.returncode != 0
    text = _human_free(done.stdout + done.stderr)
    assert f"org/absent is not in the Hugging Face cache {hub}" in text
    assert "runwayml/stable-diffusion-v1-5" in text  # what the cache holds
    assert ctx.registry.list() == []
    neither = run_cli("models", "add", env=settings_env(ctx.settings), check=False)
    assert neither.returncode == 2 and "--from-hf-cache" in _human_free(neither.stdout + neither.stderr)


def test_a_snapshot_s_own_path_registers_as_from_the_cache_named_after_its_repository(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path]
) -> None:
    """The path people paste (``…/models--org--name/snapshots/<commit>``) is registered as
    ``--from-hf-cache org/name`` would register it: named after the repository, not its commit,
    and recorded as ``hf-cache``."""
    replicas, hub = built
    replica = replicas["sd15"]
    [snapshot] = (hub / ("models--" + replica.repo_id.replace("/", "--")) / "snapshots").iterdir()
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    done = run_cli("models", "add", str(snapshot), "--precision", "fp16", env=env)
    model_id = replica.repo_id.split("/")[-1].lower()
    assert f"{replica.repo_id}: snapshot {snapshot} (a Hugging Face cache snapshot)" in _human_free(done.stdout)
    record = ctx.registry.get(model_id)
    assert (record.source_format, record.precision) == ("hf-cache", "fp16")
    assert snapshot.name not in {m.id for m in ctx.registry.list()}
    assert (record.source_repo, record.source_revision) == (replica.repo_id, snapshot.name)
    assert f"source=hf-cache {replica.repo_id}@{snapshot.name[:12]}" in _human_free(done.stdout)


def test_a_cached_model_s_repository_and_commit_are_recorded_and_shown_by_the_api_and_models_list(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path]
) -> None:
    """``--from-hf-cache`` records which repository and which snapshot (its commit) was
    registered; ``GET /v1/models/{id}`` gives them in ``source``, ``models list`` beside the format.
    A plain folder records neither."""
    from fastapi.testclient import TestClient

    from app.api.server import create_app
    from tests.helpers import TEST_API_KEY

    replicas, hub = built
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    cached, plain = replicas["sdxl"], replicas["flux"]
    [snapshot] = (hub / ("models--" + cached.repo_id.replace("/", "--")) / "snapshots").iterdir()
    run_cli("models", "add", "--from-hf-cache", cached.repo_id, "--precision", "fp16", env=env)
    run_cli("models", "add", str(plain.folder), "--id", "plain-flux", env=env)
    cached_id = cached.repo_id.split("/")[-1].lower()
    with TestClient(create_app(ctx.settings, ctx), headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as client:
        shown = client.get(f"/v1/models/{cached_id}")
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert shown.status_code == 200, shown.text
    assert shown.json()["source"] == {
        "format": "hf-cache",
        "repo": cached.repo_id,
        "revision": snapshot.name,
        "digest": None,
    }
    assert listed["plain-flux"]["source"] == {"format": "diffusers", "repo": None, "revision": None, "digest": None}
    wide = run_cli("models", "list", env={**env, "COLUMNS": "250"}).stdout
    [row] = [line for line in wide.splitlines() if f" {cached_id} " in line]
    assert f"hf-cache {cached.repo_id}@{snapshot.name[:12]}" in row, wide


def _private_cache(hub: Path, replica: Replica, out: Path) -> Path:
    """A copy of ``replica``'s cached repository (its relative links kept) in a cache of its own."""
    name = "models--" + replica.repo_id.replace("/", "--")
    shutil.copytree(hub / name, out / name, symlinks=True)
    return out


def test_r4_every_cached_blob_is_named_as_the_hub_names_it(built: tuple[dict[str, Replica], Path]) -> None:
    """The replicas' cache is laid out as ``huggingface_hub`` downloads it: weights (Git LFS) in
    blobs named by the SHA-256 of their bytes, configs and tokenizer files by their git blob hash."""
    hub = built[1]
    blobs = sorted(hub.glob("models--*/blobs/*"))
    lfs = [b for b in blobs if len(b.name) == 64]
    git = [b for b in blobs if len(b.name) == 40]
    assert lfs and git and len(lfs) + len(git) == len(blobs)
    for blob in lfs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    for blob in git:
        data = blob.read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob.name
        assert not blob.name.endswith((".safetensors", ".bin"))


@pytest.mark.parametrize("damaged", ["unet/diffusion_pytorch_model.fp16.safetensors", "unet/config.json"])
def test_r4_a_cached_blob_damaged_after_the_download_is_refused_before_anything_is_copied(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], tmp_path: Path, damaged: str
) -> None:
    """A blob whose bytes no longer hash to its name (one weights byte flipped in place, or a
    config edited through the snapshot's link and still valid JSON) is refused, naming the file,
    the blob and both hashes: registering it would sign the damage into the manifest."""
    replicas, hub = built
    replica = replicas["sd15"]
    cache = _private_cache(hub, replica, tmp_path / "hub")
    [snapshot] = (cache / ("models--" + replica.repo_id.replace("/", "--")) / "snapshots").iterdir()
    blob = (snapshot / damaged).resolve()
    data = bytearray(blob.read_bytes())
    if damaged.endswith(".json"):
        data = bytearray(json.dumps(json.loads(data), indent=4).encode())  # still a valid config
    else:
        data[-1] ^= 0xFF  # the last tensor byte: safetensors' reader still accepts the file
    blob.write_bytes(bytes(data))
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    done = run_cli("models", "add", "--from-hf-cache", replica.repo_id, "--precision", "fp16", env=env, check=False)
    text = _human_free(done.stdout + done.stderr)
    assert done.returncode != 0, text
    assert f"{damaged} does not match its Hugging Face cache blob {blob}" in text
    found = hashlib.sha256(data).hexdigest() if len(blob.name) == 64 else None
    assert found is None or f"its bytes hash to {found}" in text
    assert "download the file again" in text
    assert ctx.registry.list() == []
    models_dir = ctx.registry.models_dir
    assert not models_dir.exists() or list(models_dir.iterdir()) == []  # nothing copied, no staging left


def test_r4_only_files_in_a_cache_s_blobs_are_checked_against_their_names(
    built: tuple[dict[str, Replica], Path], tmp_path: Path
) -> None:
    """A snapshot's link is its blob and is checked; a file named like a hash outside a ``blobs``
    folder, and a plain download's files, are checked against no name."""
    from app.store.hf_cache import blob_of, check_blob

    replicas, hub = built
    replica = replicas["sd15"]
    [snapshot] = (hub / ("models--" + replica.repo_id.replace("/", "--")) / "snapshots").iterdir()
    link = snapshot / "unet/config.json"
    assert blob_of(link) == link.resolve() and link.resolve().parent.name == "blobs"
    check_blob("unet/config.json", link)  # intact: no error
    elsewhere = tmp_path / "copies" / link.resolve().name
    elsewhere.parent.mkdir()
    elsewhere.write_text("{}")  # named like a blob, but not in a blobs folder
    assert blob_of(elsewhere) is None
    check_blob("x", elsewhere)
    assert blob_of(replica.folder / "unet/config.json") is None


def test_r4_a_damaged_cached_single_file_checkpoint_is_refused_before_it_is_converted(
    ctx: ServerContext, tmp_path: Path
) -> None:
    """A single-file checkpoint linked from a cache snapshot is checked against its blob's name
    first: nothing is converted or registered from damaged bytes."""
    repo = tmp_path / "hub" / "models--org--checkpoint"
    (repo / "blobs").mkdir(parents=True)
    data = b"not the bytes the Hub named"
    name = hashlib.sha256(b"the bytes the Hub named").hexdigest()
    (repo / "blobs" / name).write_bytes(data)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / name)
    with pytest.raises(Rejected) as refused:
        ctx.registry.add_single_file(snapshot / "model.safetensors", "sdxl")
    assert refused.value.reason == "incomplete_checkpoint"
    assert f"model.safetensors does not match its Hugging Face cache blob {repo / 'blobs' / name}" in str(refused.value)
    assert f"its bytes hash to {hashlib.sha256(data).hexdigest()}" in str(refused.value)
    assert ctx.registry.list() == []


def test_r1_an_interrupted_cached_download_is_said_and_only_its_component_falls_back_to_bin(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], tmp_path: Path
) -> None:
    """What an interrupted ``hf download`` leaves: the unet's safetensors as
    ``blobs/<hash>.incomplete`` and no snapshot link to it. The unet takes its .bin, the other
    components keep their safetensors, and the command says the cache holds an unfinished
    download (naming it and the command that finishes it)."""
    replicas, hub = built
    replica = replicas["sd15"]
    cache = _private_cache(hub, replica, tmp_path / "hub")
    repo = cache / ("models--" + replica.repo_id.replace("/", "--"))
    [snapshot] = (repo / "snapshots").iterdir()
    link = snapshot / "unet/diffusion_pytorch_model.safetensors"
    partial = repo / "blobs" / f"{link.resolve().name}.incomplete"
    partial.write_bytes(link.read_bytes()[:1000])
    link.unlink()
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    done = run_cli("models", "add", "--from-hf-cache", replica.repo_id, "--id", "cut-short", env=env)
    said = _human_free(done.stderr)
    assert f"warning: the cache of {replica.repo_id} holds 1 interrupted download(s) ({partial.name})" in said
    assert f"(`hf download {replica.repo_id}`)" in said
    weights = sorted(
        f.path for f in ctx.registry.manifest("cut-short").files if f.path.endswith((".bin", ".safetensors"))
    )
    assert weights == [
        "safety_checker/model.safetensors",
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.bin",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    clean = run_cli("models", "add", "--from-hf-cache", replica.repo_id, env={**env, "HF_HUB_CACHE": str(hub)})
    assert "interrupted" not in clean.stderr  # a finished download says nothing


def test_r1_a_misnamed_folder_is_told_what_to_register_before_its_files_are_read(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], tmp_path: Path
) -> None:
    """What people paste instead of a pipeline folder: the cache's repository folder (with a
    broken link among files no pipeline loads, which must not hide the hint), a component's
    folder (whose weights are no single-file checkpoint), and an unknown precision."""
    replicas, hub = built
    replica = replicas["sd15"]
    cache = _private_cache(hub, replica, tmp_path / "hub")
    repo = cache / ("models--" + replica.repo_id.replace("/", "--"))
    [snapshot] = (repo / "snapshots").iterdir()
    (snapshot / "v1-5-pruned.ckpt").resolve().unlink()  # a root checkpoint no pipeline loads, its blob gone
    env = settings_env(ctx.settings)
    done = run_cli("models", "add", str(repo), env=env, check=False)
    said = _human_free(done.stderr)
    assert done.returncode == 2, said
    assert f"It is the Hugging Face cache folder of {replica.repo_id}: register its snapshot with" in said, said
    assert "broken link" not in said
    snapshots = _human_free(run_cli("models", "add", str(repo / "snapshots"), env=env, check=False).stderr)
    assert f"It is the Hugging Face cache folder of {replica.repo_id}" in snapshots, snapshots
    # the command it suggests keeps the options given (an fp16-only cache needs its --precision)
    asked = run_cli("models", "add", str(repo), "--precision", "fp16", "--id", "q1", env=env, check=False)
    assert f"`homefleet models add --from-hf-cache {replica.repo_id} --precision fp16 --id q1`" in _human_free(
        asked.stderr
    ), asked.stderr
    root = _human_free(run_cli("models", "add", str(cache), env=env, check=False).stderr)
    assert f"It is a Hugging Face cache ({replica.repo_id}): register a repository's snapshot with" in root, root
    assert f"--from-hf-cache {replica.repo_id}` (HF_HUB_CACHE={cache})" in root

    component = run_cli("models", "add", str(replica.folder / "unet"), env=env, check=False)
    said = _human_free(component.stderr)
    assert component.returncode == 2, said
    assert (
        f"It is the unet component (UNet2DConditionModel) of the pipeline in {replica.folder}: register that "
        f"folder, the one holding model_index.json (`homefleet models add {replica.folder}`)"
    ) in said, said
    assert "--family" not in said  # its weights are no single-file checkpoint

    fp8 = run_cli("models", "add", str(replica.folder), "--precision", "fp8", env=env, check=False)
    said = _human_free(fp8.stderr)
    assert (
        fp8.returncode == 2 and "error (invalid_variant): precision must be one of fp32, bf16, fp16, got 'fp8'" in said
    )
    assert ctx.registry.list() == []


def test_r1_the_commands_suggested_for_a_repository_folder_of_another_cache_register_it(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], tmp_path: Path
) -> None:
    """A repository folder of a cache that is not the configured one (a second disk, another
    user's cache): the ``--from-hf-cache`` command it suggests says which ``HF_HUB_CACHE`` it
    needs, and the snapshot it names (the one ``refs/main`` names) registers as it is written."""
    import re

    replicas, hub = built
    replica = replicas["sd15"]
    cache = _private_cache(hub, replica, tmp_path / "other disk" / "hub")
    repo = cache / ("models--" + replica.repo_id.replace("/", "--"))
    main = (repo / "refs" / "main").read_text().strip()
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(tmp_path / "configured"), "HF_HOME": None}
    said = _human_free(run_cli("models", "add", str(repo), env=env, check=False).stderr)
    suggested = re.search(r"`homefleet models add --from-hf-cache (\S+)` \(HF_HUB_CACHE=(.+?)\) \(or name", said)
    assert suggested is not None, said
    assert suggested[1] == replica.repo_id
    done = run_cli(
        "models", "add", "--from-hf-cache", suggested[1], "--id", "q-cache", env={**env, "HF_HUB_CACHE": suggested[2]}
    )
    assert "registered q-cache" in done.stdout, done.stdout + done.stderr
    assert f"the snapshot refs/main names, {repo / 'snapshots' / main})" in said, said
    run_cli("models", "add", str(repo / "snapshots" / main), "--id", "q-snapshot", env=env)
    assert ctx.registry.get("q-snapshot").source_revision == ctx.registry.get("q-cache").source_revision == main
    same = _human_free(run_cli("models", "add", str(repo), env={**env, "HF_HUB_CACHE": str(cache)}, check=False).stderr)
    assert f"`homefleet models add --from-hf-cache {replica.repo_id}` (or name" in same, same  # the configured cache


def test_r4_a_snapshot_file_that_is_no_blob_link_and_a_broken_link_left_out_are_said(
    ctx: ServerContext, built: tuple[dict[str, Replica], Path], tmp_path: Path
) -> None:
    """A config edited with a tool that writes a new file over the snapshot's link (``sed -i``)
    is no blob any more: registered as it is, and said to be unchecked; a left-out file whose
    blob is gone is listed as a broken link."""
    replicas, hub = built
    replica = replicas["sd15"]
    cache = _private_cache(hub, replica, tmp_path / "hub")
    [snapshot] = (cache / ("models--" + replica.repo_id.replace("/", "--")) / "snapshots").iterdir()
    config = snapshot / "unet/config.json"
    text = config.read_text()
    config.unlink()
    config.write_text(text)  # a file in place of its link
    (snapshot / "v1-5-pruned.ckpt").resolve().unlink()
    env = {**settings_env(ctx.settings), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": None}
    done = run_cli("models", "add", "--from-hf-cache", replica.repo_id, "--id", "edited", env=env)
    said = _human_free(done.stderr)
    assert "warning: 1 file(s) of this snapshot are no links into the cache's blobs (unet/config.json)" in said
    assert "unchecked against the hashes the Hub gave them" in said
    [line] = [line for line in done.stdout.splitlines() if " v1-5-pruned.ckpt " in line]
    assert line.endswith("; a broken link: its target is missing)"), line
    assert ctx.registry.get("edited").source_format == "hf-cache"
