"""Running a fleet on one host: the demo, drills, benchmarks, tiny models, a private Redis."""
