"""Placement: which machine runs a job. Pure: plain data in, a decision out (no Redis,
Celery, torch or HTTP here)."""
