"""Imported once by a process that forks workers (the local fleet's fork server,
app/devtools/forkserver.py): what a worker imports before it runs a job, offline and quiet
as the worker makes itself (:func:`tasks.pipelines.go_offline`, :func:`tasks.pipelines.quiet`).
diffusers and transformers resolve their classes lazily, at first use: the ones the tiny
and demo models use are resolved here, once, not in every pool process's first job."""

from __future__ import annotations

from tasks.pipelines import go_offline, quiet

go_offline()  # before huggingface_hub reads its settings, at import
quiet()

import diffusers  # noqa: E402
import transformers  # noqa: E402

diffusers.DiffusionPipeline  # noqa: B018
diffusers.StableDiffusionPipeline  # noqa: B018
transformers.AutoModelForCausalLM  # noqa: B018
