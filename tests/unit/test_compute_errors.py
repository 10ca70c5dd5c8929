"""How a failed Compute request is classified: a token the metadata server could not hand out
yet is an outage (retried, counted as transport), a refused credential is lasting (401)."""

from __future__ import annotations

import time

import pytest
from google.auth import exceptions as auth_exc

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
