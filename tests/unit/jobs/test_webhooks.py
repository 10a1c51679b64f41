"""Webhooks, in-process: the signature scheme against a known vector, the receiver's
check, the backoff schedule, the URL check, key ids, the fleet file's allow-list and the
settings' secrets."""

from __future__ import annotations

import hashlib
import hmac
import tomllib

import pytest
from pydantic import ValidationError

from app.core.config import Settings
from app.core.errors import Rejected
from app.fleet.config import Fleet, WebhookConfig, load_fleet
from app.jobs.validation import check_webhook
from app.jobs.webhooks import backoff_s, schedule, sign, signed_material, verify
from tests.helpers import make_fleet

SECRET = "whsec-0123456789abcdef"
BODY = b'{"id":"abc","state":"succeeded"}'
# printf '1700000000.{"id":"abc","state":"succeeded"}' | openssl dgst -sha256 -hmac whsec-0123456789abcdef
VECTOR = "sha256=18b44d2497e64ef9b21757b912ac99dee2a4597a4a6f29c7da4d6a7dcda07cde"


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body_a_known_vector() -> None:
    assert signed_material(1700000000, BODY) == b"1700000000." + BODY
    assert sign(SECRET, 1700000000, BODY) == VECTOR  # computed apart, with openssl
    assert "sha256=" + hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest() == VECTOR


def test_verify_takes_the_signature_within_the_tolerance_only() -> None:
    assert verify(SECRET, "1700000000", VECTOR, BODY, now_s=1700000000 + 299)
    assert not verify(SECRET, "1700000000", VECTOR, BODY, now_s=1700000000 + 301)  # a replay, too old
    assert not verify(SECRET, "1700000001", VECTOR, BODY, now_s=1700000001)  # the timestamp is signed
    assert not verify(SECRET, "1700000000", VECTOR, BODY + b"\n", now_s=1700000000)  # the exact bytes
    assert not verify("another-secret", "1700000000", VECTOR, BODY, now_s=1700000000)
    assert not verify(SECRET, "not-a-number", VECTOR, BODY, now_s=1700000000)


def test_backoff_doubles_from_its_base_up_to_its_cap() -> None:
    assert [backoff_s(n, 1.0, 300.0) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert schedule(5, 1.0, 300.0) == [1.0, 2.0, 4.0, 8.0]  # 5 attempts: 4 pauses, 15 s in all
    assert schedule(12, 1.0, 300.0)[-3:] == [256.0, 300.0, 300.0]
    assert schedule(1, 1.0, 300.0) == []
    defaults = Settings()
    pauses = schedule(defaults.webhook_attempts, defaults.webhook_backoff_s, defaults.webhook_backoff_max_s)
    assert pauses[:3] == [5.0, 10.0, 20.0] and pauses[-1] == 3600.0 and len(pauses) == 17
    assert 8 * 3600 < sum(pauses) < 9 * 3600  # a receiver down for hours still gets its webhook


ALLOWED = ["hooks.example", "127.0.0.1", "::1"]
SECRETS = {"k1": "s" * 16}


@pytest.mark.parametrize(
    "url", ["https://hooks.example/h", "http://HOOKS.example:8080/a?b=c", "http://127.0.0.1/", "http://[::1]:9/x"]
)
def test_an_allowed_host_with_a_keyed_secret_passes(url: str) -> None:
    check_webhook(url, ALLOWED, "k1", SECRETS)


@pytest.mark.parametrize(
    ("url", "key", "message"),
    [
        (
            "https://evil.example/h",
            "k1",
            (
                "webhook_url: host 'evil.example' is not in the fleet's webhook allow-list "
                "['127.0.0.1', '::1', 'hooks.example'] (the fleet file's [webhooks] allow_hosts)"
            ),
        ),
        ("https://hooks.example.evil/h", "k1", "webhook_url: host 'hooks.example.evil' is not in"),
        (
            "file:///etc/passwd",
            "k1",
            "webhook_url: must be an absolute http:// or https:// URL, got 'file:///etc/passwd'",
        ),
        ("hooks.example/h", "k1", "webhook_url: must be an absolute http:// or https:// URL"),
        ("https://a:b@hooks.example/", "k1", "webhook_url: must not carry credentials"),
        (
            "http://127.0.0.1\\@hooks.example/",
            "k1",
            "webhook_url: must not carry credentials",
        ),  # httpx's parse, as sent
        ("http://xn--/", "k1", "webhook_url: 'http://xn--/' is not a valid URL ("),
        ("http://[/", "k1", "webhook_url: host '%5b' is not in the fleet's webhook allow-list"),
        ("http://hooks.example:0/", "k1", "webhook_url: 'http://hooks.example:0/' has an invalid port (0; 1-65535)"),
        ("http://hooks.example/ x", "k1", "webhook_url: must not contain white space or control characters"),
        ("https://hooks.example/", None, "webhook_url: this server's API is open (no API keys)"),
        ("https://hooks.example/", "k2", "webhook_url: the API key (id k2) that submitted it has no webhook secret"),
    ],
)
def test_a_webhook_url_is_refused_naming_the_field_and_the_limit(url: str, key: str | None, message: str) -> None:
    with pytest.raises(Rejected) as refused:
        check_webhook(url, ALLOWED, key, SECRETS)
    assert refused.value.message.startswith(message)
    assert (refused.value.reason, refused.value.param) == ("invalid_webhook_url", "webhook_url")


def test_the_fleet_file_allow_list_is_read_normalised_and_written_back() -> None:
    fleet = make_fleet("m1").model_copy(update={"webhooks": WebhookConfig(allow_hosts=["Hooks.Example", "[::1]"])})
    assert fleet.webhooks.allow_hosts == ["::1", "hooks.example"]
    again = Fleet.model_validate(tomllib.loads(fleet.to_toml()))
    assert again.webhooks.allow_hosts == ["::1", "hooks.example"]
    assert load_fleet(None).webhooks.allow_hosts == []  # the embedded fleet sends no webhook
    with pytest.raises(ValidationError, match=r"webhooks.allow_hosts takes host names or IP addresses"):
        WebhookConfig(allow_hosts=["https://hooks.example/"])
    with pytest.raises(ValidationError, match="allow_host"):
        WebhookConfig.model_validate({"allow_host": ["x"]})  # a misspelt key is refused, not ignored


def test_webhook_secrets_name_configured_keys_and_are_long_enough() -> None:
    key = "a-key-of-this-server-000"
    own = Settings(api_keys=[key]).api_key_id(key)  # key:<12 hex> (app/core/limits.py key_id)
    Settings(api_keys=[key], webhook_secrets={own: "s" * 16})
    quota = {"team": {"key_prefix": "a-key-"}}  # a quota's keys share its name, so its secret
    assert Settings(api_keys=[key], api_key_quotas=quota, webhook_secrets={"team": "s" * 16}).api_key_id(key) == "team"
    with pytest.raises(
        ValidationError,
        match=r"webhook_secrets names key id 'key:000000000000', which is the id of "
        rf"none of api_keys \(their ids: {own}\); `homefleet keys` lists them",
    ):
        Settings(api_keys=[key], webhook_secrets={"key:000000000000": "s" * 16})
    with pytest.raises(ValidationError, match="is 5 characters; a webhook secret needs at least 16"):
        Settings(api_keys=[key], webhook_secrets={own: "short"})
    assert "s" * 16 not in repr(Settings(api_keys=[key], webhook_secrets={own: "s" * 16}))
