"""Reading and editing the machines' Redis lists directly (R8, cancel, reconciliation).

kombu's Redis transport keeps a queue as a list (``LPUSH`` publishes, ``BRPOP`` consumes:
index -1 runs next) and delivered-but-unacked messages in the hash ``unacked``, both under the
broker key prefix (their keys: ``app.core.keys.Keys``; kombu/transport/redis.py). Each message
is JSON whose ``headers.id`` is the Celery task id, which Homefleet sets to the job id.
"""

from __future__ import annotations

import json

import redis
from celery import Celery

from app.core.celery_app import RUN_JOB_TASK
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

# Move the entry of list KEYS[1] whose headers.id equals ARGV[1] to the end BRPOP reads (it runs
# next); return 1 if found. Atomic like _REMOVE_BY_ID.
_TO_FRONT = """
local entries = redis.call('LRANGE', KEYS[1], 0, -1)
for _, raw in ipairs(entries) do
  local ok, message = pcall(cjson.decode, raw)
  if ok and type(message) == 'table' and type(message['headers']) == 'table'
     and message['headers']['id'] == ARGV[1] then
    redis.call('LREM', KEYS[1], 1, raw)
    redis.call('RPUSH', KEYS[1], raw)
    return 1
  end
end
return 0
"""


def _message_id(raw: str | bytes) -> str | None:
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
        self._to_front = client.register_script(_TO_FRONT)

    def publish(self, machine: str, job_id: str, model_id: str, kind: str) -> None:
        """Publish a job's message to ``machine.<name>`` (LPUSH: behind every message there), with
        ``task_id = job id`` so that the claim refuses a second delivery (R19). The task gets only
        the job id; Flower and ``celery inspect`` show the model, kind and machine beside it
        (``argsrepr``/``kwargsrepr``).

        Raises:
            kombu.exceptions.OperationalError: the broker refused it after the retry policy's tries.
        """
        self.celery.send_task(RUN_JOB_TASK, args=[job_id], task_id=job_id, queue=queue(machine),
                              argsrepr=repr((job_id,)),
                              kwargsrepr=repr({"model": model_id, "kind": kind, "machine": machine}))

    def length(self, machine: str) -> int:
        """LLEN of the machine's queue list: messages waiting there (not the one running, R8)."""
        return int(self.redis.llen(self.keys.queue_list(machine)))

    def queued_ids(self, machine: str) -> list[str]:
        """Job ids waiting in ``machine.<name>``, in the order they will run (next first)."""
        raw = self.redis.lrange(self.keys.queue_list(machine), 0, -1)
        return [i for i in (_message_id(r) for r in reversed(raw)) if i is not None]

    def unacked_ids(self) -> set[str]:
        """Job ids delivered to a worker but not yet acked (kombu restores these after the
        visibility timeout)."""
        ids = set()
        for raw in self.redis.hvals(self.keys.unacked()):
            try:
                message = json.loads(raw)[0]
            except (ValueError, IndexError, TypeError):
                continue
            job_id = _message_id(json.dumps(message))
            if job_id is not None:
                ids.add(job_id)
        return ids

    def remove(self, machine: str, job_id: str) -> bool:
        """Atomically remove the job's entry from its machine's list; True if it was there."""
        return bool(self._remove(keys=[self.keys.queue_list(machine)], args=[job_id]))

    def to_front(self, machine: str, job_id: str) -> bool:
        """Atomically move the job's entry to the end of its machine's list that the worker reads
        next; True if it was there (False: a worker took it meanwhile)."""
        return bool(self._to_front(keys=[self.keys.queue_list(machine)], args=[job_id]))


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
