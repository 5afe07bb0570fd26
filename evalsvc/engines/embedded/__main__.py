"""``python -m evalsvc.engines.embedded [flags]``: run the embedded engine's HTTP server."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from .app import main


def exit_now(code: object) -> None:
    """End the process with ``code`` (as ``sys.exit`` reads it), its output flushed, without the
    interpreter's teardown: unloading torch and the model takes longer than the server's own
    shutdown (1 to 2 s measured here, once the server has stopped), and an engine holds nothing
    that needs it."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # a message, as sys.exit prints it
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    try:
        code: object = main(sys.argv[1:])
    except SystemExit as exc:  # the signal handlers end the server this way
        code = exc.code
    exit_now(code)
