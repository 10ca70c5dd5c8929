"""Peers before the bucket: the nodes of one job hand each other the blobs their caches hold.

During a multi-node restore (and only then) the batch step runs a :class:`Coordinator` on its
node's address, an ephemeral port, with a random token made for this restore; the token reaches
the node agents in their environment (never their argv). Each agent:

0. takes the committed manifest the batch step read (and its generation) from the coordinator,
   not from the bucket: every agent restores exactly what the batch step decided, and an agent
   whose checkpoint is all in caches never starts a Cloud Storage client (else it reads the bucket);
1. starts a :class:`PeerServer` on its own address (the one it reaches the coordinator from),
   an ephemeral port, serving its node-local cache (:mod:`slurmagent.checkpoint.local_cache`) to
   whoever shows the token;
2. checks in: what its cache holds, which blobs it still needs after its own cache;
3. gets its plan back once every agent checked in (or the barrier timed out): for each blob it
   needs, the peer that holds it (the least loaded one); everything else comes from the bucket;
4. fetches the planned blobs, every byte hashed into the content id as it arrives (BLAKE3, or
   SHA-256 for an older manifest's entry; no CRC32C besides: a match of the content id is the
   stronger check, and the manifest's CRC32C was computed from those very bytes); a peer
   that serves other bytes, dies mid-transfer or cannot be reached is named in one line, and
   what it should have served comes from the bucket;
5. reports done and serves on until the coordinator ends the round (every agent done).

Wire (one TCP connection per request, lines then bytes)::

    peer:   "GET <token> <content id>\\n"  ->  "OK <size>\\n" <bytes>  |  "NO\\n"
    coord:  "HELLO <token>\\n" {check-in JSON}\\n  ->  {plan JSON}\\n ;  {"done": true}\\n  ->  "END\\n"
    coord:  "MANIFEST <token>\\n"  ->  "OK <generation> <size>\\n" <manifest JSON>  |  "NO\\n"
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import socketserver
import threading
import time
from typing import Callable, Iterable, Mapping

from ..errors import CheckpointError
from ..hashing import is_content_id
from ..local_cache import BlobCache
from ..manifest import Manifest, entry_content_id
from .transfer import Deadline, WorkerPool, one_line

__all__ = ["Coordinator", "PeerFailed", "PeerServer", "PeerSession", "fetch_from_peer", "new_token", "peer_host"]

CHUNK = 4 << 20
LINE_MAX = 1 << 10
CONNECT_S = 5.0  # a peer that does not answer within this is unreachable


def new_token() -> str:
    return secrets.token_hex(16)


def peer_host(env: Mapping[str, str]) -> str:
    """The batch node's address the agents reach the coordinator at: ``SLURMAGENT_PEER_HOST``, else
    what this host's name resolves to ('' when it does not: no peers, the bucket serves)."""
    if env.get("SLURMAGENT_PEER_HOST"):
        return env["SLURMAGENT_PEER_HOST"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


class PeerFailed(Exception):
    """A peer did not hand over a blob whole and right (the blob then comes from the bucket)."""


def read_line(sock: socket.socket, limit: int = LINE_MAX) -> str:
    """One ``\\n``-ended line, read byte-wise-ish (small); '' on EOF before any byte."""
    buf = bytearray()
    while len(buf) <= limit:
        b = sock.recv(1)
        if not b:
            break
        if b == b"\n":
            return buf.decode("utf-8", "replace")
        buf += b
    if buf:
        raise PeerFailed("a torn or overlong line")
    return ""


def read_json_line(sock: socket.socket, limit: int = 64 << 20) -> dict:
    f = sock.makefile("rb")
    try:
        line = f.readline(limit)
    finally:
        f.close()
    if not line:
        raise PeerFailed("the connection closed")
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        raise PeerFailed("not one JSON line") from None
    if not isinstance(doc, dict):
        raise PeerFailed("not a JSON object")
    return doc


# --------------------------------------------------------------------------- serving a cache


class PeerServer:
    """Serves the cache's entries to holders of ``token``, bound to ``host``, an ephemeral port."""

    def __init__(self, cache: BlobCache | None, token: str, host: str) -> None:
        self.cache, self.token = cache, token
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer.serve_one(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),  # close() waits one poll
                                        name="ckpt-peer-server", daemon=True)
        self._thread.start()

    def serve_one(self, sock: socket.socket) -> None:
        sock.settimeout(30.0)
        try:
            parts = read_line(sock).split(" ")
            if len(parts) != 3 or parts[0] != "GET" or not hmac.compare_digest(parts[1].encode(), self.token.encode()):
                return  # not of this job: nothing said, nothing served
            cid = parts[2]
            if self.cache is None or not is_content_id(cid):
                sock.sendall(b"NO\n")
                return
            try:
                fd = os.open(self.cache.path_of(cid), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                sock.sendall(b"NO\n")
                return
            try:
                size = os.fstat(fd).st_size
                sock.sendall(f"OK {size}\n".encode())
                self.send_body(sock, fd, size)
            finally:
                os.close(fd)
        except (OSError, PeerFailed):
            pass

    def send_body(self, sock: socket.socket, fd: int, size: int) -> None:
        """The entry's bytes, straight from the file (``sendfile``, waiting on a full socket buffer
        within the socket's timeout)."""
        with os.fdopen(fd, "rb", closefd=False) as f:
            sock.sendfile(f, 0, size)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fetch_from_peer(host: str, port: int, token: str, entry: Mapping, dest: str, dl: Deadline) -> int:
    """Fetch ``entry``'s blob from a peer into ``dest`` (created, absent before), checking every
    byte against its content id; on any failure ``dest`` is gone and :class:`PeerFailed` says why."""
    import blake3

    cid, size = entry_content_id(entry), entry["size"]
    legacy = not entry.get("blake3")
    try:
        sock = socket.create_connection((host, port), timeout=min(CONNECT_S, max(dl.remaining(), 0.1)))
    except OSError as exc:
        raise PeerFailed(f"unreachable at {host}:{port} ({exc.strerror or exc})") from None
    fd = -1
    try:
        sock.settimeout(min(30.0, max(dl.remaining(), 0.1)))
        sock.sendall(f"GET {token} {cid}\n".encode())
        head = read_line(sock).split(" ")
        if len(head) != 2 or head[0] != "OK" or head[1] != str(size):
            raise PeerFailed(f"does not hold {cid}" if head == ["NO"] else f"answered {' '.join(head)[:40]!r}")
        h = hashlib.sha256() if legacy else blake3.blake3()  # one thread: the fetches run side by side
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        buf = bytearray(min(CHUNK, max(size, 1)))
        view = memoryview(buf)
        got = 0
        while got < size:
            if dl.abort.is_set() or time.monotonic() >= dl.end:
                raise PeerFailed("the restore's deadline came first")
            n = sock.recv_into(view[: min(len(buf), size - got)])
            if n == 0:
                raise PeerFailed(f"closed the connection after {got} of {size} bytes")
            chunk = view[:n]
            h.update(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
            got += n
        want = entry["sha256"] if legacy else entry["blake3"]
        if h.hexdigest() != want:
            raise PeerFailed(f"served bytes that are not {cid}")
        return got
    except PeerFailed:
        _drop(fd, dest)
        fd = -1
        raise
    except (OSError, ValueError) as exc:
        _drop(fd, dest)
        fd = -1
        raise PeerFailed(f"failed mid-transfer: {one_line(exc)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        sock.close()


def _drop(fd: int, dest: str) -> None:
    if fd >= 0:
        os.close(fd)
    try:
        os.unlink(dest)
    except OSError:
        pass


# --------------------------------------------------------------------------- an agent's side


class PeerSession:
    """One agent's part in a peer restore: serve, check in, fetch by the plan, serve until the end."""

    def __init__(self, coordinator: str, token: str, index: int, node: str, *,
                 server_factory: Callable[[BlobCache | None, str, str], PeerServer] = PeerServer,
                 barrier_s: float = 120.0) -> None:
        host, _, port = coordinator.rpartition(":")
        self.coord = (host.strip("[]"), int(port))
        self.token, self.index, self.node = token, index, node
        self.server_factory = server_factory
        self.barrier_s = barrier_s
        self.server: PeerServer | None = None
        self.sock: socket.socket | None = None
        self.messages: list[str] = []  # one line per failed peer (and a coordinator that failed)
        self.fetched = 0  # files taken from peers
        self.fetched_bytes = 0
        self.seconds = 0.0  # spent fetching from peers
        self.checked_in = False

    def say(self, line: str) -> None:
        self.messages.append(line)

    def manifest(self, generation: int) -> tuple[Manifest, int] | None:
        """The committed manifest as the batch step read it, when it is of ``generation``; None
        (the agent reads the bucket) when the coordinator has none or cannot be asked."""
        try:
            with socket.create_connection(self.coord, timeout=CONNECT_S) as sock:
                sock.settimeout(30.0)
                sock.sendall(f"MANIFEST {self.token}\n".encode())
                head = read_line(sock).split(" ")
                if len(head) != 3 or head[0] != "OK" or int(head[1]) != generation:
                    return None
                size, buf = int(head[2]), bytearray()
                while len(buf) < size:
                    chunk = sock.recv(min(size - len(buf), CHUNK))
                    if not chunk:
                        return None
                    buf += chunk
            return Manifest.from_json(bytes(buf), f"from the batch step at {self.coord[0]}:{self.coord[1]}"), generation
        except (OSError, ValueError, PeerFailed, CheckpointError):
            return None

    def plan(self, cache: BlobCache | None, needs: Iterable[str]) -> dict[str, tuple[str, int, str]]:
        """Check in (starting this node's server first); content id -> (host, port, peer name)."""
        if self.checked_in:
            return {}
        self.checked_in = True
        try:
            self.sock = socket.create_connection(self.coord, timeout=CONNECT_S)
            here = self.sock.getsockname()[0]  # this node's address on the path the job's nodes share
            self.server = self.server_factory(cache, self.token, here)
            self.sock.settimeout(self.barrier_s + 30.0)
            hello = {"index": self.index, "node": self.node, "host": self.server.host, "port": self.server.port,
                     "holds": sorted(cache.ids()) if cache is not None else [], "needs": sorted(set(needs))}
            self.sock.sendall(f"HELLO {self.token}\n".encode() + json.dumps(hello).encode() + b"\n")
            plan = read_json_line(self.sock).get("plan", {})
            return {cid: (p[0], int(p[1]), str(p[2])) for cid, p in plan.items()}
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, PeerFailed) as exc:  # any answer
            self.say(f"no peers for this restore (the coordinator at {self.coord[0]}:{self.coord[1]}: "
                     f"{one_line(exc)}): every blob not in the node-local cache comes from the bucket")
            return {}

    def fetch(self, plan: Mapping[str, tuple[str, int, str]], items: list[tuple[str, dict]], stage: list[str],
              dl: Deadline, workers: int = 8) -> tuple[list[tuple[str, dict]], list[str]]:
        """Fetch what ``plan`` names into staging; returns the items (and paths) left for the bucket."""
        todo = [k for k, (_, e) in enumerate(items) if entry_content_id(e) in plan]
        if not todo:
            return items, stage
        got: set[int] = set()
        failed: dict[str, list[str]] = {}
        lock = threading.Lock()
        pool = WorkerPool(min(workers, len(todo)), dl, "ckpt-peer")
        started = time.monotonic()

        def one(k: int) -> None:
            rel, entry = items[k]
            host, port, name = plan[entry_content_id(entry)]
            with lock:
                if name in failed:  # one failure: the rest of that peer's share goes to the bucket
                    return
            try:
                n = fetch_from_peer(host, port, self.token, entry, stage[k], dl)
            except PeerFailed as exc:
                with lock:
                    failed.setdefault(name, [str(exc), rel])
                return
            with lock:
                got.add(k)
                self.fetched += 1
                self.fetched_bytes += n

        try:
            pool.run_each(one, todo)
        finally:
            self.seconds += time.monotonic() - started
        for name, (why, rel) in sorted(failed.items()):
            self.say(f"peer {name} failed ({why}, fetching {rel}): its blobs come from the bucket instead")
        keep = [k for k in range(len(items)) if k not in got]
        return [items[k] for k in keep], [stage[k] for k in keep]

    def finish(self, wait_s: float) -> None:
        """Done: check in when never done (so nobody waits for us), then serve until the coordinator
        ends the round (or ``wait_s``), then stop serving."""
        try:
            if not self.checked_in:
                self.plan(None, ())
            if self.sock is not None:
                self.sock.settimeout(max(wait_s, 0.1))
                self.sock.sendall(b'{"done": true}\n')
                read_line(self.sock)  # "END", or EOF when the batch step is gone
        except (OSError, PeerFailed):
            pass
        finally:
            if self.sock is not None:
                self.sock.close()
            if self.server is not None:
                self.server.close()


# --------------------------------------------------------------------------- the batch step's side


class Coordinator:
    """The batch step's meeting point: gathers every agent's check-in, plans, ends the round."""

    def __init__(self, nodes: int, token: str, sizes: Mapping[str, int], host: str, *, barrier_s: float = 60.0,
                 manifest: bytes = b"", generation: int = 0) -> None:
        self.nodes, self.token, self.sizes, self.barrier_s = nodes, token, dict(sizes), barrier_s
        self.manifest, self.generation = manifest, generation  # what the batch step read: the agents restore it
        self._cond = threading.Condition()
        self._hellos: dict[int, dict] = {}
        self._done: set[int] = set()
        self._plans: dict[int, dict] | None = None
        self._closed = False
        self._started = time.monotonic()
        self.planned_from_peers = 0  # blobs planned from a peer, all agents together
        self._sock = socket.create_server((host, 0))
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="ckpt-peer-coordinator", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._cond:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        index = None
        try:
            conn.settimeout(self.barrier_s + 30.0)
            parts = read_line(conn).split(" ")
            if len(parts) != 2 or parts[0] not in ("HELLO", "MANIFEST") or not hmac.compare_digest(
                    parts[1].encode(), self.token.encode()):
                return
            if parts[0] == "MANIFEST":
                conn.sendall(f"OK {self.generation} {len(self.manifest)}\n".encode() + self.manifest
                             if self.manifest else b"NO\n")
                return
            hello = read_json_line(conn)
            index = int(hello["index"])
            with self._cond:
                if self._plans is None:
                    self._hellos[index] = hello
                    self._cond.notify_all()
                deadline = self._started + self.barrier_s
                while self._plans is None and len(self._hellos) < self.nodes and time.monotonic() < deadline:
                    self._cond.wait(max(deadline - time.monotonic(), 0.01))
                if self._plans is None:
                    self._plans = self._plan()
                mine = self._plans.get(index, {})
            conn.sendall(json.dumps({"plan": mine}).encode() + b"\n")
            conn.settimeout(None)
            conn.makefile("rb").readline()  # done, or EOF: that agent is gone either way
            with self._cond:
                self._done.add(index)
                self._cond.notify_all()
                while not self._closed and not self._done >= set(self._hellos):
                    self._cond.wait(1.0)
            conn.sendall(b"END\n")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, PeerFailed):  # whatever a peer sent
            with self._cond:
                if index is not None:
                    self._done.add(index)
                self._cond.notify_all()
        finally:
            conn.close()

    def _plan(self) -> dict[int, dict]:
        """Each needed blob from the least loaded other agent that holds it (none: the bucket)."""
        holders: dict[str, list[int]] = {}
        for i, h in self._hellos.items():
            for cid in h.get("holds", ()):
                holders.setdefault(cid, []).append(i)
        load = dict.fromkeys(self._hellos, 0)
        plans: dict[int, dict] = {}
        for i, h in sorted(self._hellos.items()):
            mine = {}
            for cid in h.get("needs", ()):
                there = [j for j in holders.get(cid, ()) if j != i]
                if not there:
                    continue
                j = min(there, key=lambda j: (load[j], j))
                load[j] += self.sizes.get(cid, 1)
                peer = self._hellos[j]
                mine[cid] = [peer["host"], peer["port"], f"{peer.get('node') or '?'} (node index {j})"]
            plans[i] = mine
            self.planned_from_peers += len(mine)
        return plans

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        try:
            self._sock.close()
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
