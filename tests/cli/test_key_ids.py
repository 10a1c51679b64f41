"""``homefleet key-ids`` (issue 22): the id of each configured API key, which the journal keeps and
HOMEFLEET_WEBHOOK_SECRETS is keyed by; a secret for an id of no key stops the command."""

from __future__ import annotations

import json

from app.core.config import api_key_id
from tests.helpers import TEST_API_KEY, TEST_WEBHOOK_SECRET, run_cli

OTHER = "other-api-key-0123456789"


def test_key_ids_lists_each_key_by_id_and_whether_it_has_a_webhook_secret() -> None:
    done = run_cli("key-ids", env={"HOMEFLEET_API_KEYS": json.dumps([TEST_API_KEY, OTHER]),
                                   "HOMEFLEET_WEBHOOK_SECRETS": json.dumps({api_key_id(TEST_API_KEY): TEST_WEBHOOK_SECRET})})
    assert done.stdout.splitlines() == [f"{api_key_id(TEST_API_KEY)}  test…  (webhook secret set)",
                                        f"{api_key_id(OTHER)}  othe…  (no webhook secret)"]
    assert TEST_API_KEY not in done.stdout and TEST_WEBHOOK_SECRET not in done.stdout


def test_a_webhook_secret_for_no_configured_key_is_refused_naming_the_ids() -> None:
    done = run_cli("key-ids", check=False, env={"HOMEFLEET_API_KEYS": json.dumps([TEST_API_KEY]),
                                                "HOMEFLEET_WEBHOOK_SECRETS": json.dumps({"0000": TEST_WEBHOOK_SECRET})})
    assert done.returncode == 2
    assert "invalid_settings" in done.stdout
    assert f"webhook_secrets names key id '0000', which is the id of none of api_keys (their ids: " \
           f"{api_key_id(TEST_API_KEY)})" in " ".join(done.stdout.split())
