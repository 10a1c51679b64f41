"""The real-HTTP fuzz run, bounded (R22, R24): schemathesis with all its checks and
its stateful phase (OpenAPI links from a submission to its job) against ``homefleet serve``
and a real ``celery worker`` holding a verified tiny model of every kind (app/devtools/fuzz.py).
No failure, no 5xx but the documented 503, no 422 to a schema-valid request but for what a
schema cannot state (app/devtools/fuzz_hooks.py), every route reached, and every job the
journal accepted ends. ``make
fuzz`` runs the same with every phase and >= 5,000 cases; ``HOMEFLEET_FUZZ_EXAMPLES`` and
``HOMEFLEET_FUZZ_PHASES`` set the bound here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.core.states import ENDED
from app.devtools.fuzz import run_fuzz

EXAMPLES = int(os.environ.get("HOMEFLEET_FUZZ_EXAMPLES", "10"))
#: Within the suite: without schemathesis' coverage phase (its ~900 boundary cases run in
#: ``make fuzz``), a few hundred cases.
PHASES = os.environ.get("HOMEFLEET_FUZZ_PHASES", "examples,fuzzing,stateful")
#: Each image or text request waits 1 s for its job (``Prefer: wait=1``), then gets 409
#: ``job_pending``: the same answers as ``make fuzz``'s 5 s, in a third of the time (~50 s alone).
WAIT_S = 1


@pytest.mark.timeout(1200)  # a fleet start, ~1,000 requests over HTTP, real jobs and the drain on 2 shared cores
def test_r22_r24_schemathesis_over_real_http_finds_nothing_and_every_accepted_job_ends(tmp_path: Path) -> None:
    report = run_fuzz(tmp_path / "fuzz", EXAMPLES, phases=PHASES, wait_s=WAIT_S, forkserver=True)
    print(f"\n{report.summary()}\n" + "\n".join(report.route_lines()))
    assert report.sound and report.failures == 0, (report.runtime_errors, report.output)
    assert report.server_errors == 0, report.statuses
    assert not report.unended, f"accepted jobs that never ended: {report.unended}"
    assert report.cases >= 200, report.summary()
    # every route of the document was reached, the job routes with a model of each kind (app/devtools/fuzz.py)
    assert report.operations >= 25 and len(report.routes) == report.operations, report.route_lines()
    assert report.statuses[202] + report.statuses[200] > 0  # valid bodies were accepted, not only refused
    assert report.states.get("succeeded", 0) > 0  # and their jobs really ran on the worker
    assert set(report.states) <= {str(state) for state in ENDED}
