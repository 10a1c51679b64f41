"""What registration takes from a model folder (app/store/selection.py; docs/operations.md, "What
registration takes"): exactly the files the pipeline loads, selected as diffusers selects them, on
faithful tiny replicas of real repositories (app/devtools/replicas.py), plain and as a Hugging Face
cache, and on small hand-made layouts for the rules the replicas do not reach."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from app.core.errors import Rejected
from app.core.variants import stored_variant
from app.devtools.replicas import REPLICAS, Replica, as_hf_cache, make_replica
from app.store.selection import cached_snapshot, check_shards, hub_cache_dir, select_files


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Replica, Path]]:
    """Every replica, plain and laid out in one Hugging Face cache: name -> (replica, snapshot)."""
    out = tmp_path_factory.mktemp("replicas")
    built = {}
    for name in REPLICAS:
        replica = make_replica(name, out / "plain")
        built[name] = (replica, as_hf_cache(replica, out / "hub"))
    return built


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(REPLICAS))
def test_r1_each_replica_takes_exactly_what_its_pipeline_loads_plain_and_from_the_cache(
    replicas: dict[str, tuple[Replica, Path]], name: str, precision: str
) -> None:
    replica, snapshot = replicas[name]
    plain = select_files(replica.folder, precision)
    cached = select_files(snapshot, precision)
    assert set(plain.taken) == set(replica.expected[precision])
    assert plain.taken == cached.taken  # links followed: the blobs' sizes
    assert plain.left_out == cached.left_out
    everything = {
        p.relative_to(replica.folder).as_posix(): p.stat().st_size for p in replica.folder.rglob("*") if p.is_file()
    }
    assert {**plain.taken, **{p: size for p, (size, _) in plain.left_out.items()}} == everything
    assert plain.taken_bytes + plain.left_out_bytes == sum(everything.values())
    assert plain.source_format == "diffusers"
    assert plain.variant == ("fp16" if precision == "fp16" and name in ("sd15", "sdxl") else None)


def test_r1_sd15_leaves_out_twins_other_precision_null_components_and_root_checkpoints(
    replicas: dict[str, tuple[Replica, Path]],
) -> None:
    replica, _ = replicas["sd15"]
    fp16 = select_files(replica.folder, "fp16")
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in fp16.taken
    why = {path: reason for path, (_, reason) in fp16.left_out.items()}
    assert why["unet/diffusion_pytorch_model.safetensors"] == (
        "full-precision weights; this model takes the fp16 variant for unet"
    )
    assert why["unet/diffusion_pytorch_model.bin"] == ".bin twin of the safetensors weights taken"
    assert why["unet/diffusion_pytorch_model.non_ema.safetensors"] == "non_ema weights, not loaded by the pipeline"
    assert why["unet/diffusion_pytorch_model.non_ema.bin"] == "non_ema weights, not loaded by the pipeline"  # no twin
    assert "safety_checker/model.fp16.safetensors" in fp16.taken  # a transformers model in a pipeline module
    assert why["safety_checker/model.safetensors"] == (
        "full-precision weights; this model takes the fp16 variant for safety_checker"
    )
    assert why["safety_checker/pytorch_model.fp16.bin"] == ".bin twin of the safetensors weights taken"
    assert why["v1-5-pruned-emaonly.safetensors"].startswith("weights at the root (single-file checkpoint")
    assert why["v1-inference.yaml"] == "not loaded (at the root the pipeline reads model_index.json only)"
    fp32 = {path: reason for path, (_, reason) in select_files(replica.folder, "fp32").left_out.items()}
    assert fp32["unet/diffusion_pytorch_model.fp16.safetensors"] == (
        "fp16 variant; this model takes full precision for unet"
    )
    assert len(fp16.taken) == 15 and len(fp16.left_out) == 21
    # the fp16 files hold real float16 tensors: half the full-precision bytes, nearly
    assert fp16.taken_bytes < 0.55 * select_files(replica.folder, "fp32").taken_bytes


def test_r1_a_component_set_to_null_is_left_out_naming_why(
    replicas: dict[str, tuple[Replica, Path]], tmp_path: Path
) -> None:
    """The safety checker switched off as people do: ``[null, null]`` in model_index.json; the
    pipeline then loads none, so its files are left out, each saying why."""
    replica, _ = replicas["sd15"]
    folder = Path(shutil.copytree(replica.folder, tmp_path / "no-checker"))
    index = json.loads((folder / "model_index.json").read_text())
    index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    (folder / "model_index.json").write_text(json.dumps(index))
    selection = select_files(folder, "fp16")
    why = {path: reason for path, (_, reason) in selection.left_out.items()}
    for path in ("safety_checker/model.fp16.safetensors", "safety_checker/config.json"):
        assert path not in selection.taken
        assert why[path] == "component 'safety_checker' is null in model_index.json"
    assert why["feature_extractor/preprocessor_config.json"] == (
        "component 'feature_extractor' is null in model_index.json"
    )
    assert len(selection.taken) == 12


def test_r1_sdxl_leaves_out_exports_and_unlisted_folders(replicas: dict[str, tuple[Replica, Path]]) -> None:
    replica, _ = replicas["sdxl"]
    why = {path: reason for path, (_, reason) in select_files(replica.folder, "fp16").left_out.items()}
    assert why["unet/diffusion_flax_model.msgpack"] == "flax weights, not loaded"
    assert why["unet/model.onnx"] == why["unet/model.onnx_data"] == "ONNX export, not loaded"
    assert why["text_encoder_2/openvino_model.bin"] == "OpenVINO export, not loaded"
    assert why["vae_1_0/diffusion_pytorch_model.fp16.safetensors"] == "folder not named in model_index.json"
    assert why["vae_decoder/model.onnx"] == "folder not named in model_index.json"
    assert why["sd_xl_base_1.0.safetensors"].startswith("weights at the root")
    assert why["01.png"] == "image or video, not loaded"


def test_r1_flux_and_wan_take_their_shards_with_the_index(replicas: dict[str, tuple[Replica, Path]]) -> None:
    flux = select_files(replicas["flux"][0].folder, "fp16")
    assert {p for p in flux.taken if p.startswith("transformer/")} == {
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        *(f"transformer/diffusion_pytorch_model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)),
    }
    assert {p for p in flux.taken if p.startswith("text_encoder_2/")} == {
        "text_encoder_2/config.json",
        "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
    }
    assert sorted(flux.left_out) == [
        "LICENSE.md",
        "README.md",
        "ae.safetensors",
        "dev_grid.jpg",
        "flux1-dev.safetensors",
    ]
    wan = select_files(replicas["wan"][0].folder, "fp32")
    assert sum(p.startswith("text_encoder/model-0000") for p in wan.taken) == 5
    assert {reason for path, (_, reason) in wan.left_out.items() if path.startswith(("assets/", "examples/"))} == {
        "folder not named in model_index.json"
    }


def _write(folder: Path, *paths: str, size: int = 16) -> None:
    for path in paths:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(b"x" * size)


def _shard_index(folder: Path, index: str, *shards: str) -> None:
    """A shard index as ``save_pretrained`` writes it: tensor -> the shard beside it holding it."""
    weight_map = {f"tensor.{k}": shard for k, shard in enumerate(shards)}
    (folder / index).parent.mkdir(parents=True, exist_ok=True)
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map}))


def _index(folder: Path, **components: list[str | None]) -> None:
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline", **components}))


def test_r1_shards_whose_index_has_a_name_the_loader_does_not_read_are_refused_naming_it(tmp_path: Path) -> None:
    """fp16 shards indexed by ``diffusion_pytorch_model.fp16.safetensors.index.json`` (a name
    diffusers does not read; it reads ``….safetensors.index.fp16.json``): refused
    ``incomplete_model`` naming that file and the name to give it, not "the index is missing".
    Full-precision shards without their index are told it is missing: the fp16 index beside
    them names other shards and is not blamed."""
    _index(tmp_path, transformer=["diffusers", "FluxTransformer2DModel"])
    half = [f"diffusion_pytorch_model.fp16-0000{k}-of-00002.safetensors" for k in (1, 2)]
    full = [f"diffusion_pytorch_model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    _write(tmp_path, "transformer/config.json", *(f"transformer/{name}" for name in half + full))
    _shard_index(tmp_path, "transformer/diffusion_pytorch_model.fp16.safetensors.index.json", *half)
    with pytest.raises(Rejected) as fp16:
        check_shards(tmp_path, select_files(tmp_path, "fp16").taken)
    assert fp16.value.reason == "incomplete_model"
    assert "the folder holds transformer/diffusion_pytorch_model.fp16.safetensors.index.json" in fp16.value.message
    assert "diffusion_pytorch_model.safetensors.index.fp16.json): rename it" in fp16.value.message
    with pytest.raises(Rejected) as fp32:
        check_shards(tmp_path, select_files(tmp_path, "fp32").taken)
    assert "the index is missing" in fp32.value.message and "fp16.safetensors.index" not in fp32.value.message


def test_r1_a_sharded_fp16_variant_takes_its_variant_index_and_a_component_without_fp16_its_plain_files(
    tmp_path: Path,
) -> None:
    _index(
        tmp_path,
        transformer=["diffusers", "FluxTransformer2DModel"],
        vae=["diffusers", "AutoencoderKL"],
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
    )
    _write(
        tmp_path,
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "scheduler/scheduler_config.json",
    )
    shards = [f"diffusion_pytorch_model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    _shard_index(tmp_path, "transformer/diffusion_pytorch_model.safetensors.index.json", *shards)
    half = [f"diffusion_pytorch_model.fp16-0000{k}-of-00002.safetensors" for k in (1, 2)]
    _shard_index(tmp_path, "transformer/diffusion_pytorch_model.safetensors.index.fp16.json", *half)
    fp16 = select_files(tmp_path, "fp16")
    assert set(fp16.taken) == {
        "model_index.json",
        "scheduler/scheduler_config.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.fp16.json",
    }
    assert fp16.variant == "fp16"
    assert fp16.left_out["transformer/diffusion_pytorch_model.safetensors.index.json"][1] == (
        "full-precision weights; this model takes the fp16 variant for transformer"
    )
    fp32 = select_files(tmp_path, "fp32")
    assert "transformer/diffusion_pytorch_model.safetensors.index.json" in fp32.taken
    assert fp32.left_out["transformer/diffusion_pytorch_model.safetensors.index.fp16.json"][1] == (
        "fp16 variant; this model takes full precision for transformer"
    )
    bf16 = select_files(tmp_path, "bf16")  # no bf16 files anywhere: full precision, as fp32
    assert bf16.taken == fp32.taken and bf16.variant is None


@pytest.mark.parametrize("vae_has_bin", [True, False])
def test_r1_each_component_takes_its_safetensors_where_it_has_them_else_its_bin(
    tmp_path: Path, vae_has_bin: bool
) -> None:
    """A folder on disk loads each component's own files (``from_pretrained`` of a local folder:
    safetensors where present, else .bin): a unet with only .bin weights takes them, and a vae
    with both keeps its safetensors, its .bin a twin left out (diffusers' rule for a download,
    .bin for all as soon as one lacks safetensors, would take pickled weights for nothing)."""
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"], vae=["diffusers", "AutoencoderKL"])
    files = ["unet/config.json", "unet/diffusion_pytorch_model.bin", "vae/config.json"]
    files += ["vae/diffusion_pytorch_model.safetensors", *(["vae/diffusion_pytorch_model.bin"] if vae_has_bin else [])]
    _write(tmp_path, *files)
    taken = select_files(tmp_path, "fp32")
    assert set(taken.taken) == {
        "model_index.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.bin",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
    }
    if vae_has_bin:
        assert taken.left_out["vae/diffusion_pytorch_model.bin"][1] == ".bin twin of the safetensors weights taken"


def test_r1_an_interrupted_download_s_component_alone_falls_back_to_its_bin_and_the_pipeline_loads(
    tmp_path: Path,
) -> None:
    """SD 1.5 as downloaded with its .bin twins, the unet's safetensors missing (a download cut
    short): only the unet takes its .bin; every other component keeps its safetensors, and what
    is taken loads as the pipeline."""
    from diffusers import StableDiffusionPipeline

    replica = make_replica("sd15", tmp_path / "plain")
    (replica.folder / "unet/diffusion_pytorch_model.safetensors").unlink()
    chosen = select_files(replica.folder, "fp32")
    weights = sorted(p for p in chosen.taken if p.endswith((".safetensors", ".bin")))
    assert weights == [
        "safety_checker/model.safetensors",
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.bin",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    copy = tmp_path / "taken"
    for path in chosen.taken:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(replica.folder / path, copy / path)
    pipeline = StableDiffusionPipeline.from_pretrained(copy, local_files_only=True)
    assert pipeline.unet is not None and pipeline.vae is not None


def test_r1_only_the_component_without_loadable_weights_is_named(tmp_path: Path) -> None:
    """SD 1.5 without .bin twins and its unet's full-precision safetensors gone: the refusal
    names the unet alone, not the components whose weights are fine."""
    replica = make_replica("sd15", tmp_path / "plain")
    for twin in replica.folder.rglob("*.bin"):
        twin.unlink()
    (replica.folder / "unet/diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(Rejected) as refused:
        select_files(replica.folder, "fp32")
    assert refused.value.reason == "no_loadable_weights"
    assert f"{replica.folder}: component(s) unet hold weights but none a full-precision" in refused.value.message
    assert select_files(replica.folder, "fp16").taken["unet/diffusion_pytorch_model.fp16.safetensors"] > 0


def test_r1_a_component_with_only_other_precision_weights_is_refused_by_name(tmp_path: Path) -> None:
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"])
    _write(tmp_path, "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(Rejected, match=r"component.s. unet hold weights but none a full-precision") as refused:
        select_files(tmp_path, "fp32")
    assert refused.value.reason == "no_loadable_weights"
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in select_files(tmp_path, "fp16").taken


@pytest.mark.parametrize(
    ("content", "wrong"),
    [
        ("{", "is not valid JSON (Expecting property name"),
        ("[]", "holds an array, not a JSON object"),
        ("null", "holds null"),
    ],
)
def test_r1_a_model_index_that_is_no_json_object_is_refused_naming_it(tmp_path: Path, content: str, wrong: str) -> None:
    (tmp_path / "model_index.json").write_text(content)
    with pytest.raises(Rejected) as refused:
        select_files(tmp_path, "fp32")
    assert refused.value.reason == "not_a_model"
    assert refused.value.message.startswith(f"{tmp_path / 'model_index.json'} {wrong}"), refused.value.message


def test_r4_a_broken_link_among_the_files_taken_is_refused_by_name(tmp_path: Path) -> None:
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"])
    _write(tmp_path, "unet/config.json")
    os.symlink("../../blobs/0123", tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(Rejected, match=r"unet/diffusion_pytorch_model.safetensors is a broken link") as refused:
        select_files(tmp_path, "fp32")
    assert refused.value.reason == "incomplete_model"


def test_r4_several_broken_links_are_named_together_in_the_plural(tmp_path: Path) -> None:
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"], vae=["diffusers", "AutoencoderKL"])
    _write(tmp_path, "unet/config.json", "vae/config.json")
    for component in ("unet", "vae"):
        os.symlink("../../blobs/0123", tmp_path / component / "diffusion_pytorch_model.safetensors")
    with pytest.raises(Rejected) as refused:
        select_files(tmp_path, "fp32")
    assert refused.value.message == (
        f"{tmp_path}: unet/diffusion_pytorch_model.safetensors, vae/diffusion_pytorch_model.safetensors are "
        "broken links (their targets are missing: an interrupted download?); download the model again"
    )


def test_r4_a_component_config_that_is_a_broken_link_is_named_as_one_not_as_missing(tmp_path: Path) -> None:
    """A cache snapshot whose config blob is gone: the link is named with its target, not called
    a missing config."""
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"])
    _write(tmp_path, "unet/diffusion_pytorch_model.safetensors")
    os.symlink("../../../blobs/4f2c", tmp_path / "unet" / "config.json")
    with pytest.raises(Rejected) as refused:
        select_files(tmp_path, "fp32")
    assert (refused.value.reason, refused.value.message) == (
        "incomplete_model",
        f"{tmp_path}: unet/config.json is a broken link (its target ../../../blobs/4f2c is missing: an "
        "interrupted download?); download the model again",
    )


def test_r1_a_transformers_folder_takes_config_tokenizer_and_safetensors_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    _write(
        tmp_path,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "README.md",
        "onnx/model.onnx",
        "original/consolidated.00.pth",
    )
    _shard_index(
        tmp_path, "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    )
    _shard_index(
        tmp_path, "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"
    )
    selection = select_files(tmp_path, "fp16")
    assert selection.source_format == "transformers"
    assert set(selection.taken) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "chat_template.jinja",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    }
    why = {path: reason for path, (_, reason) in selection.left_out.items()}
    assert why["pytorch_model.bin.index.json"] == ".bin twin of the safetensors weights taken"
    assert why["onnx/model.onnx"] == "in a subfolder (transformers loads the folder's root files)"
    assert why["README.md"] == "not loaded by transformers (config, tokenizer and weights only)"


def test_r1_stored_variant_names_the_variant_files_a_stored_folder_holds(
    replicas: dict[str, tuple[Replica, Path]], tmp_path: Path
) -> None:
    replica, _ = replicas["sd15"]
    for precision, expected in (("fp16", "fp16"), ("fp32", None)):
        stored = tmp_path / precision
        for path in select_files(replica.folder, precision).taken:
            (stored / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(replica.folder / path, stored / path)
        assert stored_variant(stored) == expected
    assert stored_variant(replica.folder) == "fp16"  # the download holds fp16 files too
    assert stored_variant(tmp_path) is None  # no model_index.json


def test_r1_the_cached_snapshot_is_found_without_network_by_branch_or_commit(
    replicas: dict[str, tuple[Replica, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    replica, snapshot = replicas["flux"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(snapshot.parents[2]))
    assert hub_cache_dir() == snapshot.parents[2]
    assert cached_snapshot(replica.repo_id) == snapshot
    assert cached_snapshot(replica.repo_id, revision=snapshot.name) == snapshot
    assert all(
        link.is_symlink() and not os.path.isabs(os.readlink(link)) for link in snapshot.rglob("*") if not link.is_dir()
    )
    with pytest.raises(
        Rejected,
        match=rf"org/absent is not in the Hugging Face cache {snapshot.parents[2]} .*"
        r"it holds: .*black-forest-labs/FLUX.1-dev",
    ) as refused:
        cached_snapshot("org/absent")
    assert refused.value.reason == "not_in_hf_cache"
    with pytest.raises(
        Rejected,
        match=rf"{replica.repo_id} is in the Hugging Face cache .* but not at revision v9 "
        rf".*its cached refs: main; its snapshots: {snapshot.name} \(pass a ref or a snapshot's commit",
    ):
        cached_snapshot(replica.repo_id, revision="v9")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", "/somewhere/hf")
    assert hub_cache_dir() == Path("/somewhere/hf/hub")


def test_r1_a_cached_snapshot_is_found_by_its_shortened_commit_as_models_list_shows_it(
    replicas: dict[str, tuple[Replica, Path]], tmp_path: Path
) -> None:
    """``models list`` shows a cached model's commit by its first 12 hex digits: given back to
    ``--revision``, it names that snapshot, also when ``refs/main`` has moved to another; a
    prefix several snapshots share, or none, is refused naming the snapshots there are."""
    replica, snapshot = replicas["sd15"]
    cache = tmp_path / "hub"
    name = snapshot.parents[1].name
    shutil.copytree(snapshot.parents[1], cache / name, symlinks=True)
    repo = cache / name
    old = repo / "snapshots" / snapshot.name
    newer, sibling = "ab12" * 10, "ab13" * 10  # two later commits sharing their first three digits
    for commit in (newer, sibling):
        shutil.copytree(old, repo / "snapshots" / commit, symlinks=True)
    (repo / "refs" / "main").write_text(newer)
    assert cached_snapshot(replica.repo_id, cache_dir=cache) == repo / "snapshots" / newer
    assert cached_snapshot(replica.repo_id, snapshot.name[:12], cache_dir=cache) == old
    assert cached_snapshot(replica.repo_id, "ab12ab1", cache_dir=cache) == repo / "snapshots" / newer
    with pytest.raises(Rejected, match=r"not at revision ab1ab1a") as unknown:
        cached_snapshot(replica.repo_id, "ab1ab1a", cache_dir=cache)
    assert unknown.value.reason == "not_in_hf_cache"
    assert f"its snapshots: {', '.join(sorted([newer, sibling, snapshot.name]))} (" in unknown.value.message
    (repo / "snapshots" / ("ab12ab1" + "0" * 33)).mkdir()
    with pytest.raises(Rejected, match=r"revision ab12ab1 is the start of 2 snapshots' commits") as ambiguous:
        cached_snapshot(replica.repo_id, "ab12ab1", cache_dir=cache)
    assert ambiguous.value.reason == "not_in_hf_cache"


def test_r1_weights_in_a_components_subfolder_are_left_out_saying_so(tmp_path: Path) -> None:
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"])
    _write(
        tmp_path,
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "unet/old/diffusion_pytorch_model.safetensors",
    )
    taken = select_files(tmp_path, "fp32")
    assert "unet/old/diffusion_pytorch_model.safetensors" not in taken.taken
    assert taken.left_out["unet/old/diffusion_pytorch_model.safetensors"][1] == (
        "in a subfolder of unet, which the pipeline does not read"
    )


def test_r1_a_link_to_a_folder_that_holds_it_is_not_followed(tmp_path: Path) -> None:
    """``unet/loop -> ..`` listed the model again at every depth (522 left-out lines, 183 MiB
    of a 4.6 MiB model) until the system's path limit; a link elsewhere is still followed."""
    import os

    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"])
    _write(tmp_path, "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "common/notes.txt")
    os.symlink("..", tmp_path / "unet" / "loop")
    os.symlink(".", tmp_path / "unet" / "self")
    os.symlink("../common", tmp_path / "unet" / "elsewhere")
    selection = select_files(tmp_path, "fp32")
    listed = [*selection.taken, *selection.left_out]
    assert not any("/loop/" in p or "/self/" in p for p in listed), listed
    assert "unet/elsewhere/notes.txt" in selection.left_out
    assert set(selection.taken) == {"model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors"}


def test_r1_a_tokenizers_subfolders_are_left_out_as_the_pipeline_reads_none(tmp_path: Path) -> None:
    """A tokenizer (or scheduler) reads its own folder's files: a subfolder there, or a link to
    /usr/share/doc, was taken whole (5,425 files, 152 MiB copied and synced to every machine)."""
    _index(tmp_path, unet=["diffusers", "UNet2DConditionModel"], tokenizer=["transformers", "CLIPTokenizer"])
    _write(
        tmp_path,
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "tokenizer/vocab.json",
        "tokenizer/old/big.bin",
        "tokenizer/old/tokenizer_config.json",
    )
    selection = select_files(tmp_path, "fp32")
    assert "tokenizer/vocab.json" in selection.taken
    for path in ("tokenizer/old/big.bin", "tokenizer/old/tokenizer_config.json"):
        assert selection.left_out[path][1] == "in a subfolder of tokenizer, which the pipeline does not read", path


def test_r1_hidden_files_and_backups_are_left_out_wherever_they_sit(
    replicas: dict[str, tuple[Replica, Path]], tmp_path: Path
) -> None:
    """A model folder copied on a Mac or edited by hand: ``.DS_Store`` in every folder, macOS's
    AppleDouble ``._vocab.json`` (not JSON: it refused the whole model as damaged), an editor's
    ``scheduler_config.json.bak`` and ``config.json~``. No loader reads them; taken, they were
    hashed and synced, and a Finder's touch of ``.DS_Store`` withdrew the model (R4, R5)."""
    replica, _ = replicas["sd15"]
    folder = tmp_path / "dreamshaper_8 (diffusers)"
    shutil.copytree(replica.folder, folder)
    before = select_files(folder, "fp32")
    junk = [".DS_Store", "tokenizer/.DS_Store", "tokenizer/._vocab.json", "scheduler/scheduler_config.json.bak"]
    junk += ["text_encoder/config.json~", "unet/.gitattributes"]
    for path in junk:
        (folder / path).write_bytes(b"\x00\x05\x16\x07 not JSON")
    after = select_files(folder, "fp32")
    assert after.taken == before.taken and set(junk) <= set(after.left_out)
    whole_folders = ["tokenizer/.DS_Store", "tokenizer/._vocab.json", "scheduler/scheduler_config.json.bak"]
    said = "a hidden file or an editor's backup (no loader reads it)"  # folders taken whole but for these
    assert {path: after.left_out[path][1] for path in whole_folders} == dict.fromkeys(whole_folders, said)


def test_a_cache_repository_folder_named_instead_of_its_snapshot_is_told_how_to_register_it(
    replicas: dict[str, tuple[Replica, Path]],
) -> None:
    """``models add ~/.cache/huggingface/hub/models--org--name`` (the folder a file browser shows)
    is no model folder: the refusal names ``--from-hf-cache org/name`` and the snapshots."""
    from app.store.registry import describe_pipeline

    _, snapshot = replicas["sd15"]
    repository = snapshot.parent.parent
    with pytest.raises(Rejected) as refused:
        describe_pipeline(repository)
    repo = repository.name.removeprefix("models--").replace("--", "/")
    assert refused.value.reason == "not_a_model"
    assert f"register its snapshot with `homefleet models add --from-hf-cache {repo}`" in refused.value.message


def test_a_ref_naming_a_snapshot_the_cache_lacks_is_said_as_such(
    replicas: dict[str, tuple[Replica, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``refs/main`` names a commit whose snapshot folder is gone (a download interrupted or a
    cache cleaned by hand; the ref ends with a newline as the hub writes it): the refusal names
    the ref, the missing commit and the snapshots there are, not "not at revision main; its
    cached refs: main"."""
    _, snapshot = replicas["sd15"]
    cache = tmp_path / "hub"
    shutil.copytree(snapshot.parents[2], cache, symlinks=True)
    repo = cache / snapshot.parents[1].name
    repo_id = repo.name.removeprefix("models--").replace("--", "/")
    (repo / "refs" / "main").write_text("0" * 40 + "\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Rejected) as refused:
        cached_snapshot(repo_id, cache_dir=cache)
    assert refused.value.reason == "not_in_hf_cache"
    assert f"its ref main names snapshot {'0' * 40}, which is not in {repo / 'snapshots'}" in refused.value.message
    assert f"its snapshots: {snapshot.name}" in refused.value.message


def _add_shards(model: object, folder: Path, shard_bytes: int) -> list[str]:
    """Save ``model`` (a diffusers or transformers model) sharded beside the single weights file
    ``folder`` already holds, as ``save_pretrained(max_shard_size=…)`` writes them: the shards
    and their index; returns their names."""
    staging = folder.parent / f".{folder.name}-sharded"
    model.save_pretrained(staging, max_shard_size=shard_bytes)  # type: ignore[attr-defined]
    names = sorted(p.name for p in staging.iterdir() if ".index." in p.name or "-of-" in p.name)
    assert any("-00002-of-" in n for n in names), names  # really sharded
    for name in names:
        shutil.move(str(staging / name), folder / name)
    shutil.rmtree(staging)
    return names


def test_r1_a_folder_with_one_weights_file_and_its_shards_takes_what_its_loader_reads(tmp_path: Path) -> None:
    """Some downloads hold a component's weights twice: one file and shards with their index.
    diffusers loads the shards (an index present makes its load sharded), transformers the single
    file (``model.safetensors`` before the index): registration takes that one only, and what it
    takes loads, tensor for tensor."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    replica = make_replica("sd15", tmp_path / "plain")
    unet_folder, encoder_folder = replica.folder / "unet", replica.folder / "text_encoder"
    unet = UNet2DConditionModel.from_pretrained(unet_folder)
    encoder = CLIPTextModel.from_pretrained(encoder_folder)
    unet_shards = _add_shards(unet, unet_folder, 1_000_000)
    encoder_shards = _add_shards(encoder, encoder_folder, 60_000)

    chosen = select_files(replica.folder, "fp32")
    taken = set(chosen.taken)
    why = {path: reason for path, (_, reason) in chosen.left_out.items()}
    assert {f"unet/{n}" for n in unet_shards} <= taken
    assert "unet/diffusion_pytorch_model.safetensors" not in taken
    assert why["unet/diffusion_pytorch_model.safetensors"] == (
        "single-file twin of the shards diffusers loads through unet/diffusion_pytorch_model.safetensors.index.json"
    )
    assert "text_encoder/model.safetensors" in taken
    assert not {f"text_encoder/{n}" for n in encoder_shards} & taken
    assert why["text_encoder/model.safetensors.index.json"] == (
        "sharded twin of text_encoder/model.safetensors, which transformers loads first"
    )

    copy = tmp_path / "taken"  # what a worker receives loads, and holds the same tensors
    for path in taken:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(replica.folder / path, copy / path)
    loaded_unet = UNet2DConditionModel.from_pretrained(copy / "unet")
    loaded_encoder = CLIPTextModel.from_pretrained(copy / "text_encoder")
    for mine, theirs in ((loaded_unet, unet), (loaded_encoder, encoder)):
        ours, reference = mine.state_dict(), theirs.state_dict()
        assert ours.keys() == reference.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_r1_a_causal_lm_with_model_safetensors_and_its_shards_takes_the_single_file(tmp_path: Path) -> None:
    """A transformers causal LM's root: ``model.safetensors`` is what transformers loads when its
    shards and index sit beside it; the shards are left out, the weights counted once."""
    from transformers import AutoModelForCausalLM

    from app.devtools.tiny_text import make_tiny_text

    folder = make_tiny_text(tmp_path, ("llama",))["llama"]
    single_bytes = (folder / "model.safetensors").stat().st_size
    shards = _add_shards(AutoModelForCausalLM.from_pretrained(folder), folder, single_bytes // 3)
    chosen = select_files(folder, "fp32")
    assert "model.safetensors" in chosen.taken
    assert not set(shards) & set(chosen.taken)
    assert sum(size for path, size in chosen.taken.items() if path.endswith(".safetensors")) == single_bytes
    assert {chosen.left_out[n][1] for n in shards} == {
        "sharded twin of model.safetensors, which transformers loads first"
    }
