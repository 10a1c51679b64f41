"""Results as inputs: a succeeded job's result named as an input of a new job (``params.image``
of ``img2img``, ``upscale``, ``edit``…), so generate -> upscale -> edit chains need no download
and upload in between.

A result is named by its digest (``result.digest`` / ``results[i].digest`` of ``GET
/v1/jobs/{id}``). Only the submitting key's own results are taken (a job submitted without a
key: only results of jobs without one). The result's bytes are taken into the input store
through the same checks as an upload (``InputStore.add``: size, media type, complete decoding,
their digest recomputed), so the worker fetches and checks it as any input (R5). Anything else
is left to validation, which refuses an unknown id with 422 ``unknown_file`` naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from app.core.digest import bytes_digest
from app.core.errors import NotFound, Rejected
from app.core.kinds import spec
from app.journal.jobs import Journal
from app.store.files import InputStore, ResultStore

log = logging.getLogger(__name__)


def adopt_results(
    kind: str,
    params: Mapping[str, Any],
    inputs: InputStore,
    results: ResultStore,
    journal: Journal,
    api_key_id: str | None,
) -> list[str]:
    """Take each input field of ``kind`` in ``params`` that names one of the key's stored results
    (not an upload) into the input store. Returns the fields taken.

    Raises:
        Rejected: the result does not pass an upload's checks (its reason: ``input_too_large``,
            ``input_type``, ``input_corrupt``; ``unknown_file`` when its stored bytes no longer
            hash to its digest), param ``params.<field>``.
    """
    try:
        fields = spec(kind).inputs
    except KeyError:
        return []  # validation refuses the kind
    taken = []
    for field in fields:
        value = params.get(field)
        if not isinstance(value, str) or not value:
            continue
        try:
            inputs.get(value)
            continue  # an upload (or a result taken before)
        except NotFound:
            pass
        except Rejected:
            continue  # not a digest: validation names it
        media_type = journal.result_media_type(value, api_key_id)
        if not media_type:
            continue
        try:
            data = results.path(value, media_type).read_bytes()
        except (OSError, KeyError) as error:
            log.warning("result %s named by params.%s cannot be read: %s", value, field, error)
            continue
        if bytes_digest(data) != value:
            raise Rejected(
                f"params.{field}: the stored result {value} no longer hashes to its digest; it cannot be an input",
                reason="unknown_file",
                param=f"params.{field}",
            )
        try:
            inputs.add(data)
        except Rejected as error:
            raise Rejected(
                f"params.{field}: the result {value}: {error.message}", reason=error.reason, param=f"params.{field}"
            ) from error
        taken.append(field)
    return taken
