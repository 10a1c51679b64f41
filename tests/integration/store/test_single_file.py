"""Single-file checkpoints registered through the CLI (``homefleet models add FILE --family``,
docs/operations.md "Single-file checkpoints"; R1, R4): tiny checkpoints in the original key
layout (app/devtools/tiny_single_file.py) are converted once, at registration, by diffusers'
own single-file loader into a diffusers folder holding exactly the weights they were made
from; files that are not a checkpoint of the named family are refused naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from app.context import ServerContext
from app.core.config import Settings
from app.core.digest import file_digest
from app.devtools.tiny_models import make_tiny_lora
from app.devtools.tiny_single_file import make_tiny_sdxl_single_file_base, make_tiny_single_file
from app.store.registry import describe_pipeline
from tests.helpers import run_cli, settings_env, write_safetensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> dict[str, Path]:
    """family -> (its diffusers folder, its single-file checkpoint): sd1 from tiny-sd, sdxl from a
    tiny SDXL base whose two text encoders differ in width, flux from tiny-flux's transformer."""
    out = tmp_path_factory.mktemp("single-files")
    sdxl = make_tiny_sdxl_single_file_base(out / "tiny-sdxl-base")
    return {
        "sd1": tiny_models_dir / "tiny-sd",
        "sd1-file": make_tiny_single_file(tiny_models_dir / "tiny-sd", out / "tiny-sd1-pruned.safetensors", "sd1"),
        "sdxl": sdxl,
        "sdxl-file": make_tiny_single_file(sdxl, out / "tiny_sd_xl_base.safetensors", "sdxl"),
        "lora": make_tiny_lora(tiny_models_dir / "tiny-sd", out / "lora") / "pytorch_lora_weights.safetensors",
    }


def add(settings: Settings, *args: str, check: bool = True):
    return run_cli("models", "add", *args, env=settings_env(settings), check=check, timeout_s=300)


def weights(pipe: DiffusionPipeline) -> dict[str, torch.Tensor]:
    """Every tensor of every torch component, as ``component/name``."""
    return {
        f"{name}/{key}": value
        for name, part in pipe.components.items()
        if hasattr(part, "state_dict")
        for key, value in part.state_dict().items()
    }


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_r1_a_single_file_checkpoint_is_converted_once_into_a_diffusers_folder_with_the_same_weights(
    ctx: ServerContext,
    settings: Settings,
    checkpoints: dict[str, Path],
    family: str,
) -> None:
    source = checkpoints[f"{family}-file"]
    done = add(settings, str(source), "--family", family, "--config", str(checkpoints[family]), "--id", f"{family}-sf")
    digest = file_digest(source)
    assert f"registered {family}-sf family={family}" in done.stdout and f"source=single-file {digest}" in done.stdout
    record = ctx.registry.get(f"{family}-sf")
    assert (record.source_format, record.source_digest, record.family) == ("single-file", digest, family)
    folder = ctx.registry.folder(record.id)
    assert describe_pipeline(folder)[:2] == (record.pipeline_class, family)
    assert not list(folder.rglob("*.ckpt")) and not (folder / source.name).exists()  # only the converted folder
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors")} >= {
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    }
    converted = weights(DiffusionPipeline.from_pretrained(str(folder), local_files_only=True))
    original = weights(DiffusionPipeline.from_pretrained(str(checkpoints[family]), local_files_only=True))
    assert converted.keys() == original.keys()
    assert [name for name in original if not torch.equal(converted[name], original[name])] == []
    manifest = ctx.registry.manifest(record.id)
    assert manifest.source_digest == digest  # the worker's provenance carries it (tasks/provenance.py)
    # the same file again, without an id: refused, naming the registered copy (no second conversion)
    again = add(settings, str(source), "--family", family, "--config", str(checkpoints[family]), check=False)
    assert again.returncode == 2 and "model_already_registered" in again.stderr and f"{family}-sf" in again.stderr


@pytest.mark.parametrize("name", ["tiny-sd1.sft", "TINY-SD1.SAFETENSORS"])
def test_a_checkpoint_named_sft_or_in_capitals_converts_as_a_safetensors_file(
    ctx: ServerContext, settings: Settings, checkpoints: dict[str, Path], tmp_path: Path, name: str
) -> None:
    """ComfyUI's and BFL's ``.sft`` (``flux1-dev.sft``) and an upper-case extension are the same
    safetensors bytes: diffusers, which picks its reader by the extension, gets them under a
    ``.safetensors`` name, and the weights are those of the ``.safetensors`` file (it failed with
    ``conversion_failed`` pointing at the config)."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    source = downloads / name
    shutil.copyfile(checkpoints["sd1-file"], source)
    model_id = f"sd1-{name.split('.')[-1].lower()}"
    done = add(settings, str(source), "--family", "sd1", "--config", str(checkpoints["sd1"]), "--id", model_id)
    assert f"registered {model_id} family=sd1" in done.stdout, done.stdout + done.stderr
    converted = weights(DiffusionPipeline.from_pretrained(str(ctx.registry.folder(model_id)), local_files_only=True))
    original = weights(DiffusionPipeline.from_pretrained(str(checkpoints["sd1"]), local_files_only=True))
    assert [key for key in original if not torch.equal(converted[key], original[key])] == []
    assert [p.name for p in downloads.iterdir()] == [name]  # nothing left beside it (the link was the scratch's)


@pytest.mark.parametrize(
    ("file", "family", "reason", "words"),
    [
        ("sdxl-file", "sd1", "wrong_family", "is not an sd1 checkpoint: its keys are those of sdxl"),
        ("sd1-file", "sdxl", "wrong_family", "is not an sdxl checkpoint: its keys are those of sd1"),
        ("sd1-file", "flux", "wrong_family", "is not a flux checkpoint: its keys are those of sd1"),
        ("lora", "sd1", "not_a_checkpoint", "is a LoRA adapter"),
    ],
)
def test_r4_a_file_that_is_not_a_checkpoint_of_the_family_is_refused_naming_why(
    ctx: ServerContext,
    settings: Settings,
    checkpoints: dict[str, Path],
    file: str,
    family: str,
    reason: str,
    words: str,
) -> None:
    done = add(settings, str(checkpoints[file]), "--family", family, check=False)
    assert done.returncode == 2, done.stdout
    assert f"error ({reason})" in done.stderr and words in done.stderr.replace("\n", " "), done.stderr
    assert ctx.registry.list() == [] and not any(settings.data_dir.joinpath("models").glob("*"))


def test_r4_garbage_a_pickle_a_kohya_lora_and_a_partial_checkpoint_are_refused(
    ctx: ServerContext,
    settings: Settings,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    garbage = tmp_path / "model.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all, no")
    pickle = tmp_path / "v1-5-pruned.ckpt"
    pickle.write_bytes(b"PK\x03\x04 a zip of pickles: never opened")
    kohya = tmp_path / "style.safetensors"
    write_safetensors(
        kohya,
        {
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": 8,
            "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": 4,
        },
    )
    partial = tmp_path / "unet-only.safetensors"  # an SD 1.x UNet and text encoder, no VAE
    from safetensors import safe_open

    with safe_open(str(checkpoints["sd1-file"]), framework="pt") as handle:
        save_file(
            {k: handle.get_tensor(k) for k in handle.keys() if not k.startswith("first_stage_model.")},  # noqa: SIM118
            str(partial),
        )
    diffusers_named = tmp_path / "diffusion_pytorch_model.safetensors"
    write_safetensors(diffusers_named, {"down_blocks.0.resnets.0.conv1.weight": 8})
    cases = [
        (garbage, "not_a_checkpoint", "is not a safetensors checkpoint"),
        (pickle, "not_a_checkpoint", "never unpickles"),
        (kohya, "not_a_checkpoint", "is a LoRA adapter"),
        (partial, "incomplete_checkpoint", "vae: first_stage_model."),
        (diffusers_named, "not_a_checkpoint", "already in diffusers/transformers names"),
    ]
    for path, reason, words in cases:
        done = add(settings, str(path), "--family", "sd1", "--config", str(checkpoints["sd1"]), check=False)
        assert done.returncode == 2 and f"error ({reason})" in done.stderr, (path.name, done.stderr)
        assert words in done.stderr.replace("\n", " "), (path.name, done.stderr)
    assert ctx.registry.list() == []


def test_the_config_must_fit_the_family_and_flux_or_no_clip_vocabulary_need_one(
    ctx: ServerContext,
    settings: Settings,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    wrong = add(
        settings, str(checkpoints["sd1-file"]), "--family", "sd1", "--config", str(checkpoints["sdxl"]), check=False
    )
    assert wrong.returncode == 2 and "error (invalid_config)" in wrong.stderr
    assert (
        "is a folder of pipeline class StableDiffusionXLPipeline; an sd1 checkpoint needs a StableDiffusionPipeline "
        "folder"
    ) in " ".join(wrong.stderr.split())
    # the shipped SD 1.5 config: real sizes do not fit a tiny file, or no CLIP vocabulary is installed
    shipped = add(settings, str(checkpoints["sd1-file"]), "--family", "sd1", check=False)
    assert shipped.returncode == 2, shipped.stderr
    assert "error (needs_config)" in shipped.stderr or "error (conversion_failed)" in shipped.stderr, shipped.stderr
    if "conversion_failed" in shipped.stderr:  # the loader's error, cut at a word to 400 characters at most
        said = " ".join(shipped.stderr.split())
        assert "did not convert as sd1 with the shipped sd1 config: " in said, said  # not a scratch folder's path
        quoted = said.split("with the shipped sd1 config: ", 1)[1].split(" (the config's shapes must match")[0]
        assert len(quoted) <= 400 and (quoted.endswith(" [...]") or len(quoted) < 390), quoted
    # a Flux single file holds only the transformer: the other components need --config
    flux = tmp_path / "flux1-dev.safetensors"
    write_safetensors(flux, {"double_blocks.0.img_attn.norm.key_norm.scale": 8, "single_blocks.0.linear1.weight": 8})
    done = add(settings, str(flux), "--family", "flux", check=False)
    assert done.returncode == 2 and "error (needs_config)" in done.stderr
    assert "holds only the transformer" in done.stderr.replace("\n", " ")
    # a folder with --family, a file without it: usage errors naming the option
    usage = add(settings, str(checkpoints["sd1"]), "--family", "sd1", check=False)
    assert usage.returncode == 2 and "--family" in usage.stdout + usage.stderr
    usage = add(settings, str(checkpoints["sd1-file"]), check=False)
    assert usage.returncode == 2 and "needs --family" in (usage.stdout + usage.stderr).replace("\n", " ")
    assert ctx.registry.list() == []


def test_the_shipped_configs_are_those_of_the_real_repositories_and_load_in_diffusers() -> None:
    from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
    from transformers import CLIPTextConfig

    from app.store.single_file import FAMILY_CONFIGS

    sd1 = UNet2DConditionModel.load_config(str(FAMILY_CONFIGS / "sd1" / "unet"))
    assert (sd1["cross_attention_dim"], sd1["block_out_channels"]) == (768, [320, 640, 1280, 1280])
    sdxl = UNet2DConditionModel.load_config(str(FAMILY_CONFIGS / "sdxl" / "unet"))
    assert (sdxl["cross_attention_dim"], sdxl["projection_class_embeddings_input_dim"]) == (2048, 2816)
    assert AutoencoderKL.load_config(str(FAMILY_CONFIGS / "sdxl" / "vae"))["scaling_factor"] == 0.13025
    big_g = CLIPTextConfig.from_pretrained(str(FAMILY_CONFIGS / "sdxl" / "text_encoder_2"))
    assert (big_g.hidden_size, big_g.num_hidden_layers, big_g.projection_dim) == (1280, 32, 1280)
    flux = FluxTransformer2DModel.load_config(str(FAMILY_CONFIGS / "flux" / "transformer"))
    assert flux["num_attention_heads"] * flux["attention_head_dim"] == 3072  # FLUX.1's width
    for family in ("sd1", "sdxl", "flux"):
        index = json.loads((FAMILY_CONFIGS / family / "model_index.json").read_text())
        for name, entry in index.items():
            if isinstance(entry, list) and entry[0] == "diffusers":
                assert (FAMILY_CONFIGS / family / name).is_dir() or family == "flux", (family, name)


def test_an_fp16_checkpoint_stays_fp16_in_the_converted_folder(
    ctx: ServerContext,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    half = tmp_path / "sd15-fp16.safetensors"
    save_file({k: v.half() for k, v in load_file(str(checkpoints["sd1-file"])).items()}, str(half))
    record = ctx.registry.add_single_file(half, "sd1", precision="fp16", config=checkpoints["sd1"])
    assert (record.id, record.precision, record.source_digest) == ("sd15-fp16", "fp16", file_digest(half))
    unet = ctx.registry.folder(record.id) / "unet" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(unet), framework="pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"F16"}  # noqa: SIM118
    converted = weights(
        DiffusionPipeline.from_pretrained(
            str(ctx.registry.folder(record.id)), local_files_only=True, torch_dtype=torch.float16
        )
    )
    original = weights(
        DiffusionPipeline.from_pretrained(str(checkpoints["sd1"]), local_files_only=True, torch_dtype=torch.float16)
    )
    assert [name for name in original if not torch.equal(converted[name], original[name])] == []


def test_a_folder_holding_a_checkpoint_is_answered_with_the_command_that_registers_it(
    ctx: ServerContext, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A Civitai download kept in a folder of its own: without --family the folder is not a
    model folder, with it a folder is not a file; both answers name the file and the command
    (each used to point at the other)."""
    folder = tmp_path / "civ"
    folder.mkdir()
    shutil.copyfile(checkpoints["sd1-file"], folder / "dreamshaper_8.safetensors")
    plain = add(ctx.settings, str(folder), check=False)
    line = " ".join(plain.stderr.split())
    assert plain.returncode == 2 and "error (not_a_model)" in line, line
    assert (
        f"It holds dreamshaper_8.safetensors: a single-file checkpoint is registered by naming the file "
        f"(`homefleet models add {folder / 'dreamshaper_8.safetensors'} --family sd1|sdxl|flux`)"
    ) in line
    with_family = add(ctx.settings, str(folder), "--family", "sd1", check=False)
    said = "".join(ch for ch in with_family.stderr if ch not in "│╭╮╰╯─" and not ch.isspace())  # a usage box
    assert with_family.returncode == 2 and "isafolder;itholdsdreamshaper_8.safetensors" in said, said
    assert f"`homefleetmodelsadd{folder / 'dreamshaper_8.safetensors'}--familysd1`" in said, said
    done = add(  # the tiny checkpoint needs its tiny config (real sizes use the shipped one)
        ctx.settings, str(folder / "dreamshaper_8.safetensors"), "--family", "sd1", "--config", str(checkpoints["sd1"])
    )
    assert "registered dreamshaper_8 family=sd1" in done.stdout
