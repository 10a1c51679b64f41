"""A local Redis Sentinel set for drills and tests (docs/operations.md, "Redis Sentinel"): a
master, one replica and three Sentinels (``redis-server --sentinel``) on free ports of 127.0.0.1,
with short detection times so that a failover takes seconds."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from app.devtools.procs import stop_process_group
from app.devtools.redis_server import RedisProcess, free_port, redis_answers, redis_server_binary, start_redis_server

MASTER_NAME = "hfmaster"
DOWN_AFTER_MS = 1000  # Sentinel's down-after-milliseconds: the master is judged down after 1 s without answers
FAILOVER_TIMEOUT_MS = 5000


@dataclass
class SentinelSet:
    """A master, a replica and three Sentinels this process started; :meth:`stop` ends them all."""

    work_dir: Path
    password: str
    master_name: str = MASTER_NAME
    nodes: dict[int, RedisProcess] = field(default_factory=dict)  # data nodes by port
    sentinels: list[subprocess.Popen[bytes]] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``HOMEFLEET_REDIS_URL``: kombu's ``sentinel://:pw@h:p/0;...`` form, one part per Sentinel."""
        return ";".join(f"sentinel://:{self.password}@127.0.0.1:{port}/0" for port in self.sentinel_ports)

    def master_port(self) -> int:
        """The port Sentinels name as master now (the first Sentinel that answers).

        Raises:
            RuntimeError: no Sentinel answers."""
        for port in self.sentinel_ports:
            try:
                client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)
                address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
                client.close()
                return int(address[1])
            except (redis.RedisError, OSError, TypeError):
                continue
        raise RuntimeError("no Sentinel answers")

    def start(self) -> SentinelSet:
        master_port, replica_port = free_port(), free_port()
        self.nodes[master_port] = start_redis_server(
            self.work_dir / "master",
            port=master_port,
            password=self.password,
            extra_config=f"masterauth {self.password}\n",
        )
        self.nodes[replica_port] = start_redis_server(
            self.work_dir / "replica",
            port=replica_port,
            password=self.password,
            extra_config=f"masterauth {self.password}\nreplicaof 127.0.0.1 {master_port}\n",
        )
        self.wait_replicated(master_port, timeout_s=30)
        for index in range(3):
            port = free_port()
            folder = self.work_dir / f"sentinel-{index}"
            folder.mkdir(parents=True, exist_ok=True)
            config = folder / "sentinel.conf"
            config.touch(mode=0o600)
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {self.master_name} 127.0.0.1 {master_port} 2\n"
                f"sentinel auth-pass {self.master_name} {self.password}\n"
                f"sentinel down-after-milliseconds {self.master_name} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.master_name} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {self.master_name} 1\n"
            )
            log = open(folder / "sentinel.log", "wb")  # noqa: SIM115 - owned by the child process
            self.sentinels.append(
                subprocess.Popen(
                    [redis_server_binary(), str(config), "--sentinel"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
            self.sentinel_ports.append(port)
        deadline = time.monotonic() + 30
        while not all(redis_answers(f"redis://127.0.0.1:{p}/0", 0.2) for p in self.sentinel_ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinels did not answer within 30 s; see {self.work_dir}")
            time.sleep(0.1)
        return self

    def wait_replicated(self, master_port: int, timeout_s: float) -> None:
        """Wait until the master reports a replica online and in sync.

        Raises:
            RuntimeError: none within ``timeout_s``."""
        client = redis.Redis(host="127.0.0.1", port=master_port, password=self.password, decode_responses=True)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                info = client.info("replication")
                if any(
                    str(v).startswith("ip=") or (isinstance(v, dict) and v.get("state") == "online")
                    for k, v in info.items()
                    if k.startswith("slave")
                ):
                    return
                time.sleep(0.1)
        finally:
            client.close()
        raise RuntimeError(f"no replica of 127.0.0.1:{master_port} came online within {timeout_s} s")

    def kill_master(self) -> int:
        """SIGKILL the current master (no shutdown, no last save); return its port."""
        port = self.master_port()
        stop_process_group(self.nodes.pop(port).process, signal.SIGKILL)
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 60.0) -> int:
        """Wait until the Sentinels name another master than ``old_port`` and it answers as master;
        return its port.

        Raises:
            RuntimeError: no promotion within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.master_port()
            except RuntimeError:
                port = old_port
            if port != old_port:
                client = redis.Redis(
                    host="127.0.0.1", port=port, password=self.password, socket_timeout=2, decode_responses=True
                )
                try:
                    if client.info("replication").get("role") == "master":
                        return port
                except (redis.RedisError, OSError):
                    pass
                finally:
                    client.close()
            time.sleep(0.1)
        raise RuntimeError(f"the Sentinels promoted no replica within {timeout_s} s; see {self.work_dir}")

    def restart_as_replica(self, port: int, master_port: int, timeout_s: float = 60.0) -> None:
        """Start an empty redis-server on ``port`` (a killed master's) as replica of ``master_port``,
        and wait until it is in sync and every Sentinel lists it as a healthy replica (so that the
        next failover can promote it).

        Raises:
            RuntimeError: not so within ``timeout_s``."""
        self.nodes[port] = start_redis_server(
            self.work_dir / f"node-{port}",
            port=port,
            password=self.password,
            extra_config=f"masterauth {self.password}\nreplicaof 127.0.0.1 {master_port}\n",
        )
        self.wait_replicated(master_port, timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            healthy = 0
            for sentinel_port in self.sentinel_ports:
                client = redis.Redis(host="127.0.0.1", port=sentinel_port, socket_timeout=2, decode_responses=True)
                try:
                    replicas = client.execute_command("SENTINEL", "REPLICAS", self.master_name)
                except (redis.RedisError, OSError):
                    replicas = []
                finally:
                    client.close()
                for entry in replicas:
                    fields = dict(zip(entry[::2], entry[1::2], strict=False)) if isinstance(entry, list) else entry
                    if (
                        int(fields.get("port", 0)) == port
                        and fields.get("flags") == "slave"
                        and fields.get("master-link-status") == "ok"
                    ):
                        healthy += 1
            if healthy == len(self.sentinel_ports):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Sentinels did not list 127.0.0.1:{port} as a healthy replica within {timeout_s} s")

    def stop(self) -> None:
        for process in self.sentinels:
            stop_process_group(process)
        for node in self.nodes.values():
            node.stop()
        self.sentinels.clear()
        self.nodes.clear()


def start_sentinel_set(work_dir: Path, password: str) -> SentinelSet:
    """Start a master, a replica and three Sentinels (quorum 2) in ``work_dir``; stop what started
    when one part fails.

    Raises:
        RuntimeError: a part did not answer in time."""
    sentinels = SentinelSet(work_dir=work_dir, password=password)
    try:
        return sentinels.start()
    except BaseException:
        sentinels.stop()
        raise
