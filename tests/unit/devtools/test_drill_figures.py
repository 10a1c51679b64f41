"""The sentinel drill's ``accept_again_ms`` counts from the master's death (R20): a submission
sent before it, answered 202 by the old master just after, is not the switch's first acceptance."""

from app.devtools.drills import _accepted_since, _Answer


def test_a_202_to_a_submission_sent_before_the_master_died_is_not_an_acceptance_again() -> None:
    died_s = 100.0
    answers = [
        _Answer(sent_s=99.9, answered_s=100.0004, code=202, retry_after=False),  # the old master's
        _Answer(sent_s=100.1, answered_s=100.2, code=503, retry_after=True),
        _Answer(sent_s=100.4, answered_s=103.5, code=202, retry_after=False),  # the new master's
        _Answer(sent_s=103.6, answered_s=103.7, code=202, retry_after=False),
    ]
    assert _accepted_since(answers, died_s) == [103.5, 103.7]
    assert _accepted_since(answers, 104.0) == []
