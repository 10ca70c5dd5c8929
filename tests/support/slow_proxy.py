"""A TCP proxy on 127.0.0.1 that slows one direction down: a slow link to a storage emulator.

    with SlowProxy("127.0.0.1", emu.port, upload_bps=2_000_000) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)

``upload_bps`` limits bytes from the client to the server, ``download_bps`` the
other way (None: full speed).  Data keeps flowing, just slowly, so no socket
timeout ever fires: only a caller that keeps its own deadline stops in time.
"""

from __future__ import annotations

import socket
import threading
import time


class SlowProxy:
    def __init__(self, host: str, port: int, *, upload_bps: float | None = None, download_bps: float | None = None):
        self.target = (host, port)
        self.upload_bps = upload_bps
        self.download_bps = download_bps
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "SlowProxy":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:  # shutdown wakes a thread blocked in recv; close alone does not
                for end in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
                    try:
                        end()
                    except OSError:
                        pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:  # the server is gone: the client sees its connection closed
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.upload_bps), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.download_bps), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bps: float | None) -> None:
        chunk = 16384 if bps else 1 << 20
        try:
            while not self._stop.is_set():
                data = src.recv(chunk)
                if not data:
                    break
                dst.sendall(data)
                if bps:
                    time.sleep(len(data) / bps)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
