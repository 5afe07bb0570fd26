"""The TLS context every HTTP client of evalsvc shares.

httpx builds a new ``ssl.SSLContext`` for each ``httpx.Client`` (and each ``httpx.get``), loading
the CA bundle each time: about 20 ms of CPU. evalsvc opens a client per engine start-up, per engine
client and per alert, so that cost recurs through a job. One context per process, built by the
function httpx builds its default with (its CA bundle, ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``
honoured), verifies the same: pass it as ``verify=tls_context()``.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()
