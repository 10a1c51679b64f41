"""Working-memory coefficients by measurement (docs/design.md, "Residency"): run each kind's pipeline on this
machine's CPU at a few sizes, measure the peak memory a job takes beyond its loaded weights,
fit ``base_bytes + bytes_per_pixel x size`` per kind by least squares, and print the fit as
TOML for the fleet config (``[working_memory.<kind>]``, app/fleet/config.py). Prints figures, asserts
nothing.

    .venv/bin/python -m bench.memory                       # the tiny models, built in a temp dir
    .venv/bin/python -m bench.memory --model txt2img=DIR   # a real model folder for one kind
    .venv/bin/python -m bench.memory --kind txt2img --steps 2

Method: every (kind, size) runs in a fresh ``python`` subprocess, so no allocator cache or
earlier peak carries over. It loads the pipeline (``tasks.pipelines.load_pipeline``, fp32 on
the CPU), collects garbage, resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` ← 5,
Linux ≥ 4.0), reads the resident set (``VmRSS``), runs the kind's own runner
(``tasks/kinds/<kind>.py``) once, and reads the peak (``VmHWM``): working bytes = peak - RSS
after the load. Size is output pixels x frames x batch (``routing.timings.job_size``; the
upscaler's output is 4x the input per side). The fit is ``numpy.linalg.lstsq``; a negative
intercept is printed as measured and written to the TOML as 0.

What it measures is this machine's CPU with these models: the tiny random-weight pipelines
have a handful of channels per layer, so their figures understate a real model's fp16 GPU
activations by orders of magnitude; use them for the tiny test fleet, and run this with real
model folders (``--model KIND=DIR``) on the target machine for a real fleet. It measures host
memory (RSS), which is what a cpu or unified-memory (mps) machine spends; a CUDA card's
memory would need ``torch.cuda.max_memory_allocated`` around the run, which this script does
not do.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

# (width, height, frames) of the OUTPUT per kind; upscale's input is a quarter per side.
# Kept small so the whole run stays near 2-3 minutes on 2 shared cores: the tiny pipelines
# attend over every latent pixel, so time (and memory) grow faster than linearly with size
# (a 2-step 256x256 txt2img took 106 s and 160 MB here).
SIZES: dict[str, list[tuple[int, int, int]]] = {
    "txt2img": [(64, 64, 1), (96, 96, 1), (128, 128, 1)],
    "edit": [(64, 64, 1), (96, 96, 1), (128, 128, 1)],
    "upscale": [(64, 64, 1), (128, 128, 1), (256, 256, 1)],
    "video": [(64, 64, 4), (64, 64, 8), (96, 96, 8)],
}
UPSCALE_FACTOR = 4


def _status_bytes(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` figure of this process from ``/proc/self/status``, in bytes."""
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")
    return int(found.group(1)) * 1024


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (120, 90, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def measure(kind: str, folder: Path, width: int, height: int, frames: int, steps: int) -> dict[str, Any]:
    """One run in THIS process (call it in a fresh one): peak bytes beyond the loaded pipeline.

    Raises:
        RuntimeError: ``/proc/self/status`` lacks the memory lines (not Linux).
        OSError: the peak mark cannot be reset (``/proc/self/clear_refs`` not writable).
    """
    from tasks.kinds import runner
    from tasks.pipelines import go_offline, load_pipeline, quiet

    go_offline()
    quiet()
    pipeline = load_pipeline(folder)
    params: dict[str, Any] = {"prompt": "a fox", "steps": steps, "seed": 0, "width": width, "height": height}
    inputs: dict[str, bytes] = {}
    if kind == "edit":
        inputs["image"] = _png(width, height)
    elif kind == "upscale":
        inputs["image"] = _png(width // UPSCALE_FACTOR, height // UPSCALE_FACTOR)
    elif kind == "video":
        params.update(frames=frames, format="gif")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    loaded_bytes = _status_bytes("VmRSS")
    started = time.perf_counter()
    runner(kind)(pipeline, params, lambda _step, _total: None, {}, inputs)
    run_s = time.perf_counter() - started
    peak_bytes = _status_bytes("VmHWM")
    return {
        "kind": kind,
        "width": width,
        "height": height,
        "frames": frames,
        "size": width * height * frames,
        "loaded_bytes": loaded_bytes,
        "peak_bytes": peak_bytes,
        "working_bytes": peak_bytes - loaded_bytes,
        "run_s": run_s,
    }


def measure_in_subprocess(kind: str, folder: Path, width: int, height: int, frames: int, steps: int) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter. Raises ``RuntimeError`` with its stderr when it fails."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.memory",
            "--measure",
            kind,
            str(folder),
            str(width),
            str(height),
            str(frames),
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {kind} at {width}x{height}x{frames} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least-squares ``(base_bytes, bytes_per_pixel)`` of working bytes against size."""
    import numpy as np

    sizes = np.array([float(r["size"]) for r in rows])
    working = np.array([float(r["working_bytes"]) for r in rows])
    design = np.column_stack([np.ones_like(sizes), sizes])
    (base, per_pixel), *_ = np.linalg.lstsq(design, working, rcond=None)
    return float(base), float(per_pixel)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", action="append", choices=sorted(SIZES), help="kinds to measure (default: all)")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="KIND=DIR",
        help="a model folder for a kind (default: the tiny model, built in a temp dir)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="denoising steps per run (default 1: the peak of one step is the peak of many)",
    )
    parser.add_argument("--measure", nargs=5, metavar=("KIND", "DIR", "W", "H", "FRAMES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        kind, folder, width, height, frames = args.measure
        print(json.dumps(measure(kind, Path(folder), int(width), int(height), int(frames), args.steps)))
        return

    kinds = args.kind or list(SIZES)
    folders = {kind: Path(path) for kind, path in (item.split("=", 1) for item in args.model)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf-bench-memory-") as scratch:
        missing = [kind for kind in kinds if kind not in folders]
        if missing:
            from app.devtools.tiny_models import make_tiny

            folders.update(make_tiny(Path(scratch), missing))
        fits: dict[str, tuple[float, float]] = {}
        print(f"{'kind':8} {'output':>14} {'size':>9} {'loaded MB':>10} {'peak MB':>9} {'working MB':>11} {'run s':>6}")
        for kind in kinds:
            rows = []
            for width, height, frames in SIZES[kind]:
                row = measure_in_subprocess(kind, folders[kind], width, height, frames, args.steps)
                rows.append(row)
                print(
                    f"{kind:8} {f'{width}x{height}x{frames}':>14} {row['size']:>9} {row['loaded_bytes'] / 1e6:>10.1f} "
                    f"{row['peak_bytes'] / 1e6:>9.1f} {row['working_bytes'] / 1e6:>11.2f} {row['run_s']:>6.2f}",
                    flush=True,
                )
            fits[kind] = fit(rows)
    print()
    print(
        f"# bench/memory.py, {date.today().isoformat()}, steps={args.steps}, fp32 on the CPU; models: "
        + ", ".join(f"{kind}={folders[kind].name}" for kind in kinds)
    )
    print("# fitted: " + "; ".join(f"{kind} base={b:,.0f} B, {p:.2f} B/px" for kind, (b, p) in fits.items()))
    for kind, (base, per_pixel) in fits.items():
        print(f"[working_memory.{kind}]")
        print(f"base_bytes = {max(0, round(base))}")
        print(f"bytes_per_pixel = {max(0.0, round(per_pixel, 2))}")
    print(f"# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
