"""Every table of the journal's database, imported in one place so that SQLModel's metadata
(and so Alembic's autogenerate, app/migrations) knows them all."""

from app.journal import Job, JobEvent
from app.pairing import JournalIdentity
from app.registry import ModelFile, ModelRecord
from app.residency_store import RememberedOom, ResidencyCommitment
from app.timings import LearnedTiming

__all__ = ["Job", "JobEvent", "JournalIdentity", "LearnedTiming", "ModelFile", "ModelRecord", "RememberedOom", "ResidencyCommitment"]
