"""Real-size model files (docs/benchmarks.md, "Real-size model files"): SD 1.5- and SDXL-sized
pipelines with random weights, built from the family configs shipped in the package
(``app/store/family_configs``; nothing is downloaded), laid out as the real repositories are
(full-precision and ``fp16`` variant files, ``.bin`` twins, a single-file checkpoint at the root
in the original key layout, ONNX / flax / OpenVINO extras), registered with
``homefleet models add`` as a user would, then loaded in a fresh process as a worker loads them.
Prints figures, asserts nothing.

    .venv/bin/python -m bench.real_size                        # sd1 (fp32 and fp16) and sdxl (fp16)
    .venv/bin/python -m bench.real_size --family sd1 --step    # + one 512x512 step's peak on the CPU
    .venv/bin/python -m bench.real_size --dir /big/disk/real   # where the ~20-40 GB of files go

For each family and registered precision it prints:

- the repository's bytes on disk against the registered bytes (the files the pipeline loads),
  and the files taken and left out;
- the estimate (``ModelRecord.weights_bytes``, priced at registration) against the bytes the
  loaded pipeline's tensors hold and against the process's resident-set growth (``VmRSS``, in
  a fresh ``python``) once every tensor has been read: safetensors maps the files, so right
  after ``from_pretrained`` only the pages read so far count (``rss_at_load``), as a job would
  read them all; ratios; goal: within +-10 %;
- with ``--step``: the peak of one 512x512 txt2img step (``VmHWM`` after the step - ``VmRSS``
  after the load, the peak mark reset between, as ``bench/memory.py`` measures) against the
  fleet's working-memory estimate for that size.

Extras that no loader reads (ONNX, flax, OpenVINO, the EMA checkpoint) are sparse files of their
real size: they cost no disk and no time, and registration must leave them out all the same.
The ``.bin`` twins and the single-file checkpoint are real files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.memory import _status_bytes  # VmRSS / VmHWM: one reader for both benches

REPO = Path(__file__).resolve().parent.parent
FAMILY_CONFIGS = REPO / "app" / "store" / "family_configs"

#: family -> (repository name as people download it, the root single-file checkpoint written for
#: real, root extras written as sparse files of their real size in bytes)
LAYOUTS: dict[str, tuple[str, str, dict[str, int]]] = {
    "sd1": (
        "stable-diffusion-v1-5",
        "v1-5-pruned-emaonly.safetensors",
        {
            "v1-5-pruned.safetensors": 7_703_324_286,
            "v1-5-pruned.ckpt": 7_703_807_346,
            "v1-5-pruned-emaonly.ckpt": 4_265_380_512,
        },
    ),
    "sdxl": (
        "stable-diffusion-xl-base-1.0",
        "sd_xl_base_1.0.safetensors",
        {"sd_xl_base_1.0_0.9vae.safetensors": 6_938_078_334, "sd_xl_offset_example-lora_1.0.safetensors": 49_553_604},
    ),
}
#: per-component extras as sparse files (relative name -> bytes of the real repository's file, about)
SDXL_EXTRAS = {
    "unet/diffusion_flax_model.msgpack": 10_270_000_000,
    "unet/model.onnx": 7_650_000,
    "unet/model.onnx_data": 10_270_000_000,
    "unet/openvino_model.bin": 5_140_000_000,
    "unet/openvino_model.xml": 2_500_000,
    "text_encoder_2/model.onnx": 2_780_000_000,
    "vae_decoder/model.onnx": 198_000_000,
    "vae_encoder/model.onnx": 137_000_000,
    "vae_1_0/diffusion_pytorch_model.safetensors": 334_640_000,
}


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(size)


def _random_component(folder: Path, library: str, class_name: str) -> Any:
    """One component of the family config, built on the meta device and given random weights
    (normal, std 0.02: fast, and finite in fp16)."""
    import diffusers
    import torch
    import transformers

    if library == "diffusers":
        cls = getattr(diffusers, class_name)
        config = cls.load_config(str(folder))
        with torch.device("meta"):
            model = cls.from_config(config)
    else:
        cls = getattr(transformers, class_name)
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            model = cls(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def build_repository(family: str, out: Path) -> Path:
    """Lay out a ``family`` repository of real size under ``out`` (see the module docstring).
    Returns its folder. Raises ``KeyError`` for a family without a layout here."""
    import torch
    from safetensors.torch import save_file

    from app.devtools.tiny_models import _tokenizer
    from app.devtools.tiny_single_file import sd_to_original, sdxl_to_original

    name, single_file, root_extras = LAYOUTS[family]
    repo = out / name
    if (repo / ".complete").is_file():
        return repo
    shutil.rmtree(repo, ignore_errors=True)
    config = FAMILY_CONFIGS / family
    shutil.copytree(config, repo)
    index = json.loads((config / "model_index.json").read_text())
    tokenizer = _tokenizer(out / ".tokenizer-scratch")  # a byte-level tokenizer: its size is not what is measured
    components: dict[str, Any] = {}
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or entry[0] is None:
            continue
        library, class_name = entry
        if component.startswith("tokenizer"):
            tokenizer.save_pretrained(str(repo / component))
            continue
        if component == "scheduler":
            continue
        started = time.perf_counter()
        model = _random_component(config / component, library, class_name)
        model.save_pretrained(str(repo / component), safe_serialization=True)
        if family == "sd1":  # SD 1.5's repository has .bin twins of every weight file
            weights = "diffusion_pytorch_model.bin" if library == "diffusers" else "pytorch_model.bin"
            torch.save(model.state_dict(), repo / component / weights)
        model = model.half()
        model.save_pretrained(str(repo / component), safe_serialization=True, variant="fp16")
        components[component] = model
        print(
            f"  {family}/{component}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )

    class _Pipe:  # what the reverse key mapping reads: the components by name
        def __init__(self, parts: dict[str, Any]) -> None:
            self.__dict__.update(parts)

    state = (sd_to_original if family == "sd1" else sdxl_to_original)(_Pipe(components))
    dtype = torch.float32 if family == "sd1" else torch.float16  # as the real files are
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(repo / single_file))
    del state, components
    for extra, size in root_extras.items():
        _sparse(repo / extra, size)
    if family == "sdxl":
        for extra, size in SDXL_EXTRAS.items():
            _sparse(repo / extra, size)
    (repo / "README.md").write_text(f"# {name} (random weights, bench/real_size.py)\n")
    (repo / ".complete").write_text("")
    return repo


def _disk_bytes(folder: Path) -> tuple[int, int]:
    """(apparent bytes, files) of every file under ``folder`` but the bench's own marks."""
    files = [p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sum(p.stat().st_size for p in files), len(files)


def register(data_dir: Path, repo: Path, model_id: str, precision: str) -> dict[str, Any]:
    """``homefleet models add REPO --id ID --precision P`` in a journal of its own; returns the
    record's figures and the command's printed lines."""
    env = {**os.environ, "HOMEFLEET_DATA_DIR": str(data_dir)}
    cli = [sys.executable, "-m", "app.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=env, check=True, capture_output=True, cwd=REPO)
    started = time.perf_counter()
    done = subprocess.run(
        [*cli, "models", "add", str(repo), "--id", model_id, "--precision", precision],
        env={**env, "COLUMNS": "160"},
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    took = time.perf_counter() - started
    from sqlmodel import Session, create_engine, select

    from app.db.tables import ModelFile, ModelRecord

    engine = create_engine(f"sqlite:///{data_dir / 'journal.db'}")
    with Session(engine) as session:
        record = session.get(ModelRecord, model_id)
        files = len(session.exec(select(ModelFile.path).where(ModelFile.model_id == model_id)).all())
        figures = {
            "total_bytes": record.total_bytes,
            "weights_bytes": record.weights_bytes,
            "files": files,
            "register_s": took,
            "printed": done.stdout,
        }
    engine.dispose()
    return figures


def measure_load(folder: Path, precision: str, step: bool) -> dict[str, Any]:
    """Load ``folder`` with the worker's loader in a fresh process; with ``step``, run one
    512x512 txt2img step there. Returns the child's figures (bytes)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.real_size", "--child", str(folder), precision, "1" if step else "0"],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(folder: Path, precision: str, step: bool) -> None:
    import gc

    import torch

    from tasks.pipelines import load_pipeline, quiet

    quiet()
    torch.set_num_threads(os.cpu_count() or 1)
    gc.collect()
    before = _status_bytes("VmRSS")
    started = time.perf_counter()
    pipe = load_pipeline(folder, precision)
    load_s = time.perf_counter() - started
    gc.collect()
    mapped = _status_bytes("VmRSS")
    seen: set[int] = set()
    tensors = 0
    with torch.inference_mode():
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for tensor in [*component.parameters(), *component.buffers()]:
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in seen:
                        seen.add(storage.data_ptr())
                        tensors += storage.nbytes()
                        tensor.sum()  # touch every page: safetensors maps files, pages count once read
    after = _status_bytes("VmRSS")
    figures: dict[str, Any] = {
        "rss_growth": after - before,
        "rss_at_load": mapped - before,
        "tensor_bytes": tensors,
        "load_s": load_s,
    }
    if step:
        Path("/proc/self/clear_refs").write_text("5")
        rss = _status_bytes("VmRSS")
        started = time.perf_counter()
        with torch.inference_mode():
            pipe(
                prompt="a red circle",
                num_inference_steps=1,
                height=512,
                width=512,
                guidance_scale=7.5,
                output_type="pil",
            )
        figures.update(step_s=time.perf_counter() - started, step_peak=_status_bytes("VmHWM") - rss)
    print(json.dumps(figures))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(LAYOUTS), help="default: sd1 and sdxl")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "homefleet-real-size")
    parser.add_argument("--step", action="store_true", help="also one 512x512 SD 1.5 step's peak on the CPU")
    parser.add_argument("--keep", action="store_true", help="keep the registered copies (the repositories are kept)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(Path(args.child[0]), args.child[1], args.child[2] == "1")
        return
    from routing.estimate import WorkingMemory

    families = args.family or ["sd1", "sdxl"]
    precisions = {"sd1": ["fp32", "fp16"], "sdxl": ["fp16"]}
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in families:
        started = time.perf_counter()
        print(f"{family}: building the repository under {args.dir} ...", flush=True)
        repo = build_repository(family, args.dir)
        disk, count = _disk_bytes(repo)
        print(f"{family}: {repo.name}, {count} files, {_mib(disk)} apparent ({time.perf_counter() - started:.0f} s)")
        for precision in precisions[family]:
            data_dir = args.dir / f"data-{family}-{precision}"
            shutil.rmtree(data_dir, ignore_errors=True)
            model_id = f"{family}-{precision}"
            reg = register(data_dir, repo, model_id, precision)
            print(reg["printed"])
            loaded = measure_load(
                data_dir / "models" / model_id, precision, args.step and family == "sd1" and precision == "fp32"
            )
            row = {"family": family, "precision": precision, "repo_bytes": disk, "repo_files": count, **reg, **loaded}
            row.pop("printed")
            if "step_peak" in loaded:
                row["working_estimate"] = WorkingMemory().bytes(family, "txt2img", 512 * 512)
            rows.append(row)
            if not args.keep:
                shutil.rmtree(data_dir, ignore_errors=True)
    print()
    print(
        f"{'model':<12} {'repo':>11} {'registered':>11} {'taken/all':>9} {'estimate':>11} {'tensors':>11} "
        f"{'est/tens':>8} {'RSS grow':>11} {'est/RSS':>7} {'load s':>6}"
    )
    for r in rows:
        print(
            f"{r['family'] + '-' + r['precision']:<12} {_mib(r['repo_bytes']):>11} {_mib(r['total_bytes']):>11} "
            f"{r['files']:>4}/{r['repo_files']:<4} {_mib(r['weights_bytes']):>11} {_mib(r['tensor_bytes']):>11} "
            f"{r['weights_bytes'] / r['tensor_bytes']:>8.3f} {_mib(r['rss_growth']):>11} "
            f"{r['weights_bytes'] / r['rss_growth']:>7.3f} {r['load_s']:>6.1f}"
        )
    for r in rows:
        if "step_peak" in r:
            print(
                f"{r['family']}-{r['precision']} one 512x512 step: {r['step_s']:.1f} s, peak beyond the weights "
                f"{_mib(r['step_peak'])}; the working-memory estimate {_mib(r['working_estimate'])} "
                f"(ratio {r['working_estimate'] / r['step_peak']:.2f})"
            )
    print(json.dumps(rows, default=str))


if __name__ == "__main__":
    main()
