"""Half-downloaded and odd model folders are refused at registration, naming what is wrong,
and leave nothing in the server's model folder (R1, R4; docs/operations.md, "What
registration takes"): a truncated weights file, a component holding its config but no
weights, a component folder that is missing, a text model without weights, a truncated LoRA
file, an adapter folder of several LoRA files. ``models update`` refuses what no loader can
read, and two registrations of one id at once leave exactly one. Real journal, real files.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from app.context import ServerContext
from app.core.config import Settings
from app.core.errors import HomefleetError, Rejected
from app.core.lora_files import LORA_WEIGHTS
from app.devtools.tiny_models import make_tiny_lora
from tests.helpers import run_cli, settings_env

UNET = "unet/diffusion_pytorch_model.safetensors"


def left_in_models_dir(ctx: ServerContext) -> list[str]:
    return (
        sorted(p.name for p in ctx.registry.models_dir.iterdir() if not p.name.startswith("."))
        if ctx.registry.models_dir.exists()
        else []
    )


@pytest.fixture
def copy_of_tiny_sd(tiny_models_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_models_dir / "tiny-sd", tmp_path / "tiny-sd-copy"))


def refused(ctx: ServerContext, source: Path, **kwargs: object) -> Rejected:
    with pytest.raises(Rejected) as caught:
        ctx.registry.add(source, **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_r1_a_truncated_weights_file_is_refused_naming_it(ctx: ServerContext, copy_of_tiny_sd: Path) -> None:
    path = copy_of_tiny_sd / UNET
    os.truncate(path, path.stat().st_size // 2)  # what an interrupted download leaves
    error = refused(ctx, copy_of_tiny_sd, model_id="trunc")
    assert error.reason == "incomplete_model"
    assert f"{UNET} cannot be loaded" in error.message and "file not fully covered" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_component_with_its_config_but_no_weights_is_refused(ctx: ServerContext, copy_of_tiny_sd: Path) -> None:
    (copy_of_tiny_sd / UNET).unlink()
    error = refused(ctx, copy_of_tiny_sd, model_id="noweights")
    assert error.reason == "incomplete_model"
    assert "component(s) unet hold a model's config.json but no weights" in error.message
    assert left_in_models_dir(ctx) == []


def test_r1_a_component_folder_missing_or_outside_the_model_is_refused(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    shutil.rmtree(copy_of_tiny_sd / "vae")
    error = refused(ctx, copy_of_tiny_sd, model_id="novae")
    assert (
        error.reason == "incomplete_model"
        and "component(s) vae named in model_index.json have no folder" in error.message
    )
    assert "huggingface.co" not in error.message  # not the loader's "check your internet connection"
    index = json.loads((copy_of_tiny_sd / "model_index.json").read_text())
    index["../secret"] = index["vae"]
    (copy_of_tiny_sd / "model_index.json").write_text(json.dumps(index))
    error = refused(ctx, copy_of_tiny_sd, model_id="escape")
    assert error.reason == "not_a_model" and "'../secret'" in error.message
    assert left_in_models_dir(ctx) == []


@pytest.mark.parametrize(
    ("file", "content", "wrong"),
    [
        ("model_index.json", "{", "is not valid JSON (Expecting property name enclosed in double quotes"),
        ("model_index.json", "[]", "holds an array, not a JSON object"),
        ("unet/config.json", "[]", "holds an array, not a JSON object"),
        ("scheduler/scheduler_config.json", '{"_class_name": "DDIMScheduler",', "is not valid JSON"),
        ("tokenizer/tokenizer_config.json", '"text"', "holds a string, not a JSON object"),
    ],
)
def test_r1_a_json_file_of_the_model_that_is_no_json_object_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path, file: str, content: str, wrong: str
) -> None:
    (copy_of_tiny_sd / file).write_text(content)
    error = refused(ctx, copy_of_tiny_sd, model_id="broken")
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{copy_of_tiny_sd / file} {wrong}"), error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize("file", ["model_index.json", "unet/config.json", "scheduler/scheduler_config.json"])
def test_r1_a_json_file_saved_with_a_byte_order_mark_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path, file: str
) -> None:
    """Python's json reads a UTF-8 BOM; diffusers and transformers (``open(..., encoding="utf-8")``)
    do not, so such a model registered and then failed every job at its load."""
    path = copy_of_tiny_sd / file
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    error = refused(ctx, copy_of_tiny_sd, model_id="bom")
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{path} starts with a UTF-8 byte order mark (BOM)"), error.message
    assert "save it as UTF-8 without a BOM" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize(
    ("file", "encoding", "why"),
    [
        ("model_index.json", "utf-16", "invalid start byte at byte 0"),  # with its BOM, as Notepad's "Unicode"
        ("unet/config.json", "utf-16", "invalid start byte at byte 0"),
        ("model_index.json", "utf-16-le", "a NUL byte, which JSON text never holds at byte 1"),  # no BOM: it decodes
        ("unet/config.json", "utf-16-be", "a NUL byte, which JSON text never holds at byte 0"),
    ],
)
def test_r1_a_json_file_saved_as_utf16_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path, file: str, encoding: str, why: str
) -> None:
    """Python's json reads UTF-16 bytes; the loaders read UTF-8 only (Notepad's "Unicode").
    Without a byte order mark, ASCII in UTF-16 is valid UTF-8 with a NUL between the letters."""
    path = copy_of_tiny_sd / file
    path.write_text(path.read_text(encoding="utf-8"), encoding=encoding)
    error = refused(ctx, copy_of_tiny_sd, model_id="utf16")
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{path} is not UTF-8 text ({why}"), error.message
    assert 'saved as UTF-16, "Unicode"?' in error.message, error.message
    assert "save it as UTF-8" in error.message and "not valid JSON" not in error.message


@pytest.mark.parametrize(
    ("encoding", "hint"),
    [
        ("utf-32", "saved as UTF-32)"),
        ("utf-32-le", "saved as UTF-32?)"),
        ("latin-1", "saved as Latin-1 or Windows-1252"),
    ],
)
def test_r1_a_json_file_in_another_encoding_is_refused_naming_a_likely_one(
    ctx: ServerContext, copy_of_tiny_sd: Path, encoding: str, hint: str
) -> None:
    """The hint follows the bytes: a UTF-32 file is not told it is UTF-16, nor a Latin-1 one
    (an accented letter in a description, saved by an editor's "ANSI")."""
    path = copy_of_tiny_sd / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**index, "_note": "café"}, ensure_ascii=False), encoding=encoding)
    error = refused(ctx, copy_of_tiny_sd, model_id="other-encoding")
    assert error.reason == "not_a_model" and error.message.startswith(f"{path} is not UTF-8 text ("), error.message
    assert hint in error.message and "UTF-16" not in error.message, error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize(
    ("config", "key", "cls"),
    [
        ("unet/config.json", "_class_name", "diffusers config of UNet2DConditionModel"),
        ("vae/config.json", "_class_name", "diffusers config of AutoencoderKL"),
        ("text_encoder/config.json", "model_type", "transformers config of CLIPTextModel"),
        ("scheduler/scheduler_config.json", "_class_name", "diffusers config of DDIMScheduler"),
    ],
)
def test_r1_an_emptied_component_config_is_refused_naming_the_users_file(
    ctx: ServerContext, copy_of_tiny_sd: Path, config: str, key: str, cls: str
) -> None:
    """``{}`` as a component's config: the loader builds the class's default shapes, so the
    model registered (priced at 3.3 GiB for 4.6 MiB of weights) and every job failed at load."""
    (copy_of_tiny_sd / config).write_text("{}")
    error = refused(ctx, copy_of_tiny_sd, model_id="emptied")
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{copy_of_tiny_sd / config} has no `{key}`, which every {cls} holds"), (
        error.message
    )
    assert str(ctx.registry.models_dir) not in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_an_empty_index_or_one_that_is_a_folder_is_refused_as_such(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    index = copy_of_tiny_sd / "model_index.json"
    index.write_text("{}")
    error = refused(ctx, copy_of_tiny_sd, model_id="empty")
    assert (error.reason, error.message.split(" (")[0]) == ("not_a_model", f"{index}: no `_class_name`")
    index.unlink()
    index.mkdir()
    error = refused(ctx, copy_of_tiny_sd, model_id="folder")
    assert (error.reason, error.message) == ("not_a_model", f"{index} cannot be read (Is a directory)")
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("unet/config.json", "unet/config.json (UNet2DConditionModel)"),
        ("text_encoder/config.json", "text_encoder/config.json (CLIPTextModel)"),
        ("scheduler/scheduler_config.json", "scheduler/scheduler_config.json (DDIMScheduler)"),
    ],
)
def test_r1_a_component_without_its_config_is_refused_naming_the_users_file(
    ctx: ServerContext, copy_of_tiny_sd: Path, config: str, named: str
) -> None:
    """Registered, such a folder failed at pricing with the loader's message naming the server's
    copy of the file (``<data_dir>/models/ID/...``), not the folder the user gave."""
    (copy_of_tiny_sd / config).unlink()
    error = refused(ctx, copy_of_tiny_sd, model_id="noconfig")
    assert (error.reason, error.message.split(": a component")[0]) == (
        "incomplete_model",
        f"{copy_of_tiny_sd}: no {named}",
    )
    assert str(ctx.registry.models_dir) not in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize(
    ("key", "value", "wrong"),
    [
        (
            "_class_name",
            ["StableDiffusionPipeline"],
            '`_class_name` must name the pipeline class as a string, got ["Stab',
        ),
        ("_class_name", None, "`_class_name` must name the pipeline class as a string, got null"),
        ("unet", [1, 2], "component `unet` must be [library, class]"),
        (
            "unet",
            ["diffusers"],
            'component `unet` must be [library, class] (e.g. ["diffusers", "UNet2DConditionModel"]) '
            'or [null, null], got ["diffusers"]',
        ),
        ("vae", [None, "AutoencoderKL"], "component `vae` must be [library, class]"),
    ],
)
def test_r1_an_index_entry_of_the_wrong_shape_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path, key: str, value: object, wrong: str
) -> None:
    """As diffusers reads model_index.json: a class name is a string, a component a pair of
    strings; anything else failed registration with a traceback, or registered a model no job
    could load (priced without that component)."""
    path = copy_of_tiny_sd / "model_index.json"
    index = json.loads(path.read_text())
    index[key] = value
    path.write_text(json.dumps(index))
    error = refused(ctx, copy_of_tiny_sd, model_id="odd")
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{path}: {wrong}"), error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_text_models_config_that_is_no_json_object_is_refused_naming_it(
    ctx: ServerContext, tiny_text_dir: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(tiny_text_dir / "tiny-gpt2", tmp_path / "gpt2-broken"))
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(config[: len(config) // 2])
    error = refused(ctx, folder)
    assert error.reason == "not_a_model" and error.message.startswith(f"{folder / 'config.json'} is not valid JSON")
    (folder / "config.json").write_text(config)
    (folder / "tokenizer_config.json").write_text("[]")
    error = refused(ctx, folder)
    assert error.reason == "not_a_model"
    assert error.message.startswith(f"{folder / 'tokenizer_config.json'} holds an array, not a JSON object")
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_an_index_that_does_not_name_its_pipelines_components_is_refused_naming_them(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    index = copy_of_tiny_sd / "model_index.json"
    full = json.loads(index.read_text())
    index.write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))  # the other files kept
    error = refused(ctx, copy_of_tiny_sd, model_id="bare")
    assert error.reason == "incomplete_model"
    assert error.message == (
        f"{copy_of_tiny_sd}: model_index.json names no scheduler, text_encoder, tokenizer, unet, vae "
        "(StableDiffusionPipeline needs scheduler, text_encoder, tokenizer, unet, vae; the index names none): an "
        "incomplete or edited index, download the model again"
    )
    del full["tokenizer"]
    index.write_text(json.dumps({**full, "text_encoder": [None, None]}))  # null: the loader passes none
    error = refused(ctx, copy_of_tiny_sd, model_id="partial")
    assert error.reason == "incomplete_model"
    assert "model_index.json names no text_encoder, tokenizer (StableDiffusionPipeline needs" in error.message
    assert "the index names scheduler, unet, vae)" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_path_that_does_not_exist_is_refused_as_such(ctx: ServerContext, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    for kwargs in ({}, {"adapter_of": "sd1"}):
        error = refused(ctx, missing, **kwargs)
        assert (error.reason, error.message) == ("path_not_found", f"{missing} does not exist")
    os.symlink(tmp_path / "gone", tmp_path / "link")
    error = refused(ctx, tmp_path / "link")
    assert (error.reason, error.message) == ("path_not_found", f"{tmp_path / 'link'} does not exist (a broken link)")
    assert ctx.registry.list() == []


def test_models_add_refuses_a_broken_or_bare_index_and_a_missing_path_with_exit_2(
    settings: Settings, ctx: ServerContext, copy_of_tiny_sd: Path, tmp_path: Path
) -> None:
    """``homefleet models add DIR``, as an operator runs it: one error line, no traceback."""
    env = settings_env(settings)
    index = copy_of_tiny_sd / "model_index.json"
    full = index.read_text()
    cases = [
        ("{", "not_a_model", f"{index} is not valid JSON (Expecting property name enclosed in double quotes"),
        ("[]", "not_a_model", f"{index} holds an array, not a JSON object"),
        (
            '{"_class_name": "StableDiffusionPipeline"}',
            "incomplete_model",
            f"{copy_of_tiny_sd}: model_index.json names no scheduler, text_encoder, tokenizer, unet, vae",
        ),
    ]
    for content, reason, words in cases:
        index.write_text(content)
        done = run_cli("models", "add", str(copy_of_tiny_sd), env=env, check=False)
        said = " ".join(done.stderr.split())
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"error ({reason}): {words}" in said, said
        assert "Traceback" not in done.stdout + done.stderr
    index.write_text(full)
    missing = tmp_path / "nonexistent"
    done = run_cli("models", "add", str(missing), env=env, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert " ".join(done.stderr.split()) == f"error (path_not_found): {missing} does not exist"
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_text_model_without_weights_is_refused(ctx: ServerContext, tiny_text_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_text_dir / "tiny-gpt2", tmp_path / "gpt2-config-only"))
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    error = refused(ctx, folder)
    assert error.reason == "incomplete_model" and "no model*.safetensors" in error.message


def test_r1_a_truncated_lora_file_is_refused_and_leaves_nothing(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path
) -> None:
    lora = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "lora") / LORA_WEIGHTS
    cut = tmp_path / "trunc-lora.safetensors"
    cut.write_bytes(lora.read_bytes()[: lora.stat().st_size - 1000])
    error = refused(ctx, cut, adapter_of="sd1")
    assert error.reason == "incomplete_model" and "file not fully covered" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_an_adapter_folder_takes_the_one_file_a_worker_loads(
    ctx: ServerContext, tiny_models_dir: Path, tmp_path: Path
) -> None:
    lora = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "lora") / LORA_WEIGHTS
    epochs = tmp_path / "epochs"
    epochs.mkdir()
    shutil.copy(lora, epochs / "style-epoch1.safetensors")
    shutil.copy(lora, epochs / "style-epoch2.safetensors")
    error = refused(ctx, epochs, adapter_of="sd1")
    assert error.reason == "ambiguous_adapter"
    assert "style-epoch1.safetensors, style-epoch2.safetensors" in error.message
    assert f"homefleet models add {epochs / 'style-epoch2.safetensors'} --adapter-of" in error.message
    # beside pytorch_lora_weights.safetensors, a full checkpoint is left out, not priced or synced
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(lora, mixed / LORA_WEIGHTS)
    shutil.copy(tiny_models_dir / "tiny-sd" / UNET, mixed / "z-checkpoint.safetensors")
    record = ctx.registry.add(mixed, adapter_of="sd1")
    assert [f.path for f in ctx.registry.manifest(record.id).files] == [LORA_WEIGHTS]
    assert record.total_bytes == lora.stat().st_size


def test_r5_update_refuses_offsets_no_loader_accepts_and_an_adapter_no_longer_a_lora(
    ctx: ServerContext, copy_of_tiny_sd: Path, tiny_models_dir: Path, tmp_path: Path
) -> None:
    record = ctx.registry.add(copy_of_tiny_sd, model_id="sd")
    stored = ctx.registry.folder(record.id) / UNET
    data = stored.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    header = data[8:header_end].decode()
    first = header.index('"data_offsets":[') + len('"data_offsets":[')
    start, _, rest = header[first:].partition(",")
    end = rest[: rest.index("]")]
    bad = header[:first] + f"{start},{int(end) + 1}" + header[first + len(start) + 1 + len(end) :]
    bad = bad[: len(header)] if len(bad) > len(header) else bad + " " * (len(header) - len(bad))
    stored.write_bytes(data[:8] + bad.encode() + data[header_end:])  # valid JSON, impossible offsets
    with pytest.raises(Rejected) as caught:
        ctx.registry.update(record.id)
    assert caught.value.reason == "model_unreadable" and "diffusion_pytorch_model.safetensors" in caught.value.message

    lora = make_tiny_lora(tiny_models_dir / "tiny-sd", tmp_path / "lora") / LORA_WEIGHTS
    adapter = ctx.registry.add(lora, adapter_of="sd1")
    weights = ctx.registry.folder(adapter.id) / LORA_WEIGHTS
    raw = weights.read_bytes()
    weights.write_bytes(raw.replace(b".lora.down.", b".lora.dOwn.").replace(b".lora.up.", b".lora.Up."))  # no LoRA keys
    with pytest.raises(Rejected) as caught:
        ctx.registry.update(adapter.id)
    assert caught.value.reason == "not_an_adapter"


def test_r1_two_registrations_of_one_id_at_once_leave_one(ctx: ServerContext, tiny_models_dir: Path) -> None:
    outcomes: list[str] = []

    def register() -> None:
        try:
            ctx.registry.add(tiny_models_dir / "tiny-sd", model_id="race")
            outcomes.append("registered")
        except HomefleetError as error:
            outcomes.append(error.reason)

    threads = [threading.Thread(target=register) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["model_id_taken", "registered"]
    assert [c.status for c in ctx.registry.verify(["race"])] == ["ok"] * len(ctx.registry.manifest("race").files)


def test_r1_a_folder_whose_unet_has_only_bin_weights_registers_and_loads(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    """An older download: the UNet as ``diffusion_pytorch_model.bin``, the other components as
    safetensors. Each component keeps its own files, and diffusers loads the server's copy."""
    import torch
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    weights = copy_of_tiny_sd / UNET
    torch.save(load_file(weights), copy_of_tiny_sd / "unet/diffusion_pytorch_model.bin")
    weights.unlink()
    record = ctx.registry.add(copy_of_tiny_sd, model_id="older")
    copied = ctx.registry.folder(record.id)
    assert (copied / "unet/diffusion_pytorch_model.bin").is_file()
    assert (copied / "vae/diffusion_pytorch_model.safetensors").is_file()
    assert (copied / "text_encoder/model.safetensors").is_file()
    pipeline = StableDiffusionPipeline.from_pretrained(copied, local_files_only=True)
    assert pipeline.unet.conv_in.weight.shape[0] == 32


@pytest.mark.parametrize(
    ("config", "content", "said"),
    [
        (
            "unet/config.json",
            '{"_class_name": "UNet2DConditionModel"}',
            "unet/diffusion_pytorch_model.safetensors holds conv_in.bias of shape [32], but unet's config "
            "builds it as [320]",
        ),
        (
            "text_encoder/config.json",
            '{"model_type": "clip_text_model"}',
            "text_encoder/model.safetensors holds embeddings.position_embedding.weight of shape [77, 32], but "
            "text_encoder's config builds it as [77, 512]",
        ),
    ],
)
def test_r1_a_config_that_does_not_describe_its_weights_is_refused_naming_the_tensor(
    ctx: ServerContext, copy_of_tiny_sd: Path, config: str, content: str, said: str
) -> None:
    """A config with its class but not its sizes: the skeleton built from it (3.3 GiB for a 4.5
    MiB UNet) is compared with the safetensors headers, as the loader would at every job."""
    (copy_of_tiny_sd / config).write_text(content)
    error = refused(ctx, copy_of_tiny_sd, model_id="unfit")
    assert error.reason == "not_a_model" and said in error.message, error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_models_add_folds_a_left_out_subfolder_into_one_line(
    settings: Settings, ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    """A subfolder a component does not read is one line of ``models add``, with its count and
    bytes (a link to /usr/share/doc printed 5,414 lines)."""
    old = copy_of_tiny_sd / "tokenizer" / "old"
    old.mkdir()
    for index in range(3):
        (old / f"notes-{index}.txt").write_text("x" * 100)
    done = run_cli("models", "add", str(copy_of_tiny_sd), "--id", "folded", env=settings_env(settings))
    lines = [line for line in done.stdout.splitlines() if "tokenizer/old" in line]
    assert len(lines) == 1, done.stdout
    assert lines[0].split()[:4] == ["left", "out", "300", "B"] and lines[0].split()[4] == "tokenizer/old/"
    assert lines[0].endswith("(3 files; in a subfolder of tokenizer, which the pipeline does not read)")
    assert "left out: 3 files, 300 B" in done.stdout


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        (
            ["my_pkg", "MyUNet"],
            "unet: model_index.json names library 'my_pkg' (MyUNet); a component comes from diffusers or "
            "transformers or a diffusers pipeline module (such as 'stable_diffusion')",
        ),
        (["os", "path"], "unet: model_index.json names library 'os' (path)"),
        (["diffusers", "NoSuchUNet"], "unet: diffusers has no class 'NoSuchUNet' (model_index.json)"),
        (["stable_diffusion", "NoSuchChecker"], "unet: stable_diffusion has no class 'NoSuchChecker'"),
    ],
)
def test_r1_an_index_naming_a_library_or_class_no_loader_has_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path, entry: list[str], said: str
) -> None:
    """A component's library is diffusers, transformers or a module of diffusers.pipelines, as
    DiffusionPipeline finds it; any other name is refused without importing a package of that
    name (it failed registration with a ModuleNotFoundError traceback)."""
    path = copy_of_tiny_sd / "model_index.json"
    index = json.loads(path.read_text())
    index["unet"] = entry
    path.write_text(json.dumps(index))
    error = refused(ctx, copy_of_tiny_sd, model_id="odd")
    assert error.reason == "not_a_model" and said in error.message, error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_an_index_naming_a_class_its_config_does_not_suit_is_refused_naming_it(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    """A T5 encoder named over a CLIP text encoder's config: transformers reads fields the config
    lacks (an AttributeError traceback before)."""
    path = copy_of_tiny_sd / "model_index.json"
    index = json.loads(path.read_text())
    index["text_encoder"] = ["transformers", "T5EncoderModel"]
    path.write_text(json.dumps(index))
    error = refused(ctx, copy_of_tiny_sd, model_id="odd")
    assert error.reason == "not_a_model", error.message
    assert "cannot be priced from its configs" in error.message and "AttributeError" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_sharded_diffusers_component_missing_a_shard_is_refused_naming_it(
    ctx: ServerContext, tiny_families_dir: Path, tmp_path: Path
) -> None:
    """FLUX.1-dev as downloaded, its transformer in shards, one of which never arrived: the
    index names it, so registration refuses the folder (it registered, and every job failed
    with "does not appear to have a file named ...")."""
    from app.devtools.replicas import make_replica

    replica = make_replica("flux", tmp_path / "downloads", tiny_dir=tiny_families_dir)
    shards = sorted(replica.folder.glob("transformer/diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 2
    shards[1].unlink()
    error = refused(ctx, replica.folder, precision="bf16")
    assert error.reason == "incomplete_model", error.message
    assert (
        "transformer/diffusion_pytorch_model.safetensors.index.json names 1 shard(s) the folder does not hold: "
        f"transformer/{shards[1].name}"
    ) in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []
    # every shard there, the index gone: the loader finds none ("no file named ... found")
    (replica.folder / "transformer/diffusion_pytorch_model.safetensors.index.json").unlink()
    shards[1].write_bytes(b"")  # (its bytes do not matter: refused before any is read)
    error = refused(ctx, replica.folder, precision="bf16")
    assert error.reason == "incomplete_model", error.message
    assert f"transformer/{shards[0].name}" in error.message and "no shard index (*.index.json)" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_sharded_text_model_missing_a_shard_or_with_a_damaged_index_is_refused(
    ctx: ServerContext, tiny_text_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "llama-sharded"
    AutoModelForCausalLM.from_pretrained(tiny_text_dir / "tiny-llama").save_pretrained(folder, max_shard_size="50KB")
    for tokenizer_file in (tiny_text_dir / "tiny-llama").glob("tok*"):
        shutil.copyfile(tokenizer_file, folder / tokenizer_file.name)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = folder / "model.safetensors.index.json"
    whole = index.read_text()
    index.write_text(json.dumps({"metadata": {}}))
    error = refused(ctx, folder)
    assert error.reason == "not_a_model" and f"{index} has no `weight_map` object" in error.message
    index.write_text(whole)
    shards[0].unlink()
    error = refused(ctx, folder)
    assert error.reason == "incomplete_model"
    assert f"model.safetensors.index.json names 1 shard(s) the folder does not hold: {shards[0].name}" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


@pytest.mark.parametrize("removed", ["tok*", "tokenizer.json"])
def test_r1_a_text_model_whose_tokenizer_cannot_be_loaded_is_refused(
    ctx: ServerContext, tiny_text_dir: Path, tmp_path: Path, removed: str
) -> None:
    """Its tokenizer is loaded from the stored copy as a worker and the API load it; without
    one every text request failed with a bare 500."""
    folder = Path(shutil.copytree(tiny_text_dir / "tiny-llama", tmp_path / "llama-no-tokenizer"))
    for path in folder.glob(removed):
        path.unlink()
    error = refused(ctx, folder)
    assert error.reason == "incomplete_model", error.message
    assert "its tokenizer cannot be loaded: no tokenizer.json; its tokenizer files: " in error.message
    assert "download the model again" in error.message and "\n" not in error.message  # one line
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_a_registered_model_whose_tokenizer_cannot_load_is_a_409_naming_it(tmp_path: Path) -> None:
    """A text model registered before registration loaded tokenizers: a submission gets 409
    ``tokenizer_unloadable`` (it was an unhandled 500), and no job is queued."""
    from app.core.errors import Conflict
    from app.jobs.validation import PromptTokenizers

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    tokenizers = PromptTokenizers(lambda model_id: folder)
    with pytest.raises(Conflict) as caught:
        tokenizers.tokenizer("llama")
    assert caught.value.reason == "tokenizer_unloadable"
    assert caught.value.message.startswith("model 'llama': its tokenizer cannot be loaded")


@pytest.mark.parametrize("where", ["text", "vae"])
def test_r1_a_truncated_bin_weights_file_is_refused_naming_it(
    ctx: ServerContext, tiny_text_dir: Path, copy_of_tiny_sd: Path, tmp_path: Path, where: str
) -> None:
    """``torch.save``'s zip archive cut short: its central directory is gone, found without
    unpickling anything (app/core/torch_archive.py); it registered, and every job failed."""
    import torch
    from safetensors.torch import load_file

    if where == "text":
        folder = Path(shutil.copytree(tiny_text_dir / "tiny-gpt2", tmp_path / "gpt2-bin"))
        weights, bin_file = folder / "model.safetensors", "pytorch_model.bin"
    else:
        folder = copy_of_tiny_sd
        weights, bin_file = folder / "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.bin"
    torch.save(load_file(weights), folder / bin_file)
    weights.unlink()
    whole = (folder / bin_file).read_bytes()
    (folder / bin_file).write_bytes(whole[: len(whole) * 2 // 3])
    error = refused(ctx, folder)
    assert error.reason == "incomplete_model", error.message
    assert f"{bin_file} cannot be loaded" in error.message and "not a whole torch archive" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []
    (folder / bin_file).write_bytes(bytes(4096))  # zeros (a sparse file never written): neither format
    error = refused(ctx, folder)
    assert error.reason == "incomplete_model" and "neither a torch archive (a zip) nor" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []
    (folder / bin_file).write_bytes(whole)  # the whole file registers
    assert ctx.registry.add(folder, model_id="whole").id == "whole"


def without_tensor(path: Path, name: str) -> None:
    """Rewrite the safetensors file ``path`` without the tensor ``name`` (what a converter that
    skipped a layer, or a hand-merged checkpoint, leaves: a valid file, one tensor short)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    assert name in tensors
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("model", "file", "tensor"),
    [
        ("tiny-sd", UNET, "down_blocks.0.resnets.0.conv1.weight"),
        ("tiny-sd", "text_encoder/model.safetensors", "encoder.layers.0.mlp.fc1.weight"),
        ("tiny-llama", "model.safetensors", "model.layers.0.self_attn.q_proj.weight"),
    ],
)
def test_r1_weights_missing_a_tensor_the_config_builds_are_refused_naming_it(
    ctx: ServerContext, tiny_models_dir: Path, tiny_text_dir: Path, tmp_path: Path, model: str, file: str, tensor: str
) -> None:
    """A valid safetensors file one tensor short registered, then failed every diffusers job on a
    meta tensor, and a text model ran with that layer at random weights (transformers initialises
    what it does not find): the parameters the config builds are compared with the stored names."""
    source = (tiny_text_dir if model == "tiny-llama" else tiny_models_dir) / model
    folder = Path(shutil.copytree(source, tmp_path / f"{model}-short"))
    without_tensor(folder / file, tensor)
    error = refused(ctx, folder, model_id="short")
    assert error.reason == "incomplete_model", error.message
    stored_as = file if "/" in file else f"short/{file}"  # a text model's folder is stored under its id
    assert f"{stored_as} lacks 1 of the " in error.message and f"({tensor})" in error.message, error.message
    assert "download it again" in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_vae_stored_with_the_old_attention_names_registers_and_loads(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    """Old Stable Diffusion repositories store the VAE's attention as ``query``/``key``/``value``/
    ``proj_attn``, which diffusers renames on load: those weights are complete, not missing."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file, save_file

    path = copy_of_tiny_sd / "vae/diffusion_pytorch_model.safetensors"
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    renamed = {}
    for name, tensor in load_file(path).items():
        for new_name, old_name in old.items():
            name = name.replace(f".attentions.0.{new_name}.", f".attentions.0.{old_name}.")
        renamed[name] = tensor
    assert sum(".query." in name for name in renamed) == 4  # weight and bias, in the encoder's and decoder's mid-block
    save_file(renamed, path, metadata={"format": "pt"})
    vae = AutoencoderKL.from_pretrained(copy_of_tiny_sd / "vae")  # diffusers itself takes the file
    assert not any(parameter.is_meta for parameter in vae.parameters())
    record = ctx.registry.add(copy_of_tiny_sd, model_id="old-vae")
    assert [m.id for m in ctx.registry.list()] == ["old-vae"] and (record.weights_bytes or 0) > 0


def test_r1_a_shard_missing_a_tensor_is_named_by_the_shard_index(ctx: ServerContext, copy_of_tiny_sd: Path) -> None:
    """Sharded weights, one tensor short in one shard, the index intact: the refusal names the
    shard the index assigns it to, not every shard."""
    from diffusers import UNet2DConditionModel

    folder = copy_of_tiny_sd / "unet"
    UNet2DConditionModel.from_pretrained(folder).save_pretrained(folder, max_shard_size="500KB")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(folder.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 3
    shard = shards[1].name  # neither the first nor the last
    tensor = sorted(name for name, held_in in index.items() if held_in == shard)[0]
    without_tensor(folder / shard, tensor)
    error = refused(ctx, copy_of_tiny_sd, model_id="short-shard")
    assert error.reason == "incomplete_model", error.message
    assert error.message.startswith(f"unet/{shard} lacks 1 of the "), error.message
    assert f"({tensor})" in error.message and shards[0].name not in error.message
    assert ctx.registry.list() == [] and left_in_models_dir(ctx) == []


def test_r1_a_text_encoder_stored_with_the_old_text_model_prefix_is_complete_unless_a_tensor_is_missing(
    ctx: ServerContext, copy_of_tiny_sd: Path
) -> None:
    """Stable Diffusion repositories saved by older transformers name the CLIP text encoder's
    tensors ``text_model.…``; transformers maps them on load, so they register, and one missing
    is still found under the name the model gives it."""
    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextModel

    path = copy_of_tiny_sd / "text_encoder/model.safetensors"
    save_file(
        {f"text_model.{name}": tensor for name, tensor in load_file(path).items()}, path, metadata={"format": "pt"}
    )
    _, loading = CLIPTextModel.from_pretrained(copy_of_tiny_sd / "text_encoder", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]  # transformers itself takes the file
    complete = Path(shutil.copytree(copy_of_tiny_sd, copy_of_tiny_sd.parent / "old-prefix"))
    assert ctx.registry.add(complete, model_id="old-prefix").id == "old-prefix"
    without_tensor(path, "text_model.encoder.layers.0.mlp.fc1.weight")
    error = refused(ctx, copy_of_tiny_sd, model_id="old-prefix-short")
    assert error.reason == "incomplete_model" and "(encoder.layers.0.mlp.fc1.weight)" in error.message, error.message
