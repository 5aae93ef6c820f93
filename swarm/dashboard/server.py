"""The dashboard's web server: the standard library's ThreadingHTTPServer (no dependency to keep
up; the page is three static files and one JSON document, polled). Read-only: GET and HEAD only.

- `/`, `/static/dashboard.js`, `/static/dashboard.css`: the page, shipped as package data (no CDN:
  it works with no internet access);
- `/api/state`: `SwarmView.document()`.

Every response forbids inline scripts and any script not served from here (Content-Security-
Policy), on top of the page putting peer data into the document as text only. Bound to a loopback
address, it answers only requests addressed to localhost or a loopback IP, so a web page elsewhere
cannot read it through DNS rebinding.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import urlsplit

from swarm.dashboard.state import SwarmView

logger = logging.getLogger(__name__)

STATIC = {  # path -> (file in swarm/dashboard/static, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def static_file(name: str) -> bytes:
    return resources.files("swarm.dashboard").joinpath("static", name).read_bytes()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DashboardServer:
    """Serves `view` on host:port (port 0: a free one) from a thread of its own until `close()`."""

    def __init__(self, view: SwarmView, *, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.view = view
        self.pages = {path: (static_file(name), kind) for path, (name, kind) in STATIC.items()}
        self.local_only = is_loopback(host)
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "gepo-swarm-dashboard"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
                self._answer(body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                try:
                    host = urlsplit(f"//{self.headers.get('Host', '')}").hostname or ""
                except ValueError:  # a malformed Host header
                    host = ""
                if server.local_only and not is_loopback(host):
                    return self._send(403, b"this dashboard answers only requests to localhost\n", "text/plain", body)
                path = urlsplit(self.path).path
                if path == "/api/state":
                    return self._send(200, server.view.document(), "application/json", body)
                if path == "/favicon.ico":
                    return self._send(204, b"", "image/x-icon", body)
                if path in server.pages:
                    content, kind = server.pages[path]
                    return self._send(200, content, kind, body)
                self._send(404, b"not found\n", "text/plain", body)

            def _send(self, status: int, content: bytes, kind: str, body: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(content)))
                for name, value in SECURITY_HEADERS.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def log_message(self, format: str, *args) -> None:  # noqa: A002  (the base class's name)
                logger.debug("%s %s", self.address_string(), format % args)

        return Handler
