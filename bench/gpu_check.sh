#!/usr/bin/env bash
# Residency checks on a CUDA machine (docs/design.md R15, R18, R21; case C05). At most
# ~8 minutes (typically under 2: tiny pipelines). Prints figures; exits non-zero on a failed check.
#   1. C05: tiny checkpoints A, B, C, A through ModelCache + CudaDevice (dedicated policy):
#      torch.cuda.memory_allocated after each unload vs the post-start baseline, no creep.
#   2. R18: after an upscale on the GPU, a tensor of ~90% of the free memory still allocates
#      (no process-wide memory fraction left behind), and torch reports no fraction set.
#   3. R21: a real CUDA OOM is classified "oom", recorded in a private Redis, and placement
#      refuses its identical repeat (remembered_oom).
# Usage: bench/gpu_check.sh   (from the repository root, after `make install` with a CUDA torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
exec timeout 480 "$PY" - "$WORK" <<'PYEOF'
import shutil, sys, time
from pathlib import Path

import torch

from app.devtools.tiny_models import make_tiny
from residency.cache import ModelCache
from tasks.devices import CudaDevice
from tasks.pipelines import load_pipeline, quiet

quiet()
work = Path(sys.argv[1])
assert torch.cuda.is_available(), "no CUDA device: this check needs one"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
folders = make_tiny(work / "models", ["txt2img", "upscale"])
for name in ("A", "B", "C"):
    shutil.copytree(folders["txt2img"], work / name)
failed = []

# 1. C05 ---------------------------------------------------------------------------------
device = CudaDevice(torch)
cache = ModelCache(load_pipeline, device)  # as a worker builds it: CudaDevice.place moves each pipeline to the GPU
torch.cuda.synchronize()
baseline = device.allocated_bytes()
print(f"C05 baseline allocated: {baseline} bytes")
for name in ("A", "B", "C", "A"):
    pipe, load_s, cold = cache.get(name, "k", work / name)
    if pipe.device.type != "cuda":
        failed.append(f"R7: pipeline {name} runs on {pipe.device}, not on the GPU")
    pipe(prompt="x", num_inference_steps=2, width=64, height=64)
    torch.cuda.synchronize()
    held = device.allocated_bytes()
    cache.unload()
    after = device.allocated_bytes()
    print(f"C05 {name}: load {load_s:.2f} s, held {held} bytes, after unload {after} bytes "
          f"(baseline + {after - baseline}), reserved {torch.cuda.memory_reserved()} bytes")
    if after - baseline > 1_000_000:
        failed.append(f"C05: {after - baseline} bytes above baseline after unloading {name}")

# 2. R18 ---------------------------------------------------------------------------------
from PIL import Image

up = cache.get("up", "k", folders["upscale"])[0]
up(prompt="x", image=Image.new("RGB", (16, 16)), num_inference_steps=2)
cache.unload()
getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
if getter is not None:
    fraction = getter(0)
    print(f"R18 per-process memory fraction after upscale: {fraction}")
    if fraction != 1.0:
        failed.append(f"R18: memory fraction {fraction} left after an upscale")
free, total = torch.cuda.mem_get_info()
try:
    big = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
    print(f"R18 allocated {big.numel()} bytes (90% of {free} free of {total}) after an upscale: no cap")
    del big
except torch.OutOfMemoryError as error:
    failed.append(f"R18: 90% of free memory did not allocate after an upscale: {error}")
torch.cuda.empty_cache()

# 3. R21 ---------------------------------------------------------------------------------
from app.core.keys import Keys
from app.devtools.redis_server import start_redis_server
from app.fleet.residency import RedisResidencyFacts
from routing.placement import JobRequest, MachineView, exclusion
from tasks.run_job import failure_reason
import redis

try:
    torch.empty(total * 2, dtype=torch.uint8, device="cuda")
    failed.append("R21: allocating twice the card did not fail")
except torch.OutOfMemoryError as error:
    reason = failure_reason(error)
    print(f"R21 real OOM classified {reason!r}: {str(error)[:100]}")
    server = start_redis_server(work / "redis")
    try:
        facts = RedisResidencyFacts(redis.Redis.from_url(server.url, decode_responses=True), Keys("gpucheck"))
        job = JobRequest.from_params("A", "sd1", "txt2img", "cuda1", {"width": 1024, "height": 1024})
        facts.record_oom("cuda1", "A", "txt2img", job.size, "job-1")
        view = MachineView("cuda1", True, frozenset({"sd1"}), frozenset({"A"}), oom_sizes=facts.oom_sizes("cuda1"))
        refusal = exclusion(job, view)
        print(f"R21 identical repeat: {refusal}")
        if reason != "oom" or not refusal or refusal[0] != "remembered_oom":
            failed.append(f"R21: reason {reason!r}, repeat {refusal}")
    finally:
        server.stop()

print("FAILED:\n  " + "\n  ".join(failed) if failed else "all GPU residency checks passed")
sys.exit(1 if failed else 0)
PYEOF
