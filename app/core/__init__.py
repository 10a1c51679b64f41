"""The contract shared by the server and the workers: settings, errors, Redis keys, digests,
variants, limits, job kinds, the Celery app, the internal API's bodies. Imports nothing of the
rest of ``app`` (the workers import only this package of it)."""
