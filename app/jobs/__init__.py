"""A job's way through the server: validation, dispatch, progress, reconciliation, sync."""
