"""What Auto keeps between decisions (R12) must never change a decision: Drains (a machine's
queue drained once while unchanged) and Scarcity (able sets and their spread, kept while the
machines' capabilities and the demand classes are unchanged) against fresh computations, over
random sequences of the changes a fleet goes through."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from routing.demand import Demand, able_with_pinned, pinned_class, pressure, with_default_share
from routing.finish import Drains, WorkItem, drain, expected_finish
from routing.placement import DEFAULT_TARGET, able_machines, place
from routing.scarcity import Scarcity
from routing.timings import REFERENCE_SIZE
from tests.unit.routing.test_placement import MODEL, costs, request, view

MODELS = (MODEL, "other", "big", "video")
NAMES = ("server", "m1", "m2", "cuda1")


def item(rng: random.Random, running: bool = False) -> WorkItem:
    model = rng.choice(MODELS)
    return WorkItem(
        model,
        "video" if model == "video" else "txt2img",
        rng.randint(4, 40),
        REFERENCE_SIZE // rng.choice([1, 2, 4]),
        elapsed_s=rng.uniform(0, 30) if running else None,
    )


@pytest.mark.parametrize("seed", range(10))
def test_r12_kept_drains_equal_fresh_drains_as_queues_change(seed: int) -> None:
    rng = random.Random(seed)
    estimator = costs()
    drains = Drains()
    queues = {n: [item(rng) for _ in range(rng.randint(0, 4))] for n in NAMES}
    warm = {n: tuple(rng.sample(MODELS, rng.randint(0, 2))) for n in NAMES}
    protected = {n: frozenset() for n in NAMES}
    for _ in range(200):
        name = rng.choice(NAMES)
        change = rng.choice(["append", "start", "finish", "tick", "warm", "commit", "learn", "nothing"])
        queue = queues[name]
        if change == "append":
            queue.append(item(rng))
        elif change == "start" and queue and queue[0].elapsed_s is None:
            queue[0] = replace(queue[0], elapsed_s=0.0)
        elif change == "finish" and queue:
            queue.pop(0)
        elif change == "tick" and queue and queue[0].elapsed_s is not None:
            queue[0] = replace(queue[0], elapsed_s=queue[0].elapsed_s + rng.uniform(0.1, 5))
        elif change == "warm":
            warm[name] = tuple(rng.sample(MODELS, rng.randint(0, 3)))
        elif change == "commit":
            protected[name] = frozenset(rng.sample(MODELS, rng.randint(0, 1)))
        elif change == "learn":  # a learned timing folded in: the same Estimator, new figures
            model = rng.choice(MODELS)
            estimator.learned.observe(
                name,
                model,
                "txt2img",
                guess=estimator.guess(name, model, "txt2img"),
                run_s=rng.uniform(1, 50),
                steps=10,
                size=REFERENCE_SIZE,
                load_s=rng.choice([None, rng.uniform(1, 30)]),
            )
        for n in NAMES:
            args = {"warm_models": warm[n], "queue": tuple(queues[n]), "protected": protected[n], "costs": estimator}
            kept_s, kept_warm = drains(n, **args)
            fresh_s, fresh_warm = drain(n, **args)
            assert kept_s == pytest.approx(fresh_s) and kept_warm == fresh_warm, (n, change)
            job = item(rng)  # a job appended: its kept tail (Drains.tail) as computed afresh
            shape = (n, job.model_id, job.kind, job.steps, job.size)
            extra = rng.randint(0, 2)
            kept = expected_finish(*shape, **args, extra_queued=extra, drains=drains)
            fresh = expected_finish(*shape, **args, extra_queued=extra)
            assert kept.work_ahead_s == pytest.approx(fresh.work_ahead_s), (n, change)  # summed in another order
            assert replace(kept, work_ahead_s=fresh.work_ahead_s) == fresh, (n, change)


@pytest.mark.parametrize("seed", range(10))
def test_r12_kept_scarcity_equals_fresh_pressure_and_decisions_as_machines_change(seed: int) -> None:
    rng = random.Random(seed)
    estimator = costs()
    catalogue = {m: (p.family, p.kind) for m, p in estimator.models.items()}
    speed = {n: rng.choice([0.5, 1.0, 3.0]) for n in NAMES}
    views = {n: view(n) for n in NAMES}
    scarcity, drains = Scarcity(), Drains()
    demand = Demand()
    for step in range(150):
        name = rng.choice(NAMES)
        v = views[name]
        change = rng.choice(["offline", "online", "verify", "commit", "oom", "full", "queue", "demand", "pin"])
        if change == "offline":
            views[name] = replace(v, online=False)
        elif change == "online":
            views[name] = replace(v, online=True)
        elif change == "verify":
            views[name] = replace(v, verified_models=frozenset(rng.sample(MODELS, rng.randint(0, len(MODELS)))))
        elif change == "commit":
            views[name] = replace(v, commitments=frozenset(rng.sample(MODELS, rng.randint(0, 1))))
        elif change == "oom":
            views[name] = replace(v, oom_sizes={(rng.choice(MODELS), "txt2img"): REFERENCE_SIZE // 2})
        elif change == "full":
            views[name] = replace(v, max_queued=rng.choice([None, 1, 3]))
        elif change == "queue":
            queue = ((*v.queue, item(rng)))[-4:]
            views[name] = replace(v, queue=queue, backlog=len(queue))
        elif change == "pin":
            demand.add(pinned_class(rng.choice(MODELS), name), rng.uniform(5, 300), now_s=float(step))
        else:
            demand.add(rng.choice(MODELS), rng.uniform(5, 300), now_s=float(step))
        rates = demand.rates(float(step))
        kept = scarcity.pressure(views, estimator, catalogue, rates, speed)
        online = {n: x for n, x in views.items() if x.online}
        rates = with_default_share(rates, DEFAULT_TARGET)  # as Scarcity.pressure does
        fresh = pressure(
            rates, able_with_pinned(able_machines(online, estimator, catalogue), rates), {n: speed[n] for n in online}
        )
        assert kept == fresh, change
        job = request("auto", model=rng.choice([MODEL, "other"]))
        try:
            kept_decision = place(job, views, estimator, kept, drains)
        except Exception as refused:  # noqa: BLE001 - no machine: both must refuse alike
            with pytest.raises(type(refused)):
                place(job, views, estimator, fresh)
            continue
        assert kept_decision == place(job, views, estimator, fresh), change
