"""Faithful tiny replicas of real model repositories, laid out as they are downloaded (no hub):
the names and structure of the real repositories, the tiny pipelines' weights
(:mod:`app.devtools.tiny_models`) inside. For tests of what registration takes
(docs/operations.md, "What registration takes") and for benchmarks that need real layouts.

===========  ===========================================  ====================================================
replica      repository it copies                         beside what the pipeline loads
===========  ===========================================  ====================================================
sd15         runwayml/stable-diffusion-v1-5               root v1-5-pruned(-emaonly) .safetensors/.ckpt,
                                                          v1-inference.yaml, README; per component
                                                          ``*.fp16.safetensors`` (real fp16 tensors), ``*.bin``,
                                                          ``*.fp16.bin``; unet ``*.non_ema.*``; a tiny real
                                                          safety_checker/ and feature_extractor/ (loaded)
sdxl         stabilityai/stable-diffusion-xl-base-1.0     root sd_xl_base_1.0(_0.9vae).safetensors, a LoRA,
                                                          PNGs, LICENSE, README; ``*.fp16.safetensors``, flax
                                                          ``*.msgpack``, model.onnx(+_data), openvino_model.*;
                                                          vae_1_0/, vae_decoder/, vae_encoder/
flux         black-forest-labs/FLUX.1-dev                 transformer/ and text_encoder_2/ sharded with index
                                                          json; root flux1-dev.safetensors, ae.safetensors, JPG
wan          Wan-AI/Wan2.1-T2V-1.3B-Diffusers             transformer/ and text_encoder/ sharded with index
                                                          json; assets/, examples/
===========  ===========================================  ====================================================

The weights the pipeline loads are the tiny pipeline's own (sharded ones split from them; fp16
twins are the same tensors cast to float16; ``.bin`` twins the same tensors saved with
``torch.save``). The extras are small dummy bytes (root single-file checkpoints too). Each
replica can also be laid out as a Hugging Face cache (:func:`as_hf_cache`: ``models--org--name/``
with ``refs/main``, ``blobs/<sha256>`` and ``snapshots/<commit>/`` of relative links).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.utils.sha import git_hash

from app.devtools.tiny_models import make_tiny_families

#: replica name -> (tiny family, the repository it copies)
REPLICAS: dict[str, tuple[str, str]] = {
    "sd15": ("sd1", "runwayml/stable-diffusion-v1-5"),
    "sdxl": ("sdxl", "stabilityai/stable-diffusion-xl-base-1.0"),
    "flux": ("flux", "black-forest-labs/FLUX.1-dev"),
    "wan": ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
}


@dataclass(frozen=True)
class Replica:
    """A replica folder and what registering it must take.

    ``folder``: the plain folder (``out_dir/<name of the repository>``); ``expected``:
    precision (fp32, bf16, fp16) -> the relative paths the pipeline loads at that precision.
    """

    name: str
    family: str
    repo_id: str
    folder: Path
    expected: dict[str, frozenset[str]]


def make_replica(name: str, out_dir: Path, seed: int = 0, *, tiny_dir: Path | None = None) -> Replica:
    """Build the replica ``name`` (:data:`REPLICAS`) into ``out_dir/<repository name>`` (rebuilt
    from scratch if there) from the tiny pipeline in ``tiny_dir`` (built there, seeded, when
    missing; default ``out_dir/.tiny``). Takes about a second after the tiny pipeline exists.

    Raises:
        ValueError: an unknown replica name.
    """
    if name not in REPLICAS:
        raise ValueError(f"unknown replica {name!r}; known: {', '.join(REPLICAS)}")
    family, repo_id = REPLICAS[name]
    out_dir = Path(out_dir)
    tiny = make_tiny_families(tiny_dir or out_dir / ".tiny", [family], seed=seed)[family]
    folder = out_dir / repo_id.split("/")[-1]
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tiny, folder)
    build = _Build(folder)
    {"sd15": _sd15, "sdxl": _sdxl, "flux": _flux, "wan": _wan}[name](build)
    fp32 = frozenset(build.fp32)
    return Replica(
        name=name,
        family=family,
        repo_id=repo_id,
        folder=folder,
        expected={"fp32": fp32, "bf16": fp32, "fp16": frozenset(build.fp16)},
    )


LFS_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".onnx", ".h5", ".model", ".pb")
"""File suffixes the Hub's default ``.gitattributes`` keeps in Git LFS (the ones replicas hold)."""


def _blob_name(path: Path) -> str:
    """The name ``huggingface_hub`` gives the blob of ``path`` in its cache."""
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest() if path.name.endswith(LFS_SUFFIXES) else git_hash(data)


def as_hf_cache(replica: Replica, cache_dir: Path, revision: str = "main") -> Path:
    """Lay ``replica`` out in the Hugging Face cache ``cache_dir`` as ``huggingface_hub``
    downloads it: ``models--{org}--{name}/blobs/<name>``, the name the SHA-256 of the bytes for a
    file the Hub keeps in Git LFS (:data:`LFS_SUFFIXES`: weights) and the git blob hash (SHA-1 of
    ``blob <size>\\0`` and the bytes) for the others (configs, tokenizer files),
    ``snapshots/<commit>/<path>`` as RELATIVE links to the blobs (``../../blobs/…``, one more
    ``../`` per folder level) and ``refs/<revision>`` holding the commit (40 hex digits, derived
    from the contents). Returns the snapshot folder."""
    repo = Path(cache_dir) / ("models--" + replica.repo_id.replace("/", "--"))
    files = sorted(p for p in replica.folder.rglob("*") if p.is_file())
    digests = {p: _blob_name(p) for p in files}
    commit = hashlib.sha1(
        "".join(f"{p.relative_to(replica.folder)}:{d}\n" for p, d in digests.items()).encode()
    ).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    for path, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        relative = path.relative_to(replica.folder)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(Path(*([".."] * (len(relative.parts) + 1))) / "blobs" / digest, link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


class _Build:
    """A replica being laid out: the paths the pipeline loads at fp32 and at fp16, kept as files change."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fp32 = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        self.fp16 = set(self.fp32)

    def dummy(self, path: str, size: int = 64) -> None:
        """A file of ``size`` deterministic bytes the pipeline does not load."""
        target = self.folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        seed = hashlib.sha256(path.encode()).digest()
        target.write_bytes((seed * (size // len(seed) + 1))[:size])

    def fp16_twin(self, weights: str) -> None:
        """``x.fp16.safetensors`` beside ``x.safetensors``: its floating tensors cast to float16;
        the fp16 variant loads it instead."""
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(self.folder / weights)
        half = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in tensors.items()}
        twin = weights.replace(".safetensors", ".fp16.safetensors")
        save_file(half, self.folder / twin, metadata={"format": "pt"})
        self.fp16.discard(weights)
        self.fp16.add(twin)

    def bin_twin(self, weights: str, fp16: bool = False) -> None:
        """The ``.bin`` twin of a ``.safetensors`` file (``model`` -> ``pytorch_model``), the same
        tensors saved with ``torch.save``; ``fp16``: of its fp16 twin, named ``*.fp16.bin``."""
        import torch
        from safetensors.torch import load_file

        source = weights.replace(".safetensors", ".fp16.safetensors") if fp16 else weights
        folder, _, name = source.rpartition("/")
        name = name.replace(".safetensors", ".bin")
        name = "pytorch_" + name if name.startswith("model.") else name
        torch.save(load_file(self.folder / source), self.folder / folder / name)

    def copy(self, source: str, target: str) -> None:
        """A file the pipeline does not load holding another one's bytes (``*.non_ema.*``, ``vae_1_0/``)."""
        (self.folder / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.folder / source, self.folder / target)

    def shard(self, weights: str, shards: int) -> None:
        """Split ``component/<prefix>.safetensors`` into ``<prefix>-0000k-of-0000n.safetensors``
        with ``<prefix>.safetensors.index.json`` (``weight_map``, ``metadata.total_size``), as
        ``save_pretrained(max_shard_size=…)`` writes them; the original file is removed."""
        from safetensors.torch import load_file, save_file

        path = self.folder / weights
        tensors = load_file(path)
        names = sorted(tensors)
        prefix = path.name.removesuffix(".safetensors")
        weight_map: dict[str, str] = {}
        for k in range(shards):
            part = f"{prefix}-{k + 1:05d}-of-{shards:05d}.safetensors"
            chunk = names[k * len(names) // shards : (k + 1) * len(names) // shards]
            save_file({n: tensors[n] for n in chunk}, path.parent / part, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk, part))
            for loads in (self.fp32, self.fp16):
                loads.add(f"{path.parent.relative_to(self.folder).as_posix()}/{part}")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = f"{path.name}.index.json"
        (path.parent / index).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        )
        path.unlink()
        component = path.parent.relative_to(self.folder).as_posix()
        for loads in (self.fp32, self.fp16):
            loads.discard(weights)
            loads.add(f"{component}/{index}")


def _sd15(build: _Build) -> None:
    for weights in (
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ):
        build.fp16_twin(weights)
        build.bin_twin(weights)
        build.bin_twin(weights, fp16=True)
    build.copy("unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.non_ema.safetensors")
    build.copy("unet/diffusion_pytorch_model.bin", "unet/diffusion_pytorch_model.non_ema.bin")
    _safety_checker(build)
    for name in (
        "v1-5-pruned.safetensors",
        "v1-5-pruned.ckpt",
        "v1-5-pruned-emaonly.safetensors",
        "v1-5-pruned-emaonly.ckpt",
    ):
        build.dummy(name, 8192)
    build.dummy("v1-inference.yaml", 1900)
    build.dummy("README.md", 1200)
    build.dummy(".gitattributes", 1500)


def _safety_checker(build: _Build) -> None:
    """SD 1.5's ``safety_checker`` (a transformers model in diffusers' ``stable_diffusion``
    pipeline module: ``["stable_diffusion", "StableDiffusionSafetyChecker"]``) and its
    ``feature_extractor`` (``CLIPImageProcessor``), tiny, named in ``model_index.json`` as the
    real repository names them, with its fp16 and ``.bin`` twins. Its concept embeddings are as
    the class builds them (ones), so it flags no image."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(0)
    tower = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2}
    config = CLIPConfig(
        text_config={**tower, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 2},
        vision_config={**tower, "image_size": 32, "patch_size": 4},
        projection_dim=32,
    )
    StableDiffusionSafetyChecker(config).save_pretrained(build.folder / "safety_checker")
    CLIPImageProcessor(crop_size=32, size=32).save_pretrained(build.folder / "feature_extractor")
    for path in (
        "safety_checker/config.json",
        "safety_checker/model.safetensors",
        "feature_extractor/preprocessor_config.json",
    ):
        build.fp32.add(path)
        build.fp16.add(path)
    build.fp16_twin("safety_checker/model.safetensors")
    build.bin_twin("safety_checker/model.safetensors")
    build.bin_twin("safety_checker/model.safetensors", fp16=True)
    index_path = build.folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(
        safety_checker=["stable_diffusion", "StableDiffusionSafetyChecker"],
        feature_extractor=["transformers", "CLIPImageProcessor"],
        requires_safety_checker=True,
    )
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _sdxl(build: _Build) -> None:
    for component, name in (
        ("unet", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
        ("text_encoder_2", "model"),
    ):
        build.fp16_twin(f"{component}/{name}.safetensors")
        flax = "flax_model.msgpack" if name == "model" else "diffusion_flax_model.msgpack"
        build.dummy(f"{component}/{flax}", 2048)
        if component != "vae":
            build.dummy(f"{component}/model.onnx", 2048)
            build.dummy(f"{component}/openvino_model.bin", 2048)
            build.dummy(f"{component}/openvino_model.xml", 512)
        if component in ("unet", "text_encoder_2"):
            build.dummy(f"{component}/model.onnx_data", 4096)
    for part in ("config.json", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"):
        build.copy(f"vae/{part}", f"vae_1_0/{part}")
    for folder in ("vae_decoder", "vae_encoder"):
        build.dummy(f"{folder}/config.json", 600)
        build.dummy(f"{folder}/model.onnx", 2048)
        build.dummy(f"{folder}/openvino_model.bin", 2048)
        build.dummy(f"{folder}/openvino_model.xml", 512)
    for name in (
        "sd_xl_base_1.0.safetensors",
        "sd_xl_base_1.0_0.9vae.safetensors",
        "sd_xl_offset_example-lora_1.0.safetensors",
    ):
        build.dummy(name, 8192)
    for name in ("01.png", "comparison.png", "pipeline.png"):
        build.dummy(name, 3000)
    build.dummy("LICENSE.md", 14000)
    build.dummy("README.md", 9000)


def _flux(build: _Build) -> None:
    build.shard("transformer/diffusion_pytorch_model.safetensors", 3)
    build.shard("text_encoder_2/model.safetensors", 2)
    build.dummy("flux1-dev.safetensors", 8192)
    build.dummy("ae.safetensors", 4096)
    build.dummy("dev_grid.jpg", 3000)
    build.dummy("LICENSE.md", 18000)
    build.dummy("README.md", 4000)


def _wan(build: _Build) -> None:
    build.shard("transformer/diffusion_pytorch_model.safetensors", 2)
    build.shard("text_encoder/model.safetensors", 5)
    for name in (
        "comp_effic.png",
        "data_for_diff_stage.jpg",
        "i2v_res.png",
        "logo.png",
        "t2v_res.jpg",
        "vben_vs_sota.png",
        "video_dit_arch.jpg",
        "video_vae_res.jpg",
    ):
        build.dummy(f"assets/{name}", 2500)
    build.dummy("examples/i2v_input.JPG", 2500)
    build.dummy("LICENSE.txt", 11000)
    build.dummy("README.md", 15000)
