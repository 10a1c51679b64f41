"""A ``sentinel://`` HOMEFLEET_REDIS_URL (docs/operations.md, "Redis Sentinel"): parsed in one
home (app/core/connections.py) for redis-py and kombu alike; nothing connects here."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from redis.sentinel import SentinelConnectionPool

from app.core.celery_app import create_celery
from app.core.config import BrokerSettings
from app.core.connections import create_redis, redacted_url, sentinel_nodes

URL = "sentinel://:p%40ss@s1:26379/2;sentinel://:p%40ss@s2:26380/2;sentinel://s3"


def test_sentinel_nodes_hosts_ports_db_and_the_masters_password() -> None:
    nodes, master = sentinel_nodes(URL)
    assert nodes == [("s1", 26379), ("s2", 26380), ("s3", 26379)]
    assert master == {"db": 2, "password": "p@ss"}


def test_a_sentinel_url_needs_the_master_name() -> None:
    with pytest.raises(ValidationError, match="redis_sentinel_master"):
        BrokerSettings(redis_url=URL)
    with pytest.raises(ValidationError, match="each as sentinel://"):
        BrokerSettings(redis_url="sentinel://s1:26379;redis://s2:6379", redis_sentinel_master="m")


def test_redacted_url_hides_every_sentinels_password() -> None:
    assert redacted_url(URL) == "sentinel://:***@s1:26379/2;sentinel://:***@s2:26380/2;sentinel://s3"


def test_the_servers_client_and_the_broker_follow_the_named_master() -> None:
    settings = BrokerSettings(redis_url=URL, redis_sentinel_master="hfmaster")
    client = create_redis(settings)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "hfmaster"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "p@ss"
    assert pool.connection_kwargs["decode_responses"] is True
    for consumer, transport in ((False, None), (True, "hfsentinel")):
        app = create_celery(settings, consumer=consumer)
        options = app.conf.broker_transport_options
        assert options["master_name"] == "hfmaster"
        assert options["sentinel_kwargs"] == {"socket_timeout": 10, "socket_connect_timeout": 10}  # celery#7997
        assert app.conf.broker_transport == transport
        assert app.conf.broker_url == URL
        assert app.conf.broker_connection_max_retries is None  # a worker retries for ever (celery#6348)
