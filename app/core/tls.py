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
import os
import ssl
from collections.abc import Mapping

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """This process's TLS context for HTTP clients (httpx's default verification), built at the
    first call. Raises ``ssl.SSLError`` or ``OSError`` when the CA bundle cannot be read."""
    return httpx.create_ssl_context()


#: the variables that give the context its CA certificates (httpx's default verification reads them)
CA_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR")


def untrusted_certificate(error: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The failed certificate verification behind ``error`` (httpx raises ``ConnectError`` from
    it), or None when ``error`` is something else (refused, timed out, no such host)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ssl.SSLCertVerificationError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def untrusted_advice(url: str, error: ssl.SSLCertVerificationError) -> str:
    """What to do about the server at ``url`` whose certificate this host does not trust: one
    sentence naming the certificate's fault and the variables (docs/operations.md, "Add a machine")."""
    return (
        f"the server at {url!r} answers over TLS with a certificate this host does not trust "
        f"({error.verify_message or error.reason}); give the certificate that signed it (a self-signed server's own) "
        "as SSL_CERT_FILE=/path/ca.pem (or SSL_CERT_DIR) in the environment of `homefleet worker join`, the worker "
        "and `homefleet doctor`: a supervisor file printed with it set carries it"
    )


def ca_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`CA_VARIABLES` set in ``environ``, their paths made absolute: what a supervisor
    file must set too for the worker it runs to trust the server as this process does."""
    return {name: os.path.abspath(os.path.expanduser(environ[name])) for name in CA_VARIABLES if environ.get(name)}
