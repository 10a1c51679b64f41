"""Build the default traces under bench/traces/ from seed-fleet.md's workload shape, with
fixed seeds (``python -m bench.make_traces``). The traces are committed; this script documents
how they were made and rebuilds them byte for byte.

Workload shape (docs/benchmarks.md, "Placement"): most jobs are sdxl and flux-dev txt2img; a
trickle of instruction edits in bursts (a user iterates on one image); upscales right after
some txt2img; rare long videos. Targets: 10 % the default (server), 10 % pinned to a machine
the user likes (among those that can run it), 80 % auto.

Load: arrival rate = load x fleet capacity, where capacity is the largest job rate the fleet
could sustain with every job on a machine able to run it, ignoring loads: by Hall's theorem the
minimum, over sets S of job classes (grouped by the machines able to run them), of the summed
speed of the machines able to run some class of S over the speed-1.0 work per job of S.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from bench.sim import BENCH, SimFleet, Simulation, Trace, TraceJob, auto, load_fleet_file, true_factors
from routing.placement import exclusion
from routing.timings import job_size

JOBS = 2000
VIDEO = (848, 480, 33)

MIXES = {
    # session kind -> weight; a session is one job, a txt2img followed by an upscale, or an edit burst.
    "mixed": {"sdxl": 0.40, "flux-dev": 0.26, "sd15": 0.10, "edit": 0.06, "wan-t2v-1.3b": 0.03, "wan-t2v-14b": 0.01},
    "edit_heavy": {
        "sdxl": 0.30,
        "flux-dev": 0.18,
        "sd15": 0.08,
        "edit": 0.30,
        "wan-t2v-1.3b": 0.02,
        "wan-t2v-14b": 0.01,
    },
    "video_heavy": {
        "sdxl": 0.35,
        "flux-dev": 0.20,
        "sd15": 0.08,
        "edit": 0.05,
        "wan-t2v-1.3b": 0.14,
        "wan-t2v-14b": 0.04,
    },
}

TRACES = [
    # (file stem, mix, load, seed, edit burst (min, max), offline window as fractions of the trace)
    ("mixed_50", "mixed", 0.50, 1001, (2, 6), None),
    ("mixed_75", "mixed", 0.75, 1002, (2, 6), None),
    ("mixed_90", "mixed", 0.90, 1003, (2, 6), None),
    ("edit_bursty", "edit_heavy", 0.75, 1004, (4, 12), None),
    ("video_heavy", "video_heavy", 0.75, 1005, (2, 6), None),
    ("offline_mac4", "mixed", 0.75, 1006, (2, 6), ("mac4", 0.35, 0.60)),
]


def session(rng: random.Random, mix: dict[str, float], burst: tuple[int, int]) -> list[dict]:
    """Jobs of one user session, with offsets in seconds from its start."""
    choice = rng.choices(list(mix), weights=list(mix.values()))[0]
    if choice == "edit":
        jobs, offset = [], 0.0
        for _ in range(rng.randint(*burst)):
            jobs.append(
                {
                    "dt": offset,
                    "model": "qwen-image-edit",
                    "kind": "edit",
                    "steps": rng.randint(20, 40),
                    "width": 1024,
                    "height": 1024,
                }
            )
            offset += rng.uniform(30, 120)  # the user looks, edits the instruction, submits again
        return jobs
    if choice.startswith("wan"):
        w, h, f = VIDEO
        return [
            {
                "dt": 0.0,
                "model": choice,
                "kind": "video",
                "steps": rng.randint(30, 50),
                "width": w,
                "height": h,
                "frames": f,
            }
        ]
    side = 512 if choice == "sd15" else rng.choice([1024, 1024, 1024, 768])
    jobs = [
        {"dt": 0.0, "model": choice, "kind": "txt2img", "steps": rng.randint(20, 50), "width": side, "height": side}
    ]
    if rng.random() < 0.25:  # an upscale right after the image
        jobs.append(
            {
                "dt": rng.uniform(20, 90),
                "model": "sd-x4-upscaler",
                "kind": "upscale",
                "steps": rng.randint(4, 20),
                "width": 2048,
                "height": 2048,
            }
        )
    return jobs


def capacity(fleet: SimFleet, jobs: list[TraceJob]) -> float:
    """Jobs per second the fleet could sustain for this job mix (see the module docstring)."""
    sim = Simulation(fleet, Trace("x", {}, jobs), auto, true_factors(fleet))
    views = sim.views()
    speed = {n: m.speed for n, m in fleet.machines.items()}
    work: dict[frozenset[str], float] = {}
    for job in jobs:
        request = sim.request(job)
        able = frozenset(v.name for v in views.values() if exclusion(request, v, sim.estimator) is None)
        work[able] = work.get(able, 0.0) + sim.truth.run_s("server", job.model_id, job.kind, job.steps, job.size)
    per_job = {k: w / len(jobs) for k, w in work.items()}
    best = float("inf")
    classes = list(per_job)
    for r in range(1, len(classes) + 1):
        for subset in itertools.combinations(classes, r):
            machines = frozenset().union(*subset)
            best = min(best, sum(speed[m] for m in machines) / sum(per_job[c] for c in subset))
    return best


def build(
    fleet: SimFleet,
    stem: str,
    mix: str,
    load: float,
    seed: int,
    burst: tuple[int, int],
    offline: tuple[str, float, float] | None,
) -> list[str]:
    rng = random.Random(seed)
    sessions = []
    count = 0
    while count < JOBS:
        s = session(rng, MIXES[mix], burst)
        sessions.append(s)
        count += len(s)
    raw = [j for s in sessions for j in s][:JOBS]
    draft = [
        TraceJob(
            i,
            0.0,
            j["model"],
            j["kind"],
            j["steps"],
            job_size(j["width"] * j["height"], j.get("frames", 1)),
            "auto",
            1.0,
        )
        for i, j in enumerate(raw)
    ]
    rate = load * capacity(fleet, draft)  # jobs per second
    session_rate = rate * len(sessions) / count
    names = sorted(fleet.machines)
    sim = Simulation(fleet, Trace("x", {}, draft), auto, true_factors(fleet))
    views = sim.views()
    lines, t = [], 0.0
    for s in sessions:
        t += rng.expovariate(session_rate)
        for j in s:
            roll = rng.random()
            target = "auto"
            if roll < 0.10:
                target = "server"
            elif roll < 0.20:
                probe = TraceJob(
                    0,
                    0,
                    j["model"],
                    j["kind"],
                    j["steps"],
                    job_size(j["width"] * j["height"], j.get("frames", 1)),
                    "auto",
                    1,
                )
                able = [n for n in names if exclusion(sim.request(probe), views[n], sim.estimator) is None]
                target = rng.choice(able)
            entry = {
                "t": round(t + j["dt"], 3),
                **{k: v for k, v in j.items() if k != "dt"},
                "target": target,
                "noise": round(rng.uniform(0.9, 1.1), 4),
            }
            lines.append(entry)
    lines = sorted(lines, key=lambda e: e["t"])[:JOBS]
    end_s = lines[-1]["t"]
    header: dict = {
        "name": stem,
        "mix": mix,
        "load": load,
        "seed": seed,
        "jobs": len(lines),
        "rate_per_s": round(rate, 6),
    }
    if offline:
        machine, a, b = offline
        header["offline"] = [{"machine": machine, "from_s": round(a * end_s, 1), "to_s": round(b * end_s, 1)}]
    return [json.dumps(header)] + [json.dumps(e) for e in lines]


def main() -> None:
    fleet = load_fleet_file(BENCH / "fleet.toml")
    out = BENCH / "traces"
    out.mkdir(exist_ok=True)
    for stem, mix, load, seed, burst, offline in TRACES:
        lines = build(fleet, stem, mix, load, seed, burst, offline)
        Path(out / f"{stem}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{stem}: {len(lines) - 1} jobs, {json.loads(lines[0])['rate_per_s']} jobs/s")


if __name__ == "__main__":
    main()
