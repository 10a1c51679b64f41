"""What the API shows of a journaled job (app/api/schemas.py)."""

from __future__ import annotations

import pytest

from app.api.schemas import JobPublic
from app.core.states import JobState
from app.db.tables import Job


@pytest.mark.parametrize(("given", "shown"), [(7, 7), ("\x12ñ", None), (True, None), (None, None)])
def test_a_refused_jobs_params_as_given_never_break_its_record(given: object, shown: int | None) -> None:
    """A ``rejected`` job keeps the params the client sent (R19), a seed that is no integer
    included; listing it must still work (it was a 500 on ``GET /v1/jobs``)."""
    job = Job(
        id="a" * 32,
        state=JobState.rejected,
        model_id="m",
        kind="txt2img",
        params={"seed": given},
        target="auto",
        reason="invalid_params",
    )
    assert JobPublic.from_job(job).seed == shown
