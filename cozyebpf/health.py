"""/healthz (liveness) and /readyz (readiness) over HTTP, for the DaemonSet's probes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from cozyebpf.httpserver import Handler, HttpServer

log = logging.getLogger(__name__)


class HealthServer(HttpServer):
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

        class HealthHandler(Handler):
            log_name = "health"

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/status" and status is not None:
                    try:
                        body = json.dumps(status()).encode() + b"\n"
                    except Exception as e:  # a failed request must not stop the server
                        log.error("status: %s", e)
                        self.send_error(500, str(e))
                        return
                    self.send_body(200, body, "application/json")
                    return
                check = checks.get(path)
                if check is None:
                    self.send_error(404)
                    return
                problem = check()
                body = (problem or "ok").encode() + b"\n"
                self.send_body(503 if problem else 200, body, "text/plain")

        super().__init__(
            "health",
            address,
            HealthHandler,
            option="--health-address",
            example="127.0.0.1:9810",
            paths="/healthz and /readyz",
        )
