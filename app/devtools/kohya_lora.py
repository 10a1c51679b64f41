"""A diffusers-format LoRA file rewritten in the kohya / A1111 layout, the form most LoRA files
downloaded from Civitai take (docs/operations.md "LoRA adapters"), for tests and demos: the same
tensors under kohya's names, so both files must give the same image.

Names, the reverse of diffusers' own conversion (``_convert_non_diffusers_lora_to_diffusers`` in
diffusers/loaders/lora_conversion_utils.py):
``unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight`` (or
``….lora.down.weight``) -> ``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight``;
``lora_B``/``lora.up`` -> ``lora_up``; ``text_encoder.`` -> ``lora_te_`` (``lora_te1_`` and
``lora_te2_`` when the file has ``text_encoder_2.`` keys); each module gets ``.alpha``, a 0-d
float tensor, = its rank unless told otherwise, so the scale alpha/rank is 1, the scale diffusers
gives a file without alphas.
"""

from __future__ import annotations

import re
from pathlib import Path

_DIFFUSERS_KEY = re.compile(r"^(unet|text_encoder|text_encoder_2)\.(.+)\.(lora_A|lora\.down|lora_B|lora\.up)\.weight$")


def to_kohya_lora(diffusers_file: Path, out_file: Path, alpha: float | None = None) -> Path:
    """Write the LoRA in ``diffusers_file`` (diffusers/PEFT names, ``unet.``/``text_encoder.``/
    ``text_encoder_2.`` prefixes) to ``out_file`` in the kohya layout; returns ``out_file``.
    ``alpha``: every module's ``.alpha`` (default: its rank, the first dimension of its down
    weight). The tensors are the same (dtype, shape, values); metadata is not carried.

    Raises:
        ValueError: a key of another form (naming it).
    """
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(diffusers_file))
    two_encoders = any(k.startswith("text_encoder_2.") for k in tensors)
    prefixes = {
        "unet": "lora_unet_",
        "text_encoder": "lora_te1_" if two_encoders else "lora_te_",
        "text_encoder_2": "lora_te2_",
    }
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(tensors.items()):
        match = _DIFFUSERS_KEY.match(key)
        if match is None:
            raise ValueError(
                f"{diffusers_file}: {key!r} is not a diffusers LoRA key (unet./text_encoder. prefix, "
                ".lora_A/.lora_B or .lora.down/.lora.up weight)"
            )
        component, module, part = match.groups()
        name = prefixes[component] + module.replace(".", "_")
        down = part in ("lora_A", "lora.down")
        out[f"{name}.{'lora_down' if down else 'lora_up'}.weight"] = tensor.contiguous()
        if down:
            out[f"{name}.alpha"] = torch.tensor(float(tensor.shape[0] if alpha is None else alpha))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_file))
    return out_file
