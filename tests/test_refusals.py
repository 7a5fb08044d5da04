"""The two choke points of refusals: the server's ``interceptors.refuse`` (count, rate-limited log line,
status with the server's origin mark) and the learner's ``status_error``, which also words gRPC's own
UNIMPLEMENTED and a step stream found ended."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from env_server.interceptors import RefusalLog, refuse
from env_server.protocol import ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER
from learner.client import EnvClient, status_error
from learner.errors import RemoteEnvError, ServerUnavailableError


class _Context:
    """What ``refuse`` sets on a call."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailer: Any = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailer: Any) -> None:
        self.trailer = trailer


def test_a_refusal_is_counted_every_time_logged_once_per_kind_and_sent_with_the_origin_mark(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = RefusalLog()
    counted: list[str] = []
    logger = logging.getLogger("tests.refusals")
    contexts = [_Context() for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="tests.refusals"):
        for context in contexts:
            refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad request",
                refusals=refusals,
                kind="Step",
                line=("refused %s from %s", "Step", "peer"),
                count=lambda: counted.append("Step"),
                level=logging.INFO,
                logger=logger,
            )
    assert counted == ["Step", "Step"] and refusals.refused == 2
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "refused Step from peer (1 refused calls so far)")
    ]
    for context in contexts:
        assert (context.code, context.details) == (grpc.StatusCode.INVALID_ARGUMENT, "bad request")
        assert context.trailer == ((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER),)


def test_a_refusal_without_a_call_or_a_line_is_only_counted(caplog: pytest.LogCaptureFixture) -> None:
    """No context: the call ends elsewhere (gRPC's call limit, a StepError frame); no line: already logged."""
    refusals = RefusalLog()
    with caplog.at_level(logging.DEBUG):
        refuse(None, grpc.StatusCode.INTERNAL, "crashed", refusals=refusals, kind="Step", line=None)
    assert refusals.refused == 1 and not caplog.records


@pytest.mark.parametrize("code", [grpc.StatusCode.OK, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED])
def test_a_step_stream_found_ended_is_a_lost_server_whatever_its_status(code: grpc.StatusCode) -> None:
    for details, said in (("gone", "gone"), ("", "no details")):
        err = status_error(code, details, address="h:1", method="Step", stream_ended=True)
        assert type(err) is ServerUnavailableError and (err.address, err.code, err.env_index) == ("h:1", code, None)
        if code == grpc.StatusCode.OK:  # (no error: a server that ended the stream before answering)
            assert str(err) == (
                "env server h:1: Step failed [OK]: the server ended its StepStream (status OK) without answering "
                "this step; a server must answer every StepRequest on the stream, in order"
                + (f" ({said})" if details else "")
            )
        else:
            assert str(err) == f"env server h:1: Step failed [{code.name}]: the step stream ended ({said})"


class _Ended:
    """A stream call that ended, as ``EnvClient._ended`` reads it."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str | None:
        return self._details


def test_the_client_words_a_stream_that_ended_through_status_error() -> None:
    client = EnvClient.__new__(EnvClient)
    client.address = "h:1"
    err = asyncio.run(client._ended(_Ended(grpc.StatusCode.UNAVAILABLE, None)))
    assert type(err) is ServerUnavailableError
    assert str(err) == "env server h:1: Step failed [UNAVAILABLE]: the step stream ended (no details)"


@pytest.mark.parametrize(
    ("method", "meaning"),
    [
        ("Handshake", "it answers gRPC but serves no envfleet.v1.EnvService: the wrong port"),
        ("GetSpec", "it answers gRPC but not GetSpec: the wrong port, a server of another envfleet protocol"),
        ("Step", "it serves no StepStream, which this learner steps on: an envfleet.v1 server must serve it"),
    ],
)
def test_grpcs_own_unimplemented_says_what_it_means_of_the_server(method: str, meaning: str) -> None:
    for details, said in (("Method not found!", "Method not found!"), ("", "no details")):
        err = status_error(grpc.StatusCode.UNIMPLEMENTED, details, address="h:1", method=method)
        assert type(err) is RemoteEnvError and err.code == grpc.StatusCode.UNIMPLEMENTED
        assert str(err).startswith(f"env server h:1: {method} failed [UNIMPLEMENTED]: {meaning}"), str(err)
        assert str(err).endswith(f" ({said})")
    other = status_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!", address="h:1", method="Reset")
    assert str(other) == "env server h:1: Reset failed [UNIMPLEMENTED]: Method not found!"
