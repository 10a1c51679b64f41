"""How ``homefleet fuzz`` judges schemathesis' own runtime errors (app/devtools/fuzz.py): only
the known-benign ones (a client crash before any request) are waived; any other, a failure, or
an exit code other than 1 fails the run. And the hook that puts real uploads into bodies
(app/devtools/fuzz_hooks.py) touches schema-valid cases only."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from app.devtools import fuzz_hooks
from app.devtools.fuzz import FuzzReport

AST = "SystemError: AST constructor recursion depth mismatch (before=216, after=195) (coverage, POST /generate)"
FLAKY = "FlakyFailure: Inconsistent results (coverage, POST /generate_stream)"


def test_only_known_benign_runtime_errors_are_waived() -> None:
    assert FuzzReport(exit_code=0).sound
    benign = FuzzReport(exit_code=1, errors=2, runtime_errors=[AST, AST])
    assert benign.sound and benign.unknown_runtime_errors == []
    assert "2 runtime errors (0 not known-benign), exit 1" in benign.summary()
    other = FuzzReport(exit_code=1, errors=2, runtime_errors=[AST, FLAKY])
    assert not other.sound and other.unknown_runtime_errors == [FLAKY]
    assert not FuzzReport(exit_code=1, errors=1, failures=1, runtime_errors=[AST]).sound  # a failure as well
    assert not FuzzReport(exit_code=1, errors=2, runtime_errors=[AST]).sound  # an error the report did not name
    assert not FuzzReport(exit_code=2, errors=1, runtime_errors=[AST]).sound  # schemathesis could not run
    assert not FuzzReport(exit_code=1).sound  # exit 1 with no error: a failure it counted


def case(path: str, body: dict[str, Any], positive: bool = True, negative_part: bool = False) -> Any:
    mode = SimpleNamespace(is_positive=positive, is_negative=not positive)
    components = {"query": SimpleNamespace(mode=SimpleNamespace(is_negative=negative_part))}
    return SimpleNamespace(
        method="POST",
        operation=SimpleNamespace(path=path),
        body=body,
        meta=SimpleNamespace(generation=SimpleNamespace(mode=mode), components=components),
    )


def test_uploaded_inputs_go_into_schema_valid_bodies_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    png = tmp_path / "image.png"
    png.write_bytes(b"\x89PNG fake")
    image, mask = "blake3:" + "a" * 64, "blake3:" + "b" * 64
    monkeypatch.setenv(fuzz_hooks.INPUTS_ENV, json.dumps({"pairs": [[image, mask]], "png": str(png)}))
    monkeypatch.setattr(fuzz_hooks, "REAL_INPUT_SHARE", 1.0)
    generated = "blake3:" + "0" * 64
    job = case(
        "/v1/jobs",
        {"kind": "inpaint", "params": {"image": generated, "mask": generated, "steps": 1, "strength": 5e-324}},
    )
    fuzz_hooks.use_uploaded_inputs(job)
    assert job.body["params"] == {"image": image, "mask": mask, "steps": 1, "strength": 1.0}
    upscale = case("/v1/jobs", {"kind": "upscale", "params": {"image": generated}})
    fuzz_hooks.use_uploaded_inputs(upscale)
    assert upscale.body["params"] == {"image": image}  # no mask added where the body had none
    edits = case("/v1/images/edits", {"image": b"random", "prompt": "p"})
    fuzz_hooks.use_uploaded_inputs(edits)
    assert edits.body == {"image": b"random", "prompt": "p"}  # multipart edits are left as generated
    negative = case("/v1/jobs", {"kind": "edit", "params": {"image": 5}}, positive=False)
    fuzz_hooks.use_uploaded_inputs(negative)
    assert negative.body["params"] == {"image": 5}  # a negative case is left as generated
    part = case("/v1/jobs", {"kind": "edit", "params": {"image": generated}}, negative_part=True)
    fuzz_hooks.use_uploaded_inputs(part)
    assert part.body["params"] == {"image": generated}  # and one with any negative component
    upload = case("/v1/files", {"file": b"random"})
    fuzz_hooks.use_uploaded_inputs(upload)
    assert upload.body == {"file": b"random"}  # uploads were made before the run
