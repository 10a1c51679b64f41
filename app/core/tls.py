"""The TLS context of every HTTP client Homefleet makes, built once per process.

httpx builds a new TLS context for each ``httpx.Client`` (and each ``httpx.get``/``post``),
plain ``http://`` URLs included: it parses certifi's bundle of CA certificates, ~45 ms of CPU
on the 2-core CI machine against ~0.1 ms with a context given (docs/benchmarks.md, "The test
suite"). Homefleet makes many short-lived clients: a worker's client of its servers, its join
and its polling, the CLI's calls, the webhook sender, a local fleet's health checks. Each passes
``verify=tls_context()``; tests/unit/core/test_tls.py holds app/, tasks/ and the tests to that.

The context verifies as httpx's default does: certifi's CA bundle, or ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` when set (read at the first use). A context is shareable between threads, and a
forked child inherits its parent's.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """This process's TLS context for HTTP clients (httpx's default verification), built at the
    first call. Raises ``ssl.SSLError`` or ``OSError`` when the CA bundle cannot be read."""
    return httpx.create_ssl_context()
