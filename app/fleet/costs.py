"""Placement's cost data on the server (R12, R13): the :class:`~routing.estimate.Estimator`
built from the fleet config (speed, load rate, usable memory, working-memory coefficients by
kind and family), the registry (family, kinds,
exact weight bytes from safetensors headers) and the persisted learned timings; and the recent
demand per model kept in Redis for Auto's scarcity charge (``routing.demand``).

Submissions reuse one Estimator for as long as neither the registry nor the learned timings
changed: each write of either replaces a token in Redis (:class:`ChangeMark`), and the fleet
snapshot read under the fleet lock (R14) reads both tokens in the same command. Several
server processes share the marks, so one that learned a timing makes the others re-read.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from typing import cast

import redis

from app.core.errors import Conflict
from app.core.keys import Keys
from app.core.textgen import max_positions, model_config
from app.db.tables import ModelRecord
from app.fleet.config import Fleet, ModelGuess
from app.fleet.reservations import HashField
from app.journal.timings import TimingStore
from app.store.registry import Registry
from routing.demand import Demand
from routing.estimate import Estimator, MachineProfile, ModelProfile

log = logging.getLogger(__name__)

Marks = tuple[str | None, str | None]  # (registry's ChangeMark token, learned timings' token); None: never set


class ChangeMark:
    """A Redis key holding a random token that is replaced after every committed write of some
    data kept elsewhere (the registry, the learned timings), so every process can tell whether
    its cached copy is stale from one GET (or a read in a multi-read). A token, not a counter:
    a Redis that lost the key and counted up again could look unchanged."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.redis = client
        self.key = key

    def read(self) -> tuple[str, str]:
        """The read of the token, for :class:`app.fleet.multiread.MultiRead`."""
        return ("GET", self.key)

    def touch(self) -> None:
        """Replace the token (call after the write committed). A Redis error is logged, not
        raised: the write itself stands, and other processes re-read at their next change or
        when a submission names a model they do not know (:meth:`FleetCosts.estimator_at`)."""
        try:
            self.redis.set(self.key, secrets.token_hex(8))
        except redis.RedisError as error:
            log.warning(
                "could not mark %s as changed (%s); other server processes keep their cached copy until "
                "the next change",
                self.key,
                error,
            )


class FleetCosts:
    """Builds the :class:`Estimator` of a decision; weight bytes are read once per (model,
    total bytes) and cached. :meth:`estimator` reads the registry and timings afresh;
    :meth:`estimator_at` reuses the last one while the change marks have not moved."""

    def __init__(
        self,
        fleet: Fleet,
        registry: Registry,
        timings: TimingStore,
        registry_mark: ChangeMark,
        timings_mark: ChangeMark,
        max_total_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.fleet = fleet
        self.max_total_tokens = max_total_tokens  # a text model's limit (Validator.token_limits); None: its config's
        self.registry = registry
        self.timings = timings
        self.registry_mark = registry_mark
        self.timings_mark = timings_mark
        self._weights: dict[tuple[str, int], int] = {}
        self._unpriced: dict[str, Conflict] = {}  # models the last model_profiles() could not price, with why
        self._working = fleet.working()  # working-memory coefficients by kind and family
        self._machines = self.machine_profiles()  # changed only by use_fleet (a reloaded fleet file)
        # (marks, estimator) of the last estimator_at; replaced whole, so threads see one or the other
        self._cached: tuple[Marks, Estimator] | None = None

    def use_fleet(self, fleet: Fleet) -> None:
        """Price with ``fleet`` from now on (the running server reloaded its fleet file)."""
        self.fleet = fleet
        self._working = fleet.working()
        self._machines = self.machine_profiles()
        self._cached = None

    def machine_profiles(self) -> dict[str, MachineProfile]:
        return {
            name: MachineProfile(name, m.speed, m.load_bytes_per_s, m.memory_kind, m.memory_bytes)
            for name, m in self.fleet.machines.items()
        }

    def model_profiles(self) -> dict[str, ModelProfile]:
        """Every registered model's profile: family, weight bytes (parameters counted from the
        safetensors headers, priced at the variant's precision and quantization: what it occupies
        once loaded, not the files' size; ``Registry.weights_bytes``) and the fleet config's
        timing guesses for it (``[models.<id>]``; absent: the family's). A model whose headers
        cannot be read is left out (logged; its refusal kept for :meth:`estimator_at`), so it
        never breaks the pricing of the others."""
        profiles = {}
        unpriced: dict[str, Conflict] = {}
        for record in self.registry.list():
            key = (record.id, record.total_bytes)
            if key not in self._weights:
                try:
                    self._weights[key] = self.registry.weights_bytes(record.id)
                except Conflict as error:  # one damaged model is left out; the others are priced
                    log.error("pricing: model %s left out: %s", record.id, error.message)
                    unpriced[record.id] = error
                    continue
            kind = record.kinds[0] if record.kinds else "txt2img"
            guess = self.fleet.models.get(record.id, ModelGuess())
            profiles[record.id] = ModelProfile(
                record.id,
                record.family,
                self._weights[key],
                step_s=guess.step_s,
                kind=kind,
                load_s=guess.load_s,
                kv_cache_bytes=self._kv_cache(record),
            )
        self._unpriced = unpriced
        return profiles

    def _kv_cache(self, record: ModelRecord) -> int:
        """A text model's KV cache at its ``max_total_tokens``, bytes; 0 for other models."""
        if "text" not in record.kinds:
            return 0
        tokens = (
            self.max_total_tokens(record.id)
            if self.max_total_tokens is not None
            else max_positions(model_config(self.registry.folder(record.id)))
        )
        return self.registry.kv_cache_bytes(record.id, tokens)

    def estimator(self) -> Estimator:
        """A fresh Estimator: the registry and the learned timings read now."""
        return Estimator(self._machines, self.model_profiles(), self.timings.load(), self._working)

    def mark_reads(self) -> list[tuple[str, str]]:
        """The reads of both change marks (registry, then timings), for the fleet snapshot."""
        return [self.registry_mark.read(), self.timings_mark.read()]

    def marks(self) -> Marks:
        """Both change marks read now (one MGET), for :meth:`estimator_at` outside a snapshot."""
        registry, timings = self.registry_mark.redis.mget([self.registry_mark.key, self.timings_mark.key])
        return _text(registry), _text(timings)

    def estimator_at(self, marks: Marks, model_id: str) -> Estimator:
        """The Estimator for a decision about ``model_id``, given the change marks just read
        (:meth:`mark_reads`). The last one is reused when both marks are as they were and it
        knows ``model_id``; profiles are re-read when the registry moved (or miss the model:
        registered, mark not yet replaced), timings when they moved. Do not mutate the result
        (its learned timings are shared with later decisions).

        Raises:
            Conflict: ``model_id``'s safetensors headers cannot be read (reason
                ``model_unreadable``, :meth:`Registry.weights_bytes`): it cannot be priced.
            NotFound: the profiles were re-read and ``model_id`` is not among them because it was
                retired since the submission's checks (reason ``model_retired``,
                :meth:`Registry.check_in_service`; ``homefleet models retire`` holds the fleet
                lock, under which this is read).
        """
        cached = self._cached
        if cached is not None and cached[0] == marks and model_id in cached[1].models:
            return cached[1]
        if cached is not None and cached[0][0] == marks[0] and model_id in cached[1].models:
            models = cached[1].models
        else:
            models = self.model_profiles()
        learned = cached[1].learned if cached is not None and cached[0][1] == marks[1] else self.timings.load()
        estimator = Estimator(self._machines, models, learned, self._working)
        self._cached = (marks, estimator)
        if model_id not in models and model_id in self._unpriced:
            raise self._unpriced[model_id]
        if model_id not in models:
            self.registry.check_in_service(model_id)  # retired since it was validated
        return estimator


class DemandStore:
    """The fleet's :class:`Demand` in the Redis hash ``<prefix>:demand`` (class -> JSON
    ``[work_s, jobs, at_s]``); written under the fleet lock at each submission."""

    def __init__(self, client: redis.Redis, keyspace: Keys) -> None:
        self.redis = client
        self.keys = keyspace

    def read(self) -> tuple[str, str]:
        """The read of the whole hash, for :class:`app.fleet.multiread.MultiRead` (see :meth:`parse`)."""
        return ("HGETALL", self.keys.demand())

    @staticmethod
    def parse(raw: dict[str, str]) -> Demand:
        """The Demand of the hash's fields as read (``HGETALL``)."""
        return Demand(levels={k: tuple(json.loads(v)) for k, v in raw.items()})

    def load(self) -> Demand:
        return self.parse(cast("dict[str, str]", self.redis.hgetall(self.keys.demand())))

    def level_after(self, demand_class: str, work_s: float, now_s: float, current: Demand) -> HashField:
        """The hash field to write to record one submission of ``work_s`` speed-1.0 seconds in
        ``demand_class`` at ``now_s`` (Unix seconds), given ``current``, the demand read under
        the same fleet lock."""
        level = current.levels.get(demand_class)
        demand = Demand(levels={demand_class: level} if level else {})
        demand.add(demand_class, work_s, now_s)
        return HashField(self.keys.demand(), demand_class, json.dumps(list(demand.levels[demand_class])))


def _text(value: bytes | str | None) -> str | None:
    """A change mark as text (the client decodes replies; redis-py types them ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value
