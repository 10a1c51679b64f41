"""Reading and editing the machines' Redis lists directly (R8, cancel, reconciliation).

kombu's Redis transport keeps a queue as a list (``LPUSH`` publishes, ``BRPOP`` consumes:
index -1 runs next) and delivered-but-unacked messages in the hash ``unacked``, both under the
broker key prefix (their keys: ``app.core.keys.Keys``; kombu/transport/redis.py). Each message
is JSON whose ``headers.id`` is the Celery task id, which Homefleet sets to the job id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery
from kombu import Producer
from kombu.utils import json as kombu_json

from app.core.celery_app import RUN_JOB_TASK
from app.core.errors import HomefleetError
from app.core.keys import Keys, queue

# Remove the first entry of list KEYS[1] whose headers.id equals ARGV[1]; return 1 if found.
# One script = one atomic step: no consumer can pop the entry between the scan and the LREM.
_REMOVE_BY_ID = """
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
for _, raw in ipairs(entries) do
  local ok, message = pcall(cjson.decode, raw)
  if ok and type(message) == 'table' and type(message['headers']) == 'table'
     and message['headers']['id'] == ARGV[1] then
    redis.call('LREM', KEYS[1], 1, raw)
    return 1
  end
end
return 0
"""

# Put a machine's backlog back in journal order in one atomic step (R8, R19): KEYS[1] the list;
# ARGV[1] = n; ARGV[2..n+1] the backlog's job ids, oldest first; ARGV[n+2..2n+1] for each a
# message to use when the list holds none with that id ("" for none). Entries of the backlog are
# taken out (each id once; the message already there is kept), the others keep their order, and
# the backlog is pushed back at the end BRPOP reads, oldest last so it runs first. The list is
# rebuilt (DEL, RPUSH): O(length), where one LREM per entry was O(length^2) on a deep backlog. A
# consumer blocked in BRPOP is served only after the script: it never sees a partial list.
# Returns the number of backlog entries put back.
_PUT_IN_ORDER = """
local n = tonumber(ARGV[1])
local rank = {}
for i = 1, n do rank[ARGV[1 + i]] = i end
local others, found = {}, {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local ok, message = pcall(cjson.decode, raw)
  local i = nil
  if ok and type(message) == 'table' and type(message['headers']) == 'table' then
    local id = message['headers']['id']
    if type(id) == 'string' then i = rank[id] end
  end
  if i ~= nil and found[i] == nil then found[i] = raw else table.insert(others, raw) end
end
redis.call('DEL', KEYS[1])
for _, raw in ipairs(others) do redis.call('RPUSH', KEYS[1], raw) end
local put = 0
for i = n, 1, -1 do
  local raw = found[i]
  if raw == nil and ARGV[1 + n + i] ~= '' then raw = ARGV[1 + n + i] end
  if raw ~= nil then
    redis.call('RPUSH', KEYS[1], raw)
    put = put + 1
  end
end
return put
"""


def message_id(raw: str | bytes) -> str | None:
    """The task id (a job's id) in a raw kombu message as it lies in a machine's list; None
    when the item is no kombu message (a dead letter, R22)."""
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers.get("id") if isinstance(headers, dict) else None


class MachineQueues:
    """The per-machine lists ``machine.<name>`` and kombu's unacked hash, read without consuming."""

    def __init__(self, client: redis.Redis, keyspace: Keys, celery: Celery) -> None:
        self.redis = client
        self.keys = keyspace
        self.celery = celery
        self._remove = client.register_script(_REMOVE_BY_ID)
        self._put_in_order = client.register_script(_PUT_IN_ORDER)

    def publish(self, machine: str, job_id: str, model_id: str, kind: str) -> None:
        """Publish a job's message to ``machine.<name>`` (LPUSH: behind every message there), with
        ``task_id = job id`` so that the claim refuses a second delivery (R19). The task gets only
        the job id; Flower and ``celery inspect`` show the model, kind and machine beside it
        (``argsrepr``/``kwargsrepr``).

        Raises:
            kombu.exceptions.OperationalError: the broker refused it after the retry policy's tries.
        """
        self._send(machine, job_id, model_id, kind)

    def _send(self, machine: str, job_id: str, model_id: str, kind: str, producer: Producer | None = None) -> None:
        self.celery.send_task(
            RUN_JOB_TASK,
            args=[job_id],
            task_id=job_id,
            queue=queue(machine),
            argsrepr=repr((job_id,)),
            kwargsrepr=repr({"model": model_id, "kind": kind, "machine": machine}),
            producer=producer,
        )

    def messages(self, machine: str, jobs: Sequence[tuple[str, str, str]]) -> dict[str, str]:
        """The messages :meth:`publish` would push for ``jobs`` (``(job id, model id, kind)``) to
        ``machine.<name>``, built by Celery and kombu as for a publication but pushed nowhere:
        ``{job id: message as kombu writes it}``, for :meth:`put_in_order`. (kombu's Redis channel
        ends a publication in ``_put``, its one LPUSH; a private channel's ``_put`` keeps the
        message instead. The queue's binding is declared as by a publication.)

        Raises:
            kombu.exceptions.OperationalError: the broker refused it after the retry policy's tries.
        """
        kept: dict[str, str] = {}
        with self.celery.connection_for_write() as connection:
            channel = connection.channel()
            try:

                def keep(name: str, message: dict[str, Any], **_: object) -> None:
                    if name != queue(machine):  # Homefleet binds each queue to its machine only (R8)
                        raise HomefleetError(f"a message for {queue(machine)} was routed to {name}")
                    kept[str(message["headers"]["id"])] = kombu_json.dumps(message)

                channel._put = keep
                producer = self.celery.amqp.Producer(channel, auto_declare=False)
                for job_id, model_id, kind in jobs:
                    self._send(machine, job_id, model_id, kind, producer=producer)
            finally:
                channel.close()
        return kept

    def put_in_order(self, machine: str, backlog: Sequence[str], messages: Mapping[str, str]) -> list[str]:
        """Atomically make ``backlog`` (job ids, oldest first) the next entries the machine's
        worker takes, in that order (R8): an entry already in the list is moved (kept once), one
        absent is pushed from ``messages``; other entries keep their order behind them. A worker
        blocked in BRPOP meanwhile takes the oldest first, never a later one (one Lua script).
        Returns the ids of ``backlog`` now in the list, in the order they will run; an id neither
        in the list nor in ``messages`` (a worker took it meanwhile) is left out."""
        args = [str(len(backlog)), *backlog, *(messages.get(job_id, "") for job_id in backlog)]
        self._put_in_order(keys=[self.keys.queue_list(machine)], args=args)
        waiting = set(self.queued_ids(machine))
        return [job_id for job_id in backlog if job_id in waiting]

    def length(self, machine: str) -> int:
        """LLEN of the machine's queue list: messages waiting there (not the one running, R8)."""
        return int(self.redis.llen(self.keys.queue_list(machine)))

    def queued_ids(self, machine: str) -> list[str]:
        """Job ids waiting in ``machine.<name>``, in the order they will run (next first)."""
        raw = self.redis.lrange(self.keys.queue_list(machine), 0, -1)
        return [i for i in (message_id(r) for r in reversed(raw)) if i is not None]

    def unacked_ids(self) -> set[str]:
        """Job ids delivered to a worker but not yet acked (kombu restores these after the
        visibility timeout)."""
        ids = set()
        for raw in self.redis.hvals(self.keys.unacked()):
            try:
                message = json.loads(raw)[0]
            except (ValueError, IndexError, TypeError):
                continue
            job_id = message_id(json.dumps(message))
            if job_id is not None:
                ids.add(job_id)
        return ids

    def remove(self, machine: str, job_id: str) -> bool:
        """Atomically remove the job's entry from its machine's list; True if it was there."""
        return bool(self._remove(keys=[self.keys.queue_list(machine)], args=[job_id]))


class DeadLetters:
    """The messages workers moved aside because kombu could not decode them
    (app/core/dead_letters.py; docs/operations.md, "Dead letters"): a Redis list of JSON
    ``{queue, raw, error, at}``, newest first."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key

    def count(self) -> int:
        return int(self.client.llen(self.key))

    def list(self, limit: int = 100) -> list[dict[str, object]]:
        """The newest ``limit`` dead letters, parsed (an entry that is not JSON is shown as its raw text)."""
        entries = []
        for raw in self.client.lrange(self.key, 0, limit - 1):
            try:
                entries.append(json.loads(raw))
            except ValueError:
                entries.append({"queue": None, "raw": raw, "error": "not a dead-letter record", "at": None})
        return entries

    def clear(self) -> int:
        """Remove every dead letter; the number removed. Atomic: one that arrives meanwhile stays."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.llen(self.key)
            pipe.delete(self.key)
            removed, _ = pipe.execute()
        return int(removed)
