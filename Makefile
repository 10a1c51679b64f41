# Homefleet: `make demo` runs the fleet on this machine; `make test` runs the test suite.
# Both create .venv on first use: torch==2.13.0 (CPU) FIRST, then the project
# (docs/operations.md: an unpinned torch pulls a multi-GB CUDA build).

# The interpreter: Debian's python3.11 where it exists, else the first python3.11 (or python3)
# on PATH. Debian builds CPython with profile-guided and link-time optimisation; pyenv's default
# build has neither, and ran this project's pure-Python work 1.4x slower on the same host
# (placement decisions at 500 machines 19.9 vs 13.9 ms, the unit tier 77 vs 52 s:
# docs/benchmarks.md, "The test suite"). An existing .venv keeps its interpreter: `make clean`.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3.11) $(shell command -v python3.11 || command -v python3))
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint install clean fuzz screenshots

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/homefleet demo

# Five pytest-xdist workers, even on 2 cores: the end-to-end tests mostly wait on their fleets'
# processes, and with three lanes a 2-core host sat idle for ~150 CPU-s of a run whenever every
# lane waited at once; five lanes fill those waits with other tests at the same CPU (measured in
# one session: 367-380 s with three, 315 s with four, 292 s with five; docs/benchmarks.md, "The
# test suite"). The tests that share a fleet of real workers stay together in one (tests/conftest.py,
# XDIST_GROUPS). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 5

# PYTHONDONTWRITEBYTECODE (set on some machines, CI's among them) is cleared for the run: without
# cached bytecode every process compiled this project's modules again at each start, and pytest
# rewrote each test module again in each xdist worker (~60 CPU-s of a run on the 2-core CI
# machine; docs/benchmarks.md, "The test suite"). The caches are __pycache__ folders (.gitignore).
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

# ruff (lint, then the format: `ruff format .` writes it) and mypy (strict for routing/,
# residency/ and app/core/; pyproject.toml, [tool.mypy]). .ci/run runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Real-HTTP fuzz of the public API: schemathesis, all checks, >= 5,000 cases over every route.
fuzz: $(STAMP)
	$(VENV)/bin/homefleet fuzz --examples 100 --workers 4 --wait-s 2 --min-cases 5000

# The fleet page's screenshots (docs/screenshots/*.png): its browser test, saving each view.
screenshots: $(STAMP)
	HOMEFLEET_SCREENSHOTS=docs/screenshots $(VENV)/bin/python -m pytest -q tests/e2e/test_fleet_page.py

clean:
	rm -rf $(VENV) var
