"""Start the embedded engine's server: parse flags, then serve until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import time


def main(argv: list[str]) -> int:
    started = time.time()
    from .args import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s engine:{args.port}] %(levelname)s %(message)s")
    log = logging.getLogger("evalsvc.engine")
    for warning in args.warnings:
        log.warning(warning)
    if args.defects:
        log.warning("defects switched on: %s", ", ".join(args.defects))

    import uvicorn

    from .server import create_app

    app = create_app(args, started)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 0 if app.state.engine.failed is None else 1
