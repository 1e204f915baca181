"""/healthz (liveness) and /readyz (readiness) over HTTP, for the DaemonSet's probes."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cozyebpf.errors import PermanentError

log = logging.getLogger(__name__)


def parse_address(
    address: str, option: str = "--health-address", example: str = "127.0.0.1:9810"
) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise PermanentError(f"{option} {address!r} is not HOST:PORT (e.g. {example})")
    return host.strip("[]") or "0.0.0.0", int(port)


class HealthServer:
    """Answers 200 while `check()` returns None, else 503 with the reason; /status (when
    `status` is given) is the agent's state as JSON, for `cozyebpf status`."""

    def __init__(
        self,
        address: str,
        live: Callable[[], str | None],
        ready: Callable[[], str | None],
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        checks = {"/healthz": live, "/livez": live, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/status" and status is not None:
                    try:
                        body = json.dumps(status()).encode() + b"\n"
                    except Exception as e:  # a failed request must not stop the server
                        log.error("status: %s", e)
                        self.send_error(500, str(e))
                        return
                    self._send(200, body, "application/json")
                    return
                check = checks.get(path)
                if check is None:
                    self.send_error(404)
                    return
                problem = check()
                body = (problem or "ok").encode() + b"\n"
                self._send(503 if problem else 200, body, "text/plain")

            def log_message(self, format: str, *args: object) -> None:
                log.debug("health: " + format, *args)

        host, port = parse_address(address)
        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise PermanentError(f"cannot serve health checks on {address}: {e}") from e
        self.server.daemon_threads = True
        self.address = f"{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="health", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        log.info("health checks on http://%s/healthz and /readyz", self.address)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
