"""Learned timings persisted in the journal database (R13), so a restart keeps them.

The table (``app/db/tables.py``, ``LearnedTiming``) holds one row per (machine, model, kind): load seconds and seconds
per step at the reference size, with the exponent a step's seconds grow with the size and the
last run it was learned from, and the large misses in a row that would replace it
(``routing.timings``); for text jobs seconds per new token (``step_s``) and per
prompt token (``prompt_s``), learned from the tokens in the job's provenance ``usage``. Every finished job with
measured times is folded in.
A job with LoRA adapters also teaches each adapter's load seconds onto a warm
pipeline, row (machine, adapter, ``adapter``): the provenance's ``adapter_load_s`` shared
equally among its adapters.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.core.kinds import job_request
from app.db.tables import Job, LearnedTiming, utcnow
from routing.estimate import Estimator
from routing.timings import ADAPTER_KIND, TEXT_KIND, LearnedTimings, Timing


class TimingStore:
    """The learned timings table; ``on_change`` is called after every committed write (the
    server replaces the timings' change mark there, app/fleet/costs.py)."""

    def __init__(self, engine: Engine, on_change: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_change = on_change

    def load(self) -> LearnedTimings:
        """Every stored timing."""
        with Session(self.engine) as session:
            rows = session.exec(select(LearnedTiming)).all()
        return LearnedTimings(
            {
                (r.machine, r.model_id, r.kind): Timing(
                    r.load_s,
                    r.step_s,
                    r.samples,
                    r.load_samples,
                    r.prompt_s,
                    size_exp=r.size_exp,
                    size_samples=r.size_samples,
                    anchor_size=r.anchor_size,
                    anchor_step_s=r.anchor_step_s,
                    misses=r.misses,
                    small_step_s=r.small_step_s,
                )
                for r in rows
            }
        )

    def forget(self, machine: str, model_id: str | None = None, kind: str | None = None) -> int:
        """Delete ``machine``'s learned timings (all, or of one model and/or kind): it is priced
        by the fleet config's guesses again until its next runs are measured (R13), e.g. after a
        repair that made it fast again, which Auto would not learn while it prices the machine
        too slow to send it jobs. Returns how many (machine, model, kind) rows went."""
        with Session(self.engine) as session:
            query = select(LearnedTiming).where(LearnedTiming.machine == machine)
            if model_id is not None:
                query = query.where(LearnedTiming.model_id == model_id)
            if kind is not None:
                query = query.where(LearnedTiming.kind == kind)
            rows = session.exec(query).all()
            for row in rows:
                session.delete(row)
            session.commit()
        if rows and self.on_change is not None:
            self.on_change()
        return len(rows)

    def observe(self, job: Job, estimator: Estimator) -> Timing | None:
        """Fold a finished job's measured ``load_s`` (when it was a cold load) and ``run_s`` in,
        and its adapters' load seconds; returns the model's new timing, None when the
        job has no machine or no run time."""
        if job.machine is None or job.run_s is None:
            return None
        request = job_request(job.model_id, "", job.kind, job.machine, job.params)
        steps, size = request.steps, request.size
        usage = (job.provenance or {}).get("usage") if job.kind == TEXT_KIND else None
        if isinstance(usage, dict):  # a text job: the tokens it really read and generated
            steps, size = int(usage.get("completion_tokens", 0)), int(usage.get("prompt_tokens", 0))
        learned = estimator.learned
        timing = learned.observe(
            job.machine,
            job.model_id,
            job.kind,
            guess=estimator.guess(job.machine, job.model_id, job.kind),
            run_s=job.run_s,
            steps=steps,
            size=size,
            load_s=job.load_s if job.cold_load else None,
            batch=request.batch,
        )
        folded = {job.model_id: (job.kind, timing)}
        adapters = request.adapters
        adapter_load_s = (job.provenance or {}).get("adapter_load_s")
        if adapters and isinstance(adapter_load_s, int | float) and adapter_load_s >= 0:
            for adapter in dict.fromkeys(adapters):  # a load onto the warm pipeline, no run of its own
                folded[adapter] = (
                    ADAPTER_KIND,
                    learned.observe(
                        job.machine,
                        adapter,
                        ADAPTER_KIND,
                        guess=estimator.guess(job.machine, adapter, ADAPTER_KIND),
                        run_s=0.0,
                        steps=1,
                        size=1,
                        load_s=float(adapter_load_s) / len(adapters),
                    ),
                )
        with Session(self.engine) as session:
            for model_id, (kind, learnt) in folded.items():
                self._store(session, job.machine, model_id, kind, learnt)
            session.commit()
        if self.on_change is not None:
            self.on_change()
        return timing

    @staticmethod
    def _store(session: Session, machine: str, model_id: str, kind: str, timing: Timing) -> None:
        row = session.get(LearnedTiming, (machine, model_id, kind))
        if row is None:
            row = LearnedTiming(
                machine=machine,
                model_id=model_id,
                kind=kind,
                load_s=timing.load_s,
                step_s=timing.step_s,
                samples=timing.samples,
                load_samples=timing.load_samples,
                prompt_s=timing.prompt_s,
            )
        else:
            row.load_s, row.step_s, row.samples, row.updated_at = timing.load_s, timing.step_s, timing.samples, utcnow()
            row.load_samples, row.prompt_s = timing.load_samples, timing.prompt_s
        row.size_exp, row.size_samples = timing.size_exp, timing.size_samples
        row.anchor_size, row.anchor_step_s = timing.anchor_size, timing.anchor_step_s
        row.misses, row.small_step_s = timing.misses, timing.small_step_s
        session.add(row)
