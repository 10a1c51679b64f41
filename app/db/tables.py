"""Every table of the journal's database, imported in one place so that SQLModel's metadata
(and so Alembic's autogenerate, app/migrations) knows them all."""

from app.journal.jobs import Job, JobEvent
from app.fleet.pairing import JournalIdentity
from app.store.registry import ModelFile, ModelRecord
from app.fleet.residency_store import RememberedOom, ResidencyCommitment
from app.journal.timings import LearnedTiming

__all__ = ["Job", "JobEvent", "JournalIdentity", "LearnedTiming", "ModelFile", "ModelRecord", "RememberedOom", "ResidencyCommitment"]
