"""The AUTOMATIC1111 ``parameters`` text a result PNG carries (tasks/provenance.py)."""

from __future__ import annotations

from tasks.provenance import a1111_parameters, adapter_hash, model_hash

RECORD = {
    "model_id": "shapes-filled",
    "kind": "txt2img",
    "model_files": {"unet/a.safetensors": "blake3:" + "ab" * 32},
    "params": {
        "prompt": "a red circle",
        "negative_prompt": "blurry",
        "steps": 20,
        "guidance_scale": 7.0,
        "seed": 12345,
    },
    "seed": 12345,
    "sampler": "EulerAncestralDiscreteScheduler",
}


def test_the_text_has_a1111_s_three_parts_and_its_field_order() -> None:
    assert a1111_parameters(RECORD, (512, 512)) == (
        "a red circle\nNegative prompt: blurry\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 12345, "
        f"Size: 512x512, Model hash: {model_hash(RECORD)}, Model: shapes-filled"
    )


def test_defaults_fill_unset_params_an_unknown_scheduler_keeps_its_name_and_no_negative_prompt_no_line() -> None:
    record = {
        **RECORD,
        "kind": "img2img",
        "params": {"prompt": "bluer", "strength": 0.25},
        "seed": 7,
        "sampler": "MyScheduler",
        "source_digest": "blake3:" + "0123456789" * 6 + "abcd",
    }
    lines = a1111_parameters(record, (64, 48)).split("\n")
    assert lines == [
        "bluer",
        "Steps: 4, Sampler: MyScheduler, CFG scale: 7.5, Seed: 7, Size: 64x48, "
        "Model hash: 0123456789, Model: shapes-filled, Denoising strength: 0.25",
    ]


def test_lora_adapters_are_tagged_in_the_prompt_and_listed_with_their_hashes() -> None:
    """As A1111 writes them: ``<lora:name:weight>`` after the prompt, ``Lora hashes`` last, so a
    viewer reading only this text (Civitai's) sees the image was made with them."""
    record = {
        **RECORD,
        "adapters": [
            {"id": "blue-lora", "scale": 0.8, "files": {"pytorch_lora_weights.safetensors": "blake3:" + "cd" * 32}},
            {"id": "two-files", "scale": 1.0, "files": {"a.safetensors": "blake3:" + "01" * 32, "b.json": "x"}},
        ],
    }
    prompt, _negative, fields = a1111_parameters(record, (512, 512)).split("\n")
    assert prompt == "a red circle <lora:blue-lora:0.8> <lora:two-files:1>"
    assert fields.endswith(
        f'Model: shapes-filled, Lora hashes: "blue-lora: cdcdcdcdcd, two-files: {adapter_hash(record["adapters"][1])}"'
    )
    assert len(adapter_hash(record["adapters"][1])) == 10
    assert "Lora" not in a1111_parameters(RECORD, (512, 512))  # none: no tag, no field


def test_an_edit_names_its_image_guidance_as_a1111_does() -> None:
    record = {**RECORD, "kind": "edit", "params": {"prompt": "make it blue", "image_guidance_scale": 1.2}}
    fields = a1111_parameters(record, (64, 48)).split("\n")[-1]
    assert "CFG scale: 7.5, Image CFG scale: 1.2, Seed: 12345" in fields
    defaulted = {**RECORD, "kind": "edit", "params": {"prompt": "make it blue"}}
    assert "Image CFG scale: 1.5," in a1111_parameters(defaulted, (64, 48))  # the kind's default, as it ran
    assert "Image CFG scale" not in a1111_parameters(RECORD, (64, 48))  # txt2img has none
