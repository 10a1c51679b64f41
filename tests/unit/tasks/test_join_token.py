"""Where ``homefleet worker join`` reads its join token (tasks/join.py ``read_join_token``): the
argument, a file, or stdin, for the argument ``-`` and for ``--join-token-file -`` alike, as
docs/operations.md shows (``--join-token-file -`` was read as a file named ``-``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from app.core.errors import HomefleetError
from tasks.join import read_join_token


@pytest.mark.parametrize(("given", "token_file"), [("-", None), (None, Path("-")), (None, None)])
def test_the_join_token_is_read_from_stdin(
    monkeypatch: pytest.MonkeyPatch, given: str | None, token_file: Path | None
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("jt-from-stdin\n"))
    assert read_join_token(given, token_file) == "jt-from-stdin"


def test_the_join_token_from_the_argument_or_a_file_and_none_is_one_named_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    saved = tmp_path / "join-token"
    saved.write_text("jt-from-file\n")
    assert read_join_token("jt-given", None) == "jt-given"
    assert read_join_token(None, saved) == "jt-from-file"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(HomefleetError) as missing:
        read_join_token(None, Path("-"))
    assert missing.value.reason == "join_token_missing"
