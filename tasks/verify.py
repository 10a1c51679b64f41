"""The worker's side of "a file's identity is its content" (R4, R5): hash the local copy of a
model's files against the server's manifest, advertise the models that match in full, and
follow the registry's changes.

At start (:meth:`Verifier.verify`, before the first heartbeat), after every sync
(``tasks/sync.py`` calls :func:`advertise`) and when the registry changes
(:meth:`Verifier.follow_registry`), the worker hashes its local model files and replaces (or
amends) the machine's advertised set in Redis, the set placement reads. A job-time mismatch
withdraws a model from it (``tasks/loading.py``).
"""

from __future__ import annotations

import fcntl
import logging
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx
import redis

from app.core.config import WorkerSettings
from app.core.digest import algorithm_of, file_digest
from app.core.errors import HomefleetError, Unauthorized
from app.core.keys import Keys
from app.core.protocol import Manifest, Manifests
from tasks.server_client import ServerClient

log = logging.getLogger("homefleet.worker")

LOCK_FILE = ".homefleet-verify.lock"


def model_problems(models_dir: Path, manifest: Manifest) -> list[str]:
    """What is wrong with the local copy of one model: missing files, other sizes, other
    digests (every byte is read, with the algorithm the manifest names; no cache, so a
    same-size same-mtime change is found too, C07). Empty when the copy matches exactly."""
    folder = models_dir / manifest.model_id
    problems = []
    for entry in manifest.files:
        path = folder / entry.path
        if not path.is_file():
            problems.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.path}: {path.stat().st_size} bytes, manifest says {entry.size}")
        elif (actual := file_digest(path, algorithm_of(entry.digest))) != entry.digest:
            problems.append(f"{entry.path}: digest {actual}, manifest says {entry.digest}")
    return problems


Stat = tuple[int, int, int] | None
"""A file's (size, mtime_ns, inode), or None when it is missing."""


def file_stats(models_dir: Path, manifest: Manifest) -> dict[str, Stat]:
    """Each manifest file's (size, mtime_ns, inode) in the local copy (None: missing): a cheap
    "unchanged since it was hashed" test, taken BEFORE hashing so a change made meanwhile
    shows as a difference later. A change that keeps size, mtime and inode (bytes rewritten in
    place, the mtime put back) is not seen by it: the next cold load hashes every byte, as does
    ``homefleet models verify`` on the server (C07)."""
    stats: dict[str, Stat] = {}
    for entry in manifest.files:
        try:
            stat = (models_dir / manifest.model_id / entry.path).stat()
        except FileNotFoundError:
            stats[entry.path] = None
            continue
        stats[entry.path] = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    return stats


def whole_copy(stats: dict[str, Stat], manifest: Manifest) -> bool:
    """Whether ``stats`` (:func:`file_stats` of a local copy) show every file of ``manifest``
    there at its manifest size: a copy that can only differ in its bytes."""
    sizes = {entry.path: entry.size for entry in manifest.files}
    return bool(sizes) and all(
        (stat := stats.get(path)) is not None and stat[0] == size for path, size in sizes.items()
    )


def verified_models(models_dir: Path, manifests: dict[str, Manifest]) -> set[str]:
    """Ids of the models whose local copy matches the manifest in full (R4)."""
    return {model_id for model_id, manifest in manifests.items() if not model_problems(models_dir, manifest)}


@contextmanager
def one_check_at_a_time(models_dir: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<models_dir>/.homefleet-verify.lock``: the start-up check
    (parent process), a sync's check (pool child) and a registry change's check run one after
    the other, so the later one hashes the files as they are once the earlier has written its
    set (no stale set overwrites a fresher one). The kernel releases the lock when its process
    dies, so a killed worker never blocks the next one.

    It is released explicitly (``LOCK_UN``), not by closing the file: a pool process forked
    while the start-up check held it inherits the open file, and a lock released by closing
    stays held by that copy for the pool process's whole life, blocking every later check
    here (a model put back was re-advertised only when the worker stopped)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def advertise(
    client: redis.Redis,
    keyspace: Keys,
    machine: str,
    models_dir: Path,
    manifests: dict[str, Manifest],
    families: Collection[str] | None = None,
) -> set[str]:
    """Hash every local model against ``manifests`` (every byte, R4) and replace the machine's
    advertised set with the models that match in full. Returns that set. The line it logs
    counts the models of ``families`` (those the machine's fleet entry supports, R10; None:
    not known, every model counts): :func:`verified_line`."""
    with one_check_at_a_time(models_dir):
        problems = {model_id: model_problems(models_dir, manifest) for model_id, manifest in manifests.items()}
        verified = {model_id for model_id, found in problems.items() if not found}
        for model_id in sorted(m for m, found in problems.items() if found and (models_dir / m).is_dir()):
            log.warning(  # a copy here that does not match: said, with what differs (none here: never synced)
                "%s: model %s is not advertised: its copy here does not match the manifest (%s); put the files "
                "back, or `homefleet sync %s %s`",
                machine,
                model_id,
                "; ".join(problems[model_id][:3]) + (" …" if len(problems[model_id]) > 3 else ""),
                machine,
                model_id,
            )
        key = keyspace.verified(machine)
        with client.pipeline() as pipe:
            pipe.delete(key)
            if verified:
                pipe.sadd(key, *sorted(verified))
            pipe.execute()
    log.info("%s", verified_line(machine, manifests, verified, families))
    return verified


def verified_line(
    machine: str, manifests: dict[str, Manifest], verified: set[str], families: Collection[str] | None
) -> str:
    """What a worker says once it has verified its copies (R4): how many of the registered
    models it runs, those of ``families`` (its fleet entry's, R10), match here, and which. A model
    of another family is no model missing here: it is counted apart, by family, and named only
    if its copy here matches all the same. ``families`` None (a server that does not say): every
    model counts, as ``M verified N of T models: …``."""
    if families is None:
        return f"{machine} verified {len(verified)} of {len(manifests)} models: {', '.join(sorted(verified)) or 'none'}"
    runs = {m for m, manifest in manifests.items() if manifest.family in families}
    line = (
        f"{machine} verified {len(verified & runs)} of {len(runs)} models it runs ({', '.join(sorted(families))}): "
        f"{', '.join(sorted(verified & runs)) or 'none'}"
    )
    others = sorted(set(manifests) - runs)
    if others:
        kinds = sorted({manifests[m].family for m in others})
        line += (
            f"; {len(others)} more registered model{'s are' if len(others) > 1 else ' is'} of "
            f"{'families' if len(kinds) > 1 else 'a family'} it does not run ({', '.join(kinds)})"
        )
        if verified - runs:
            line += f", though its copy here matches: {', '.join(sorted(verified - runs))}"
    return line


class Verifier:
    """The worker's verified set: checked once at start (:meth:`verify`), then kept up to date
    with the registry (:meth:`follow_registry`). Both run from the heartbeat's thread; the
    registry's check runs in a thread of its own, so beats go on meanwhile."""

    def __init__(self, settings: WorkerSettings, client: redis.Redis, keyspace: Keys) -> None:
        self.settings = settings
        self.redis = client
        self.keys = keyspace
        self.manifests: dict[str, Manifest] = {}  # the server's manifests as last verified against
        self.done = False  # the start-up check has run
        self._registry_mark: str | None = None  # the registry's change mark when they were read
        self._following: threading.Thread | None = None  # following the registry, or rehashing changed files
        self._refused: Unauthorized | None = None  # the server refused the token while following the registry
        # model id -> its files' stats when last hashed here (or first seen advertised): check_unchanged's baseline
        self.stats: dict[str, dict[str, Stat]] = {}
        # model id -> its files' stats when it was found changed and withdrawn (here, or by a job's
        # load in the pool): hashed again when they change, advertised again once they match
        self.withdrawn: dict[str, dict[str, Stat]] = {}

    def _manifests(self) -> dict[str, Manifest]:
        return self._answer().models

    def _answer(self) -> Manifests:
        """The server's manifests and the families this machine runs (``GET /internal/v1/manifest``)."""
        server = ServerClient.for_worker(self.settings)
        try:
            return server.manifests()
        finally:
            server.close()

    def verify(self) -> set[str]:
        """Hash the local copies against the manifest; replace the advertised set (R4).

        Raises:
            Unauthorized: the server refused the token. HomefleetError, httpx.HTTPError,
                redis.RedisError, OSError: the manifest or Redis could not be read (try again).
        """
        # before the manifests: a later change is seen
        self._registry_mark = cast("str | None", self.redis.get(self.keys.registry_changed()))
        answer = self._answer()
        manifests = answer.models
        stats = {m: file_stats(self.settings.models_dir, manifest) for m, manifest in manifests.items()}
        verified = advertise(
            self.redis, self.keys, self.settings.machine, self.settings.models_dir, manifests, answer.families
        )
        self.stats = {m: stats[m] for m in verified}
        # a whole copy that failed (every file there at its size: damaged, not a sync cut short)
        # is watched as a withdrawn one: put back, it is advertised again without a sync
        self.withdrawn = {
            m: stats[m] for m, manifest in manifests.items() if m not in verified and whole_copy(stats[m], manifest)
        }
        self.manifests = manifests
        self.done = True
        return verified

    def follow_registry(self) -> None:
        """When the server's registry changed (its change mark, app/fleet/costs.py ChangeMark),
        bring the advertised set up to date (R4) in a thread of its own:

        - a model registered since, or whose manifest changed (``homefleet models update``
          recorded new digests), is hashed, alone: advertised if its local copy matches the
          new manifest (the server's own worker shares the folder ``models add`` copies into),
          withdrawn otherwise (a worker's copy of the old content);
        - a model no longer registered is withdrawn.

        A model withdrawn here whose copy is here (its files changed, :meth:`check_unchanged`)
        is hashed again too: ``models update`` after its files were put back changes no digest,
        yet must bring it back; it is advertised if it matches, and said only then. Models
        advertised with an unchanged manifest, and models with no copy here, are not hashed again.

        Raises:
            Unauthorized: the server refused the token when the last change was followed (the
                machine's token was rotated): the heartbeat stops the worker (exit 78).
        """
        if self._refused is not None:
            raise self._refused
        mark = self.redis.get(self.keys.registry_changed())
        if mark == self._registry_mark or (self._following is not None and self._following.is_alive()):
            return
        self._following = threading.Thread(target=self._follow, args=(mark,), name="homefleet-registry", daemon=True)
        self._following.start()

    def _follow(self, mark: str | None) -> None:
        machine, key = self.settings.machine, self.keys.verified(self.settings.machine)
        try:
            manifests = self._manifests()
            changed = {m: manifest for m, manifest in manifests.items() if self.manifests.get(m) != manifest}
            # withdrawn here (not advertised) with a copy here: its files may have been put back
            again = {
                m: manifest
                for m, manifest in manifests.items()
                if m not in changed and m not in self.stats and (self.settings.models_dir / m).is_dir()
            }
            gone = [m for m in self.manifests if m not in manifests]
            withdrawn = sorted(m for m in gone if m in self.stats)  # advertised here: said; the others never were
            with one_check_at_a_time(self.settings.models_dir):
                hashed = {**changed, **again}
                stats = {m: file_stats(self.settings.models_dir, manifest) for m, manifest in hashed.items()}
                matching = verified_models(self.settings.models_dir, hashed)
                for model_id in [*gone, *changed]:
                    self.stats.pop(model_id, None)
                for model_id in [*gone, *changed, *matching]:  # judged afresh here
                    self.withdrawn.pop(model_id, None)
                self.stats.update({m: stats[m] for m in matching})
                if gone or set(changed) - matching:
                    self.redis.srem(key, *gone, *(set(changed) - matching))
                if matching:
                    self.redis.sadd(key, *sorted(matching))
            if changed or withdrawn or matching:
                parts = [f"verified here: {', '.join(sorted(matching))}"] if matching else []
                if set(changed) - matching:
                    parts.append(f"not verified: {', '.join(sorted(set(changed) - matching))}")
                if withdrawn:
                    parts.append(f"withdrawn (no longer registered): {', '.join(withdrawn)}")
                log.info("%s: the registry changed; %s", machine, "; ".join(parts))
            self.manifests, self._registry_mark = manifests, mark
        except Unauthorized as refused:  # raised to the heartbeat at its next duty: the worker stops
            self._refused = refused
        except (HomefleetError, httpx.HTTPError, redis.RedisError, OSError) as error:
            log.warning("%s: the registry's change could not be followed (%s); trying again", machine, error)

    def check_unchanged(self) -> None:
        """Each beat: stat the files of every model this machine advertises (size, mtime_ns,
        inode; no byte read) against their stat when last hashed here. A model with a changed
        stat is hashed again in full, in a thread of its own (beats go on): withdrawn from the
        advertised set when it no longer matches the manifest (R4, R5), its new stat kept when
        it does. The pool process, which holds the resident pipelines, compares the same stats
        before reusing a warm model (``tasks/loading.py`` check_files): a changed warm model is
        dropped and verified like a cold load. A change that keeps size, mtime and inode is not
        seen here; the next cold load and ``homefleet models verify`` hash every byte (C07).

        A model withdrawn for a change (here, or by a job's load, which hashed it) is watched the
        same way: when its files' stat moves again (the bytes put back) it is hashed in full and,
        matching the manifest, advertised again without a sync. So is a copy found damaged at
        start (every file there at its size, some bytes other: the worker started after the
        damage). A model never advertised here otherwise (not yet synced, or a sync under way)
        is not watched: a sync verifies it."""
        if not self.done or (self._following is not None and self._following.is_alive()):
            return
        advertised = cast("set[str]", self.redis.smembers(self.keys.verified(self.settings.machine)))
        changed = {}
        for model_id in advertised:
            manifest = self.manifests.get(model_id)
            if manifest is None:
                continue
            now = file_stats(self.settings.models_dir, manifest)
            known = self.stats.setdefault(model_id, now)  # advertised by a sync since: its check was just done
            if now != known:
                changed[model_id] = manifest
        for model_id in [m for m in self.stats if m not in advertised and m in self.manifests]:
            # advertised when last hashed here, withdrawn since by a job's load that found it changed
            self.withdrawn[model_id] = self.stats.pop(model_id)
        for model_id, seen in list(self.withdrawn.items()):
            manifest = self.manifests.get(model_id)
            if manifest is None or model_id in advertised:  # no longer registered, or a sync brought it back
                del self.withdrawn[model_id]
            elif file_stats(self.settings.models_dir, manifest) != seen:
                changed[model_id] = manifest
        if changed:
            self._following = threading.Thread(
                target=self._recheck, args=(changed,), name="homefleet-recheck", daemon=True
            )
            self._following.start()

    def _recheck(self, changed: dict[str, Manifest]) -> None:
        machine, key = self.settings.machine, self.keys.verified(self.settings.machine)
        try:
            with one_check_at_a_time(self.settings.models_dir):
                for model_id, manifest in changed.items():
                    stats = file_stats(self.settings.models_dir, manifest)
                    problems = model_problems(self.settings.models_dir, manifest)
                    if problems and model_id in self.withdrawn:  # still changed: watched from these stats
                        self.withdrawn[model_id] = stats
                    elif problems:
                        self.redis.srem(key, model_id)
                        self.stats.pop(model_id, None)
                        self.withdrawn[model_id] = stats
                        log.warning(
                            "%s: model %s changed on disk and was withdrawn (until its files match the manifest "
                            "again, or `homefleet sync %s %s`): %s",
                            machine,
                            model_id,
                            machine,
                            model_id,
                            "; ".join(problems[:5]),
                        )
                    elif self.withdrawn.pop(model_id, None) is not None:
                        self.redis.sadd(key, model_id)
                        self.stats[model_id] = stats
                        log.info(
                            "%s: model %s matches its manifest again (every byte hashed): advertised", machine, model_id
                        )
                    else:
                        self.stats[model_id] = stats
        except (redis.RedisError, OSError) as error:
            log.warning("%s: changed model files could not be rehashed (%s); trying again", machine, error)
