"""How a failed Compute request is classified: a token the metadata server could not hand out
yet is an outage (retried, counted as transport), a refused credential is lasting (401)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from google.auth import exceptions as auth_exc

from support import REPO
from slurmagent.gcp.compute import Compute, ComputeError


def refresh_error_from_transport() -> auth_exc.RefreshError:
    """What google-auth's compute_engine credentials raise when the metadata server is away."""
    try:
        try:
            raise auth_exc.TransportError("Failed to retrieve http://metadata/computeMetadata/v1/... "
                                          "from the Google Compute Engine metadata service")
        except auth_exc.TransportError as caught:
            raise auth_exc.RefreshError(caught) from caught
    except auth_exc.RefreshError as exc:
        return exc


def compute(calls: list) -> Compute:
    return Compute("proj", "http://127.0.0.1:9", deadline_s=5.0, retries=3, backoff_s=0.001,
                   sleep=lambda s: calls.append(("sleep", s)))


def test_a_token_the_metadata_server_did_not_hand_out_is_retried_as_an_outage():
    calls: list = []
    outcomes = [refresh_error_from_transport(), refresh_error_from_transport(), "the instance"]

    def fn(**kw):
        calls.append("call")
        out = outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    assert compute(calls)._call("instances.get", fn, end=_far()) == "the instance"
    assert calls.count("call") == 3


def test_a_token_never_handed_out_ends_as_transport_not_permission():
    def fn(**kw):
        raise refresh_error_from_transport()

    with pytest.raises(ComputeError) as info:
        compute([])._call("instances.get", fn, end=_far())
    assert info.value.status is None and info.value.no_answer
    assert "no access token yet" in str(info.value) and "after 4 attempts" in str(info.value)


def test_a_refused_credential_is_a_lasting_401_asked_once():
    calls: list = []

    def fn(**kw):
        calls.append("call")
        raise auth_exc.RefreshError("invalid_grant: account not found", {"error": "invalid_grant"}, retryable=False)

    with pytest.raises(ComputeError) as info:
        compute(calls)._call("instances.get", fn, end=_far())
    assert info.value.status == 401 and not info.value.no_answer
    assert "no usable Google credentials" in str(info.value) and calls == ["call"]


def _far() -> float:
    return time.monotonic() + 30


VM_WITHOUT_A_SERVICE_ACCOUNT = r'''
import http.server, os, sys, threading, time

class NoAccount(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(404)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"service account not found")

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoAccount)
threading.Thread(target=server.serve_forever, daemon=True).start()
os.environ["GCE_METADATA_HOST"] = f"127.0.0.1:{server.server_port}"  # google-auth reads it at import
from google.auth.compute_engine import credentials
from google.auth.transport.requests import Request
from slurmagent.gcp.compute import Compute, ComputeError

def fn(**kw):
    credentials.Credentials().refresh(Request())

try:
    Compute("p", "http://127.0.0.1:9", deadline_s=5, retries=3, backoff_s=0.001)._call("instances.get", fn, time.monotonic() + 30)
except ComputeError as exc:
    print(exc.status, exc)
'''


def test_a_vm_without_a_service_account_is_a_lasting_401_not_an_outage():
    """google-auth's compute_engine credentials wrap the metadata server's 404 in the same
    RefreshError(TransportError) as an outage: its words tell them apart (real library, a local
    metadata server answering 404)."""
    proc = subprocess.run([sys.executable, "-c", VM_WITHOUT_A_SERVICE_ACCOUNT], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, _, message = proc.stdout.strip().partition(" ")
    assert status == "401" and "no usable Google credentials" in message and "Status: 404" in message, proc.stdout
