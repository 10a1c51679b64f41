"""Prompt expansion (docs/api.md, "Prompt expansion"): a txt2img submission naming a text model in
``params.expand_prompt`` runs that model first, as its own journaled ``text`` job, and the
image job then runs with the prompt it wrote — never silently: both jobs are journaled, the
image job's params (embedded in its provenance) name the text job (``expanded_by``) and the
model (``expand_prompt``), and the text job's events name the image job (``expanded_for``).

The text job: the user's prompt through the model's chat template (a system message asking
for a richer image description) when it has one, else ``"<prompt>,"`` as a plain completion;
greedy, :data:`EXPANSION_TOKENS` new tokens at most, placed by Auto (the text model need not be
on the image's machine). The submission waits for it (at most ``images_wait_s``, woken by its end:
app/jobs/waiting.py, no thread held meanwhile); the image's
prompt is the user's, a comma, and the expansion, cut to the image model's prompt limits
(characters, tokens). The image request is checked before the text job is submitted, so a
refused image costs no text job.
"""

from __future__ import annotations

from typing import Any

from anyio import to_thread

from app.core.errors import HomefleetError, JobPending, Rejected
from app.core.kinds import CHAT_SHOWN_PARAM
from app.core.limits import limits_for
from app.core.states import ENDED, JobState
from app.db.tables import Job
from app.jobs.dispatch import Dispatcher, Submission, scoped_idempotency_key
from app.jobs.waiting import Waiting
from routing.placement import AUTO

EXPANSION_TOKENS = 24
EXPANSION_SYSTEM = (
    "Expand the user's image prompt into one vivid, detailed description of the image: subject, "
    "setting, light, style. Answer with the description only."
)


class ExpansionFailed(HomefleetError):
    """The expansion's text job ended without a result: 500 naming it."""

    status_code = 500
    default_reason = "expansion_failed"


def expansion_prompt(dispatcher: Dispatcher, text_model: str, prompt: str) -> dict[str, Any]:
    """The text job's params for expanding ``prompt`` with ``text_model`` (module docstring)."""
    validator = dispatcher.validator
    tokenizer = validator.tokenizers.tokenizer(text_model)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": EXPANSION_SYSTEM}, {"role": "user", "content": prompt}]
        return {
            "prompt": validator.chat_prompt(text_model, messages),
            "chat": True,
            CHAT_SHOWN_PARAM: prompt,
            "max_new_tokens": EXPANSION_TOKENS,
            "temperature": 0.0,
        }
    return {"prompt": f"{prompt},", "max_new_tokens": EXPANSION_TOKENS, "temperature": 0.0}


def expanded(dispatcher: Dispatcher, image_model: str, prompt: str, expansion: str) -> str:
    """``"<prompt>, <expansion>"`` cut (whole characters off the expansion's end) to the image
    model's ``max_prompt_chars`` and ``max_prompt_tokens``; the prompt alone when nothing fits."""
    expansion = " ".join(expansion.split())
    if not expansion:
        return prompt
    record = dispatcher.validator.registry.get(image_model)
    family = limits_for(dispatcher.validator.limits, record.family)
    count = dispatcher.validator.tokenizers.counter(image_model)
    text = f"{prompt}, {expansion}"[: family.max_prompt_chars]
    while len(text) > len(prompt) and count is not None and count(text) > family.max_prompt_tokens:
        text = text[: max(len(prompt), len(text) - max(1, (len(text) - len(prompt)) // 4))]
    return text.rstrip(", ") if len(text) > len(prompt) else prompt


async def submit_expanded(
    dispatcher: Dispatcher,
    waiting: Waiting,
    model_id: str,
    params: dict[str, Any],
    target: str,
    idempotency_key: str | None,
    wait_s: float,
    api_key_id: str | None = None,
    webhook_url: str | None = None,
) -> Submission:
    """Submit a txt2img job whose ``params.expand_prompt`` names a text model: the expansion's
    text job first, awaited (``waiting``), then the image job (module docstring); the journal's
    and the dispatcher's calls run in worker threads. Both are jobs of the
    API key ``api_key_id`` (its quota applies to each). ``webhook_url`` is
    the image job's (checked before any job); the text job has none.

    Raises:
        Rejected: ``expanded_by`` sent by the client (the server sets it), ``expand_prompt`` not
            a registered text model (``invalid_expand_prompt``), the webhook refused
            (``invalid_webhook_url``), or the image request refused (its own reason) — each
            before any job.
        JobPending: the text job has not ended within ``wait_s`` (409 ``job_pending``, naming it in ``job_ids``).
        ExpansionFailed: the text job ended without a result.
    """
    text = await to_thread.run_sync(
        _submit_text, dispatcher, model_id, params, target, idempotency_key, api_key_id, webhook_url
    )
    if text.replayed:
        return text  # R20: the retry gets the first call's image job
    job = await waiting.until_ended(text.job.id, wait_s)
    if job.state not in ENDED:
        raise JobPending(
            f"the prompt's expansion, text job {job.id}, has not ended within {wait_s:g} s "
            "(images_wait_s); it keeps running: submit the image again once it has",
            [job.id],
        )
    return await to_thread.run_sync(
        _submit_image, dispatcher, job, model_id, params, target, idempotency_key, api_key_id, webhook_url
    )


def _submit_text(
    dispatcher: Dispatcher,
    model_id: str,
    params: dict[str, Any],
    target: str,
    idempotency_key: str | None,
    api_key_id: str | None,
    webhook_url: str | None,
) -> Submission:
    """The checks of :func:`submit_expanded`, then its text job's submission (or, for a retry
    of an expanded submission, the original image job, ``replayed``)."""
    if "expanded_by" in params:
        raise Rejected(
            "params.expanded_by is set by the server (the expansion's text job); send expand_prompt only",
            reason="invalid_params",
            param="params.expanded_by",
        )
    if idempotency_key is not None:
        original = dispatcher.journal.by_idempotency_key(scoped_idempotency_key(idempotency_key, api_key_id) or "")
        if original is not None and (original.params or {}).get("expanded_by"):
            return Submission(job=original, position=0, replayed=True)  # R20: the retry gets the first call's job
    text_model = params.get("expand_prompt")
    try:
        record = dispatcher.validator.registry.get(str(text_model))
    except HomefleetError as error:
        raise Rejected(
            f"params.expand_prompt must name a registered text model, got {text_model!r}",
            reason="invalid_expand_prompt",
            param="params.expand_prompt",
        ) from error
    if "text" not in record.kinds:
        raise Rejected(
            f"params.expand_prompt must name a text model; {text_model!r} runs {', '.join(record.kinds)}",
            reason="invalid_expand_prompt",
            param="params.expand_prompt",
        )
    prompt = str(params.get("prompt") or "")
    dispatcher.check_webhook(webhook_url, api_key_id)
    dispatcher.request(model_id, "txt2img", {**params, "expanded_by": "pending"}, target)  # the image's checks first
    return dispatcher.submit(
        str(text_model), "text", expansion_prompt(dispatcher, str(text_model), prompt), AUTO, api_key_id=api_key_id
    )


def _submit_image(
    dispatcher: Dispatcher,
    job: Job,
    model_id: str,
    params: dict[str, Any],
    target: str,
    idempotency_key: str | None,
    api_key_id: str | None,
    webhook_url: str | None,
) -> Submission:
    """The image job of :func:`submit_expanded`, once its text job ``job`` has ended.

    Raises:
        ExpansionFailed: the text job ended without a result.
    """
    if job.state != JobState.succeeded or job.result_path is None:
        raise ExpansionFailed(
            f"the prompt's expansion, text job {job.id}, ended {job.state}: {job.reason}: "
            f"{job.message}; the image was not submitted"
        )
    with open(job.result_path, "rb") as handle:
        expansion = handle.read().decode("utf-8", errors="replace")
    prompt = str(params.get("prompt") or "")
    image_params = {**params, "prompt": expanded(dispatcher, model_id, prompt, expansion), "expanded_by": job.id}
    submission = dispatcher.submit(
        model_id, "txt2img", image_params, target, idempotency_key, api_key_id=api_key_id, webhook_url=webhook_url
    )
    dispatcher.journal.log(job.id, "expanded_for", submission.job.id)
    return submission
