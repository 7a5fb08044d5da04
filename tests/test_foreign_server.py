"""The learner against envfleet.v1 servers that misbehave as servers written from the proto alone have
(tests/faulty_server.py: a real grpc.aio server on port 0): what it reports, and that it goes on where it can."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import learner.client
from env_server.protocol import NOT_OWNED
from env_server.rpc import env_pb2 as pb
from learner import RemoteVectorEnv, faults
from learner.cli import main
from learner.client import SERVER_TEXT_LIMIT, server_text
from learner.errors import EnvCrashedError, InvalidResponseError, RemoteEnvError, ServerUnavailableError
from learner.survey import survey
from tests.balancer import CallBalancer
from tests.conftest import StartServers
from tests.faulty_server import Faults, FaultyServer

ACTIONS = np.zeros(2, dtype=np.int64)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's own warnings once per server (ports are reused)."""
    monkeypatch.setattr(learner.client, "_HOLD_WARNED", set())
    monkeypatch.setattr(learner.client, "_NO_SERVER_ID_WARNED", set())
    monkeypatch.setattr(learner.client, "_PROXY_END_WARNED", set())
    monkeypatch.setattr(learner.client, "_OTHER_SERVER_WARNED", set())
    yield


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "learner.client" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("code", [grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN])
def test_a_step_stream_the_server_ended_after_answering_is_reported_with_its_status(code: grpc.StatusCode) -> None:
    """The server answers one step, then ends the stream. The learner's next write finds it ended, either
    as grpc.aio takes the status in first or as gRPC core fails the write ("Internal error from Core",
    reported as a broken connection before): each round may take either way; both say the server's status."""
    server = FaultyServer(Faults(steps_per_stream=1, stream_status=(code, "")))
    with server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        for _ in range(6):
            envs.reset(seed=0)
            envs.step(ACTIONS)
            time.sleep(0.05)  # (the server's status reaches gRPC core meanwhile; the loop is not running)
            with pytest.raises(ServerUnavailableError) as info:
                envs.step(ACTIONS)
            if code == grpc.StatusCode.OK:
                assert str(info.value) == (
                    f"env server {server.address}: Step failed [OK]: the server ended its StepStream (status OK) "
                    "without answering this step; a server must answer every StepRequest on the stream, in order"
                )
            else:
                assert str(info.value) == (
                    f"env server {server.address}: Step failed [UNKNOWN]: the step stream ended (no details)"
                )
            assert info.value.code == code


def test_a_status_without_details_says_so_not_the_call() -> None:
    server = FaultyServer(Faults(steps_per_stream=0, stream_status=(grpc.StatusCode.UNKNOWN, "")))
    with server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        envs.reset(seed=0)
        with pytest.raises(RemoteEnvError) as info:
            envs.step(ACTIONS)
    assert str(info.value) == f"env server {server.address}: Step failed [UNKNOWN]: no details"


@pytest.mark.parametrize(
    ("faults", "did"),
    [
        (Faults(hold="unimplemented"), "answered UNIMPLEMENTED (it serves no Hold)"),
        (Faults(hold="ok"), "ended (status OK) without a HoldEvent"),
        (
            Faults(hold="error", hold_status=(grpc.StatusCode.INTERNAL, "boom\x1b[2J")),
            r"ended with [INTERNAL] (boom\x1b[2J)",
        ),
        (
            Faults(hold="error", hold_status=(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")),
            "was refused [RESOURCE_EXHAUSTED] (Concurrent RPC limit exceeded!): the server was serving as many calls "
            "as it takes at once (an env-server's --max-concurrent-rpcs): without Hold",
        ),
    ],
)
def test_a_hold_stream_that_does_not_hold_is_warned_of_once_and_the_session_kept(
    faults: Faults, did: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the learner took the session for ended and made a new one at every reset, silently."""
    faults.marked = True  # (an INTERNAL without envfleet's mark is gRPC's own: a lost connection)
    with caplog.at_level(logging.INFO), FaultyServer(faults) as server:
        with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
            for seed in range(3):
                envs.reset(seed=seed)
                envs.step(ACTIONS)
            envs.reset(options={"reset_mask": np.array([True, False])})  # (refused for a session taken as ended)
        assert server.service.handshakes == 1
    said = warnings(caplog)
    assert len(said) == 1, said
    assert said[0].startswith(f"env server {server.address}: its Hold stream {did}"), said[0]
    assert "its claim timeout (HandshakeResponse.claim_timeout_s: 30 s)" in said[0]
    assert "a new one for this reset" not in caplog.text


def test_a_session_a_server_without_hold_dropped_is_renewed_by_reset() -> None:
    """The session kept for a server without Hold: once the server says it does not own it (its claim
    timed out, say), the next reset makes a new one."""
    with FaultyServer(Faults(hold="unimplemented")) as server:
        with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
            envs.reset(seed=0)
            server.service.drop_sessions()
            with pytest.raises(RemoteEnvError, match=r"does not own this server.*reset\(\) does so"):
                envs.step(ACTIONS)
            envs.reset(seed=0)
            envs.step(ACTIONS)
        assert server.service.handshakes == 2


def test_a_handshake_answer_without_a_session_id_is_refused_at_once() -> None:
    with FaultyServer(Faults(session_id="")) as server, pytest.raises(InvalidResponseError) as info:
        RemoteVectorEnv([server.address], connect_timeout=5)
    assert str(info.value) == (
        f"env server {server.address}: Handshake's answer has an empty session_id; expected the id of the session "
        "it opened, which every later call carries: the server does not follow envfleet.v1"
    )


def test_a_server_without_a_server_id_is_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), FaultyServer(Faults(server_id="")) as server:
        for _ in range(2):
            with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
                envs.reset(seed=0)
                envs.step(ACTIONS)
    assert warnings(caplog) == [
        f"env server {server.address} answers no server_id (its spec's is empty): a restart of it cannot be told "
        "from the same process, so after a lost connection the learner takes it for the same one"
    ]


def test_a_server_without_a_server_id_is_not_probed_for_calls_reaching_other_servers() -> None:
    """The probes after a Handshake (are the address's calls spread over several servers?) compare server ids: a
    server that sends none is not probed, at its first session or a later one (the warning said once only). The
    probes went out at every session after the first: 8 GetSpecs whose answers could tell nothing."""
    with FaultyServer(Faults(server_id="")) as server:
        for _ in range(3):
            with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
                envs.reset(seed=0)
                envs.step(ACTIONS)
        assert (server.service.handshakes, server.service.spec_calls) == (3, 0)


def test_servers_without_a_server_id_are_not_taken_for_one_another(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Servers that send no server_id cannot be told apart: one another learner holds at a fault-tolerant
    start is no second name of the fleet's (as a server refused under the id of one in the fleet is), but
    a server that joins once that learner lets go."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.05, 0.1))
    with (
        FaultyServer(Faults(server_id="")) as a,
        FaultyServer(Faults(server_id="", claimed=True)) as b,
        RemoteVectorEnv([a.address, b.address], fault_tolerant=True, connect_timeout=5) as envs,
    ):
        assert (envs.addresses, envs.servers_not_joined) == ([a.address], [b.address])
        envs.reset(seed=0)
        b.faults.claimed = False  # (the other learner let go)
        time.sleep(0.1)
        change = envs.refresh()
        # (a try refused just before it let go, a Handshake in flight under load, waits out its backoff first:
        # refreshes, between rollouts, try again; a CI run once found it not due at the first)
        deadline = time.monotonic() + 5.0
        while change is None and time.monotonic() < deadline:
            time.sleep(0.05)
            change = envs.refresh()
        assert change is not None and change.added == (b.address,) and envs.num_envs == 4
    assert "are the same env server" not in caplog.text


def test_server_text_is_escaped_and_capped() -> None:
    assert server_text("plain text: kept as it is") == "plain text: kept as it is"
    assert server_text("a\x00b\x1b[31mc\nd\u202ee\x9b") == "a\\x00b\\x1b[31mc\\nd\\u202ee\\x9b"
    long = "x" * 5_000
    assert server_text(long) == "x" * SERVER_TEXT_LIMIT + "... (4,000 more characters)"
    shown = server_text("\x00" * 5_000)
    assert shown.startswith("\\x00" * 250) and shown.endswith("... (4,750 more characters)")


def test_a_servers_text_reaches_the_error_cleaned_and_its_raw_text_is_kept() -> None:
    """An INTERNAL with NUL bytes, ANSI escapes and 5,000 characters was printed in full."""
    nasty = "env broke\x00\x1b[2J\x1b[31m" + "y" * 5_000 + " does not own this server"
    faults = Faults(steps_per_stream=0, stream_status=(grpc.StatusCode.INTERNAL, nasty), marked=True)
    with FaultyServer(faults) as server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashedError) as info:
            envs.step(ACTIONS)
    message = str(info.value)
    assert "\x00" not in message and "\x1b" not in message and len(message) < SERVER_TEXT_LIMIT + 200
    assert "env broke\\x00\\x1b[2J\\x1b[31myyy" in message and message.endswith(" more characters)")
    assert info.value.details == nasty  # (what code that compares stable texts reads)


@pytest.mark.parametrize("fault_tolerant", [False, True])
def test_an_answer_sent_twice_is_refused_by_its_step_id_not_taken_for_the_next(fault_tolerant: bool) -> None:
    """The server answers the third request on its stream twice: the answer read for the fourth is the
    third's again (every later step would be one off, unseen, without step_id). The learner refuses it,
    naming both ids; then steps go on in order (a new stream), lost and back where fault-tolerant."""
    server = FaultyServer(Faults(twice_at=3))
    with server, RemoteVectorEnv([server.address], connect_timeout=5, fault_tolerant=fault_tolerant) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(ACTIONS)
        client = envs._clients[0]
        if fault_tolerant:
            *_, infos = envs.step(ACTIONS)
            assert infos["env_unavailable"].all() and envs.fault_stats().failures == 1
            for _ in range(5):  # (back at once; then each answer is its own request's)
                *_, infos = envs.step(ACTIONS)
            assert not infos.get("env_unavailable", np.zeros(2)).any() and envs.fault_stats().failures == 1
            return
        else:
            with pytest.raises(InvalidResponseError) as info:
                envs.step(ACTIONS)
            assert (
                f"env server {server.address}: Step: its answer is not to the request sent (step_id: expected "
                f"{client.step_id}, the request's, got {client.step_id - 1}: the server answered an earlier request "
                "again (every later answer would be one step off))"
            ) == str(info.value)
            assert info.value.out_of_step
        envs.reset(seed=0)
        for _ in range(5):  # (in order again: each answer is its own request's)
            *_, infos = envs.step(ACTIONS)
            assert not infos.get("env_unavailable", np.zeros(2)).any()


def test_a_server_that_returns_no_step_id_is_stepped_unchecked() -> None:
    """A server older than step_id (or one that leaves it out) answers 0: nothing to check, no error."""
    server = FaultyServer(Faults(echo_step_id=False))
    with server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(ACTIONS)


def test_learner_servers_shows_what_a_server_says_through_server_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A server's env_id and claimed_by reach the terminal escaped: no server repaints it."""
    server = FaultyServer(Faults(env_id="Cart\x1b[2JPole", claimed_by="me\x1b]0;owned\x07"))
    with server:
        assert main(["servers", "--servers", server.address]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and f"{server.address}  Cart\\x1b[2JPole x2 (sync" in text, text
    assert "    claimed by me\\x1b]0;owned\\x07" in text, text


def test_a_server_that_sends_answers_twice_again_and_again_is_broken_not_flapping() -> None:
    """Every second answer of a stream sent twice: right after each reconnect an answer reads well, yet
    the second answer to another request than the one sent makes the server broken (not reconnected)."""
    server = FaultyServer(Faults(twice_every=2))
    with server, RemoteVectorEnv([server.address], connect_timeout=5, fault_tolerant=True) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidResponseError, match=r"step_id: .* The server is broken, not out") as info:
            for _ in range(200):
                envs.step(ACTIONS)
                time.sleep(0.01)
        assert info.value.out_of_step and envs.fault_stats().failures == 2


def _steps_until_raised(envs: RemoteVectorEnv, steps: int = 200) -> None:
    for _ in range(steps):
        envs.step(ACTIONS)
        time.sleep(0.01)


def test_a_reset_tries_a_broken_server_again(caplog: pytest.LogCaptureFixture) -> None:
    """A library user catching the error and resetting: the server still broken raises again at its first
    answer to another request; mended (the same address), it rejoins and the fleet steps on."""
    server = FaultyServer(Faults(twice_every=2))
    caplog.set_level(logging.INFO, logger="learner.remote")
    with server, RemoteVectorEnv([server.address], connect_timeout=5, fault_tolerant=True) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidResponseError, match="The server is broken, not out"):
            _steps_until_raised(envs)
        _, infos = envs.reset(seed=1)  # (its envs unavailable: it is being reconnected)
        assert infos["_env_unavailable"].all(), infos
        assert f"env server {server.address}, found broken, is tried again (a reset): reconnecting" in caplog.messages
        with pytest.raises(InvalidResponseError, match="The server is broken, not out") as info:
            _steps_until_raised(envs)
        assert info.value.out_of_step
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (3, 2, 1), stats
        server.faults.twice_every = None  # (mended)
        envs.reset(seed=2)
        rejoined = False
        for _ in range(200):
            *_, infos = envs.step(ACTIONS)
            rejoined = rejoined or "env_rejoined" in infos
            if rejoined and "env_unavailable" not in infos:
                break
            time.sleep(0.01)
        assert rejoined and "env_unavailable" not in infos, infos
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.servers_down) == (3, 3, 0), stats


@pytest.mark.slow
@pytest.mark.parametrize("idle_pings", [learner.client.MAX_IDLE_PINGS, 0])
def test_a_paused_learner_keeps_its_session_on_a_server_at_grpcs_default_ping_policy(
    monkeypatch: pytest.MonkeyPatch, idle_pings: int
) -> None:
    """gRPC's default ping policy (this grpc.aio server's: C-core's, as C++ servers have) closes a connection
    that pings more often than once per 5 minutes while the server sends nothing, 2 pings forgiven
    (GOAWAY too_many_pings). The learner pinged every 10 s whatever the data: paused ~30 s, it lost its
    connection and its session. It now pings at most MAX_IDLE_PINGS times while it sends nothing. (Here
    every second, so that the pause is short; without the limit, the error says what happened.)"""
    options = learner.client.channel_options

    def every_second(keepalive_timeout: float = learner.client.KEEPALIVE_TIMEOUT) -> list[tuple[str, Any]]:
        changed = {"grpc.keepalive_time_ms": 1000, "grpc.http2.max_pings_without_data": idle_pings}
        return [(key, changed.get(key, value)) for key, value in options(keepalive_timeout)]

    monkeypatch.setattr(learner.client, "channel_options", every_second)
    with FaultyServer() as server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        envs.reset(seed=0)
        envs.step(ACTIONS)
        time.sleep(6)  # (pings at 1, 2, 3 and 4 s: a GOAWAY by the 4th)
        if idle_pings:
            for _ in range(3):
                envs.step(ACTIONS)
            assert server.service.handshakes == 1
        else:
            with pytest.raises(ServerUnavailableError) as info:
                envs.step(ACTIONS)
            assert "(Too many pings): the server closed the connection for the learner's keepalive pings" in str(
                info.value
            ), info.value


# ---------------------------------------------------------------------------------------------
# An HTTP proxy in front of the server (nginx's grpc_pass, haproxy): measured with nginx 1.22 and haproxy
# 2.6 in a review; here its statuses as gRPC reports them.


def test_a_hold_stream_a_proxy_ended_is_said_to_be_the_proxys_doing(caplog: pytest.LogCaptureFixture) -> None:
    """nginx ends a stream that brings no answer within grpc_read_timeout (60 s): the Hold stream, and with
    it the session, every minute. The learner said nothing until its next call failed "does not own this
    server"; now it says at once what ended it and what the proxy needs, once per server."""
    faults = Faults(hold="error", hold_status=(grpc.StatusCode.UNAVAILABLE, "Received http2 header with status: 504"))
    server = FaultyServer(faults)
    with caplog.at_level(logging.INFO), server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        for seed in range(3):  # (each reset after the end: a new session, whose Hold ends too)
            envs.reset(seed=seed)
            time.sleep(0.1)
    said = warnings(caplog)
    assert len(said) == 1, said
    assert re.match(
        re.escape(f"env server {server.address}: its Hold stream, which keeps this learner's session, ended ")
        + r"\d+"
        + re.escape(
            " s after it opened: an HTTP proxy between the learner and the env server answered HTTP 504: it gave up "
            "waiting on the env server (its timeout on a call's answer: nginx: client_max_body_size 0 and "
            "grpc_read_timeout 1d; haproxy: timeout server 1d; see the README's 'Behind an HTTP proxy'). The session "
            "is over (the server freed its envs), and the next call says so: a proxy in front of env servers must "
            "leave long-lived streams open"
        ),
        said[0],
    ), said[0]


def test_a_hold_stream_ended_by_a_502_names_the_server_gone_not_the_proxy_s_settings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A session's Handshake went through the proxy, so a 502 on its Hold is the server behind it gone: the
    proxy's setup hints (grpc_pass, proto h2) were given all the same (Caddy, a server killed mid-run)."""
    faults = Faults(hold="error", hold_status=(grpc.StatusCode.UNAVAILABLE, "Received http2 header with status: 502"))
    server = FaultyServer(faults)
    with caplog.at_level(logging.INFO), server, RemoteVectorEnv([server.address], connect_timeout=5) as envs:
        envs.reset(seed=0)
        time.sleep(0.1)
        envs.reset(seed=1)
    [said] = warnings(caplog)
    assert said.endswith(
        "s after it opened: an HTTP proxy between the learner and the env server answered HTTP 502: nothing behind "
        "it answers any more (the env server behind it stopped, restarted or moved). The session is over (the "
        "server freed its envs), and the next call says so"
    ), said


@pytest.mark.parametrize(
    ("code", "details", "said"),
    [
        (
            grpc.StatusCode.UNAVAILABLE,
            "Received http2 header with status: 502",
            "Received http2 header with status: 502: an HTTP proxy between the learner and the env server answered "
            "HTTP 502: nothing behind it answers (the env server is down or not started, or the proxy's upstream is "
            "not it, or the proxy speaks HTTP/1 to it: nginx needs grpc_pass, not proxy_pass; haproxy, proto h2 on "
            "the server line; Caddy, reverse_proxy h2c://HOST:PORT)",
        ),
        (
            grpc.StatusCode.INTERNAL,
            "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))",
            "the connection broke (Stream removed (RST_STREAM (Received RST_STREAM with error code 2))); where an HTTP "
            "proxy stands between the learner and the server, the server behind it may have gone (Caddy ends the "
            "stream so when its server dies), or the proxy reset it: StepStream's requests count as one long request "
            "body, and Hold's answer never ends (nginx: client_max_body_size 0",
        ),
    ],
)
def test_a_proxys_status_says_what_it_means(code: grpc.StatusCode, details: str, said: str) -> None:
    """A proxy with no env server behind it answered 502, which the learner, still connecting, took for a
    server building its envs ("raise connect_timeout"); nginx's limit on a request body (1 MB by default:
    StepStream's requests all count) reset the stream after ~12,000 CartPole steps, said as a broken
    connection."""
    text = str(learner.client.status_error(code, details, address="proxy:443", method="Step", from_server=False))
    assert text.startswith(f"env server proxy:443: Step failed [{code.name}]: {said}"), text


def test_a_hold_stream_cut_short_by_a_proxy_ends_the_session_unwarned(caplog: pytest.LogCaptureFixture) -> None:
    """nginx in front of a server that was killed ends the Hold stream's answer without its status: gRPC's UNKNOWN
    "Stream removed (Data frame with END_STREAM flag received)". It was warned of as a server that does not hold
    sessions ("The session is kept meanwhile"), the server dead; an UNKNOWN of other words still is."""

    class Hold:
        def __init__(self, details: str) -> None:
            self.details = details

        async def read(self) -> object:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), self.details)

        def cancel(self) -> bool:
            return False

    async def hold_ended(address: str, details: str) -> bool:
        client = learner.client.EnvClient(address, timeout=5)
        try:
            client._hold = hold = Hold(details)
            await client._watch_hold(hold)
            return client._hold_ended
        finally:
            await client.close()

    for details, ends in (
        ("Stream removed (Data frame with END_STREAM flag received)", True),
        ("Exception iterating responses: boom", False),
    ):
        with caplog.at_level(logging.WARNING, logger="learner.client"):
            caplog.clear()
            assert asyncio.run(hold_ended(f"proxy-{ends}:443", details)) is ends
        assert bool(caplog.records) is not ends, caplog.text


def test_an_address_whose_calls_reach_several_servers_is_said_to(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nginx with an upstream of two servers behind one address: the Handshake reached one, the Hold stream
    the other, which refused it ("does not own this server"), and the first step failed the same way with
    nothing to say why. Here one server refuses Hold so, as the other server would. Said once per address:
    the next session's Hold stream, refused alike, is said at DEBUG."""
    # (said only for a Hold stream sent within OTHER_SERVER_S of the Handshake: a loaded machine may be slow)
    monkeypatch.setattr(learner.client, "OTHER_SERVER_S", 60.0)
    server = FaultyServer(Faults(hold="error", hold_status=REFUSED_AS_ANOTHERS, marked=True))
    with caplog.at_level(logging.DEBUG, logger="learner.client"), server:
        with RemoteVectorEnv([server.address], connect_timeout=5) as envs:
            envs.reset(seed=0)
            _steps_until_said(envs, caplog, 1)
            envs.reset(seed=1)  # (a new session: the Hold stream's refusal ended the first)
            _steps_until_said(envs, caplog, 2)
        assert server.service.handshakes == 2
    assert [r.levelno for r in _other_server_said(caplog)] == [logging.WARNING, logging.DEBUG]
    said = warnings(caplog)
    assert len(said) == 1, said
    assert said[0].startswith(
        f"env server {server.address}: the Hold stream of the session its Handshake had just granted was refused, "
        f"that session not the server's: calls to {server.address} seem to reach more than one env server"
    ), said[0]


@pytest.mark.slow
@pytest.mark.parametrize("then", ["step", "close"])
def test_a_hold_refusal_read_long_after_the_handshake_is_said_all_the_same(
    then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal comes a round trip after the Handshake, but is read only during the learner's calls
    (this thread's event loop runs only then: learner.loop), over a few of them. It was judged by when it
    was read: a learner that paused longer than OTHER_SERVER_S before its first call (a model built between
    making the fleet and its first reset; a loaded machine) never heard of it; nor one that closed before
    it was read (read during the Release, it was taken for the Release's; once the Release was answered,
    cancelling the Hold stream dropped it)."""
    server = FaultyServer(Faults(hold="error", hold_status=REFUSED_AS_ANOTHERS, marked=True))
    with (
        caplog.at_level(logging.DEBUG, logger="learner.client"),
        server,
        RemoteVectorEnv([server.address], connect_timeout=5) as envs,
    ):
        time.sleep(learner.client.OTHER_SERVER_S + 0.5)  # (the pause before the first call: no wait for anything)
        if then == "step":
            envs.reset(seed=0)
            _steps_until_said(envs, caplog, 1)
    said = warnings(caplog)
    assert len(said) == 1, said
    assert f"calls to {server.address} seem to reach more than one env server" in said[0], said[0]


REFUSED_AS_ANOTHERS = (grpc.StatusCode.FAILED_PRECONDITION, f"session 'abc' {NOT_OWNED} (it was released, ...)")
"""How an env server refuses the Hold stream of another server's session."""


def _other_server_said(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "seem to reach more than one env server" in r.getMessage()]


def _steps_until_said(envs: RemoteVectorEnv, caplog: pytest.LogCaptureFixture, count: int) -> None:
    """Step until the Hold stream's refusal was said ``count`` times in all: read while calls run the
    event loop, in a few turns of it that each wait on gRPC's own thread, it may take some steps."""
    deadline = time.monotonic() + 30  # (generous: a loaded machine)
    while len(_other_server_said(caplog)) < count and time.monotonic() < deadline:
        envs.step(ACTIONS)


@pytest.mark.slow
def test_a_broken_server_mended_after_give_up_after_is_taken_back_by_a_reset() -> None:
    """From the diff's review: a fleet whose only server was broken raised "no env server left" at every
    reset once give_up_after had passed since the loss, mended server or not."""
    server = FaultyServer(Faults(twice_every=2))
    with server, RemoteVectorEnv([server.address], connect_timeout=5, fault_tolerant=True, give_up_after=1.0) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidResponseError, match="The server is broken, not out"):
            _steps_until_raised(envs)
        server.faults.twice_every = None
        time.sleep(1.5)
        envs.reset(seed=1)
        for _ in range(200):
            *_, infos = envs.step(ACTIONS)
            if "env_unavailable" not in infos:
                break
            time.sleep(0.01)
        assert "env_unavailable" not in infos and envs.fault_stats().servers_down == 0


def test_a_learner_refuses_an_address_whose_calls_reach_several_servers(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Behind Caddy (reverse_proxy to two servers) one address spreads calls over both: `learner train` trained on,
    each call to either server, with false "restarted" lines, and left a claim on one until its claim timeout.
    Refused at the start, with the servers' ids, and neither server left claimed: each is usable at once."""
    backends = start_servers("CartPole-v1", 2, 2, transport="tcp")
    with CallBalancer(backends) as balancer:
        with pytest.raises(RemoteEnvError) as caught:
            RemoteVectorEnv([balancer.address], connect_timeout=5)
        run = tmp_path / "run"
        argv = ["train", "--servers", balancer.address, "--total-timesteps", "64", "--run-dir", str(run)]
        assert main(argv) == 1
        err = " ".join(capsys.readouterr().err.split())
    said = (
        f"env server {balancer.address}: its calls reached 2 different env servers (server ids {{}}): a proxy or load "
        "balancer spreading calls over them? A learner's session is one server's: give each server its own address "
        "(or balance connections, not calls)"
    )
    assert re.fullmatch(re.escape(said).replace(r"\{\}", "[0-9a-f]+, [0-9a-f]+"), str(caught.value)), caught.value
    assert str(caught.value) in err, err
    for address in backends:
        [info] = survey(address, timeout=5)
        assert info.claimed_by == "", (address, info.claimed_by)
    with RemoteVectorEnv(backends, connect_timeout=5) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(envs.num_envs, dtype=np.int64))


def test_a_proxy_in_front_of_one_server_is_no_spread_address(start_servers: StartServers) -> None:
    """The check for an address spreading calls lets a proxy of one server be: its calls reach one server. Its
    GetSpecs go one after another: sent at once, a server of --max-concurrent-rpcs 4 refused some on a loaded
    machine (RESOURCE_EXHAUSTED in its envfleet_errors_total, 2 in 3 sessions: an alert's false alarm). Each asks
    for the server's id alone: a full spec carries the Box bounds, twice an observation (8 of a 1080x1920
    camera's took ~0.25 s a server on one host, at every session's start)."""
    [backend] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    with CallBalancer([backend]) as balancer:
        with RemoteVectorEnv([balancer.address], connect_timeout=5) as envs:
            envs.reset(seed=0)
            for _ in range(5):
                envs.step(np.zeros(envs.num_envs, dtype=np.int64))
        assert balancer.most_at_once["GetSpec"] == 1, balancer.most_at_once
    probes = [pb.GetSpecResponse.FromString(answer).spec for answer in balancer.answers["GetSpec"]]
    assert len(probes) == learner.client.SPREAD_PROBES
    (handshake,) = (pb.HandshakeResponse.FromString(answer).spec for answer in balancer.answers["Handshake"])
    assert handshake.HasField("observation_space") and handshake.server_id
    assert all(probe == pb.EnvSpec(server_id=handshake.server_id) for probe in probes), probes
