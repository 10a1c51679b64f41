"""The job journal (R19) and the learned timings kept beside it (R13)."""
