"""A scrape of the agent's metrics over HTTPS as a test client makes it (test_metrics_flood.py,
test_kube_e2e.py): no verification of the agent's self-signed certificate, as a PodMonitor
skips it too."""

from __future__ import annotations

import socket
import ssl


def _client_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # self-signed (a PodMonitor skips verification too)
    ctx.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)  # the end of an HTTP/1.0 answer
    return ctx


CTX = _client_context()


def https_get(address: tuple[str, int], token: str) -> tuple[int, str] | None:
    """(status, body) of GET /metrics with `token`; None when the server closed the
    connection without an answer (refused at its cap)."""
    data = b""
    try:
        with socket.create_connection(address, timeout=10) as raw, CTX.wrap_socket(raw) as s:
            s.sendall(
                b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n"
            )
            while chunk := s.recv(65536):
                data += chunk
    except (ssl.SSLError, ConnectionError):
        if not data:
            return None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()
