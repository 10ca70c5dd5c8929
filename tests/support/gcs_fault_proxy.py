"""A Cloud Storage stand-in that refuses some uploads: a reverse proxy in front of the emulator.

Every request is passed to the emulator as it is (after `delay_s`, a slow network), except an
upload whose body contains `refuse_marker`: that one is answered 403, as Cloud Storage answers a request its caller may
not make. Jobs point STORAGE_EMULATOR_HOST at `url`; a test decides which content fails by
writing the marker into a checkpoint file. Small (single request) uploads only.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class GcsFaultProxy:
    def __init__(self, upstream: str, refuse_marker: bytes = b"", delay_s: float = 0.0, create_only: bool = False):
        self.upstream = urlsplit(upstream)
        self.refuse_marker = refuse_marker
        # Cloud Storage answers 412 to an upload with ifGenerationMatch=0 over an existing object;
        # fake-gcs-server writes it anyway on a media upload: this makes it answer as Cloud Storage does.
        self.create_only = create_only
        self.delay_s = delay_s  # every request waits this long first: a slow network
        self.refused = 0
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests.append((self.command, self.path))
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                if proxy.create_only and self.command == "POST" and self._exists_for_create_only():
                    return self._error(412, "conditionNotMet")
                if self.command in ("POST", "PUT") and proxy.refuse_marker and proxy.refuse_marker in body:
                    proxy.refused += 1
                    return self._error(403, "upload refused by the test")
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                head = self.command == "HEAD"
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _error(self, code: int, message: str) -> None:
                """Answer as Cloud Storage answers a request it refuses."""
                reply = json.dumps({"error": {"code": code, "message": message}}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def _exists_for_create_only(self) -> bool:
                """A media upload asking ifGenerationMatch=0 of an object the emulator holds."""
                from urllib.parse import parse_qs, quote

                url = urlsplit(self.path)
                q = parse_qs(url.query)
                if not url.path.startswith("/upload/") or q.get("ifGenerationMatch") != ["0"] or "name" not in q:
                    return False
                bucket = url.path.split("/b/", 1)[1].split("/", 1)[0]
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request("GET", f"/storage/v1/b/{bucket}/o/{quote(q['name'][0], safe='')}")
                    resp = conn.getresponse()
                    resp.read()
                    return resp.status == 200
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _relay

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that hung up (a job ended mid-request) is not the test's concern

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> GcsFaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()
