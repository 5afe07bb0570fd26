"""Start the embedded engine's server: parse flags, then serve until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
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
        log.warning("defects switched on: %s", ", ".join(
            d if s >= 1.0 else f"{d} (strength {s:g})" for d, s in args.defect_strengths.items()))

    import uvicorn

    try:
        from .server import create_app
    except ImportError as exc:  # torch, when the engine extra is not installed
        from .deps import missing_dependency

        message = missing_dependency(exc)
        if message is None:
            raise
        log.error("engine failed to start: %s", message)
        return 1

    app = create_app(args, started)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    engine = app.state.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            engine.close()  # abort what is running so open requests answer (503) at once
            super().handle_exit(sig, frame)

    server = Server(config)

    def exit_on_failed_load() -> None:  # as SGLang's launcher: no server without its model
        server.should_exit = True

    engine.on_failed = exit_on_failed_load

    def exit_after_shutdown(signum, frame) -> None:
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then restores the previous handlers and
        # raises the signal again; without this handler the process would die by it (-15) after a
        # clean shutdown. A signal before uvicorn installs its handlers ends the process the same way.
        raise SystemExit(0 if app.state.engine.failed is None else 1)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, exit_after_shutdown)
    server.run()
    return 0 if app.state.engine.failed is None else 1
