"""Random fleets and traces for ``bench/placement.py --random N --seed S``: one seed makes N
cases, each a fleet and a trace, so a run is repeatable and a case can be rerun by its seed
(``case_seeds``).

Fleets: 3-40 machines, the first named ``server`` (the default target, R9: unified memory,
64-192 GB); the others CUDA cards (dedicated, 8-80 GB) or unified-memory machines (8-192 GB,
72 % usable), speeds 0.3-6 (the fastest at least 10x the slowest), some without the video or
edit families, about one in ten committed to keep sd15 or sdxl resident (R16), and about one in
eight offline for a while mid-trace (it returns before the end).

Traces: 150-300 jobs of a random mix of sessions (sdxl, flux-dev and sd15 txt2img, some
followed by an upscale; bursts of qwen-image-edit edits; wan videos; text generation), at a
load of 0.3-1.1 of the fleet's capacity (``bench.make_traces.capacity``), with bursts of
three times the rate, 0-15 % on the default target and 0-25 % pinned to an able machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from app.fleet.config import Backend, Machine
from bench.make_traces import VIDEO, capacity
from bench.sim import SimFleet, Simulation, Trace, TraceJob, auto, true_factors
from residency.device import MemoryKind
from routing.estimate import ModelProfile
from routing.placement import AUTO, SERVER, exclusion
from routing.timings import job_size

GB = 1_000_000_000
TEXT_MODEL = ModelProfile("qwen2.5-7b", "qwen2", 15_200_000_000, None, "text", None, kv_cache_bytes=2 * GB)
SESSIONS = ("sdxl", "flux-dev", "sd15", "edit", "wan-t2v-1.3b", "wan-t2v-14b", "text")
FAMILIES = ("sd1", "sdxl", "flux", "qwen-image", "sd-upscale", "wan", "qwen2")


@dataclass(frozen=True)
class Case:
    seed: int
    fleet: SimFleet
    trace: Trace

    def describe(self) -> str:
        machines = self.fleet.machines.values()
        cuda = sum(m.memory_kind == "dedicated" for m in machines)
        return (
            f"seed={self.seed} machines={len(self.fleet.machines)} (cuda {cuda}) jobs={len(self.trace.jobs)} "
            f"load={self.trace.header['load']:.2f} offline={len(self.trace.offline)} "
            f"committed={len(self.fleet.commitments)}"
        )


def case_seeds(n: int, seed: int) -> list[int]:
    """The seeds of the ``n`` cases of a run with ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(n)]


def random_fleet(rng: random.Random, catalogue: SimFleet) -> SimFleet:
    """A fleet as the module docstring says, over ``catalogue``'s models and the text model."""
    n = rng.randint(3, 40)
    machines = {}
    for i in range(n):
        name = SERVER if i == 0 else f"m{i:02d}"
        cuda = i > 0 and rng.random() < 0.45
        families = set(FAMILIES)
        if i > 0 and rng.random() < 0.2:
            families -= {"wan", "qwen-image"}
        if cuda:
            memory = int((rng.choice([8, 12, 16, 24, 24, 48, 80]) - 1.5) * GB)
            speed, load = math.exp(rng.uniform(math.log(1.0), math.log(6.0))), rng.uniform(1.0e9, 3.0e9)
        else:
            memory = int(
                0.72 * (rng.uniform(64, 192) if i == 0 else rng.choice([8, 16, 24, 32, 36, 48, 64, 96, 128, 192])) * GB
            )
            speed, load = math.exp(rng.uniform(math.log(0.3), math.log(1.5))), 2.5e9
        machines[name] = Machine(
            name=name,
            backend=Backend("cuda" if cuda else "mps"),
            memory_kind=MemoryKind("dedicated" if cuda else "unified"),
            memory_bytes=memory,
            families=frozenset(families),
            speed=speed,
            load_bytes_per_s=load,
        )
    speeds = sorted(machines.values(), key=lambda m: m.speed)
    if speeds[-1].speed / speeds[0].speed < 10:  # speeds over 10x in every fleet
        slow = speeds[0]
        machines[slow.name] = slow.model_copy(update={"speed": speeds[-1].speed / rng.uniform(10, 15)})
    models = {**catalogue.models, TEXT_MODEL.model_id: TEXT_MODEL}
    commitments = {}
    for name, m in machines.items():
        if name != SERVER and rng.random() < 0.1:
            model = rng.choice(["sd15", "sdxl"])
            if models[model].weights_bytes * 2 < m.memory_bytes:
                commitments[name] = frozenset({model})
    return SimFleet(machines, models, {m: p.kind for m, p in models.items()}, commitments)


def session(rng: random.Random, mix: dict[str, float]) -> list[dict]:
    """One user session's jobs with offsets in seconds from its start."""
    choice = rng.choices(list(mix), weights=list(mix.values()))[0]
    if choice == "edit":
        jobs, offset = [], 0.0
        for _ in range(rng.randint(2, 10)):
            jobs.append(
                {
                    "dt": offset,
                    "model": "qwen-image-edit",
                    "kind": "edit",
                    "steps": rng.randint(20, 40),
                    "size": job_size(1024 * 1024),
                }
            )
            offset += rng.uniform(30, 120)
        return jobs
    if choice == "text":
        return [
            {
                "dt": 0.0,
                "model": TEXT_MODEL.model_id,
                "kind": "text",
                "steps": rng.randint(64, 1024),
                "size": rng.randint(50, 4000),
            }
        ]
    if choice.startswith("wan"):
        w, h, f = VIDEO
        return [{"dt": 0.0, "model": choice, "kind": "video", "steps": rng.randint(30, 50), "size": job_size(w * h, f)}]
    side = 512 if choice == "sd15" else rng.choice([1024, 1024, 1024, 768])
    jobs = [
        {"dt": 0.0, "model": choice, "kind": "txt2img", "steps": rng.randint(20, 50), "size": job_size(side * side)}
    ]
    if rng.random() < 0.25:
        jobs.append(
            {
                "dt": rng.uniform(20, 90),
                "model": "sd-x4-upscaler",
                "kind": "upscale",
                "steps": rng.randint(4, 20),
                "size": job_size(2048 * 2048),
            }
        )
    return jobs


def random_case(seed: int, catalogue: SimFleet) -> Case:
    """The fleet and trace of one case (the module docstring); same seed, same case."""
    rng = random.Random(seed)
    fleet = random_fleet(rng, catalogue)
    mix = {
        "sdxl": rng.uniform(0.1, 0.5),
        "flux-dev": rng.uniform(0.05, 0.35),
        "sd15": rng.uniform(0.0, 0.15),
        "edit": rng.uniform(0.0, 0.2),
        "wan-t2v-1.3b": rng.uniform(0.0, 0.1),
        "wan-t2v-14b": rng.uniform(0.0, 0.04),
        "text": rng.uniform(0.0, 0.3),
    }
    count = rng.randint(150, 300)
    load = rng.uniform(0.3, 1.1)
    sessions, total = [], 0
    while total < count:
        s = session(rng, mix)
        sessions.append(s)
        total += len(s)
    raw = [j for s in sessions for j in s][:count]
    draft = [TraceJob(i, 0.0, j["model"], j["kind"], j["steps"], j["size"], AUTO, 1.0) for i, j in enumerate(raw)]
    sim = Simulation(fleet, Trace("draft", {}, draft), auto, true_factors(fleet))
    views = sim.views()
    able_of = {}
    for job in draft:
        able_of[job.index] = [n for n in sorted(views) if exclusion(sim.request(job), views[n], sim.estimator) is None]
    fit = [j for j in draft if able_of[j.index]]
    rate = load * capacity(fleet, fit) if fit else 1.0
    session_rate = rate * len(sessions) / total
    default_share, pinned_share = rng.uniform(0.0, 0.15), rng.uniform(0.0, 0.25)
    bursts = [(a, a + rng.uniform(0.05, 0.15)) for a in (rng.uniform(0, 0.9) for _ in range(rng.randint(0, 3)))]
    jobs, t, index = [], 0.0, 0
    for k, s in enumerate(sessions):
        position = k / len(sessions)
        t += rng.expovariate(session_rate * (3.0 if any(a <= position < b for a, b in bursts) else 1.0))
        for j in s:
            if index >= count:
                break
            roll, target = rng.random(), AUTO
            if roll < default_share:
                target = SERVER
            elif roll < default_share + pinned_share and able_of[index]:
                target = rng.choice(able_of[index])
            jobs.append((t + j["dt"], j, target, rng.uniform(0.9, 1.1)))
            index += 1
    jobs.sort(key=lambda e: e[0])
    trace_jobs = [
        TraceJob(i, round(t_s, 3), j["model"], j["kind"], j["steps"], j["size"], target, noise)
        for i, (t_s, j, target, noise) in enumerate(jobs)
    ]
    end_s = trace_jobs[-1].t_s
    offline = []
    for name in sorted(fleet.machines):
        if rng.random() < 0.12:
            a = rng.uniform(0.1, 0.7)
            offline.append(
                {"machine": name, "from_s": round(a * end_s, 1), "to_s": round((a + rng.uniform(0.05, 0.3)) * end_s, 1)}
            )
    name = f"random_{seed}"
    header = {"name": name, "load": load, "seed": seed, "jobs": len(trace_jobs), "offline": offline}
    return Case(seed, fleet, Trace(name, header, trace_jobs))
