"""A server out of the fleet whose handshake is refused (another learner holds it, it serves another env) is
tried again after a while, not at every refresh, and its refusal is warned of once per kind of problem.

Real servers (CartPole; tests.envs' SlowToBuildEnv for one still building its envs); the other learner is
a RemoteVectorEnv of its own process (one of this process would be an error at the start, not a server to
wait for). The server counts the handshakes it refuses in its metrics (``envfleet_errors_total``). The
backoff is shortened here (faults.JOIN_BACKOFF).
"""

from __future__ import annotations

import itertools
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from learner import AddressError, RemoteVectorEnv, faults, membership
from learner.discovery import register_resolver
from learner.fleet import FleetChange
from tests.conftest import ServerProcess, SpawnServer, fleet, slow_to_build_server
from tests.test_faults import hung_server
from tests.test_metrics import scrape

K = 2  # envs per server
REFUSED = "envfleet_errors_total{code=RESOURCE_EXHAUSTED,method=Handshake}"

# Another learner: holds the server until told to let go (a line on stdin), then closes (releasing it).
HOLD_UNTIL_TOLD = """
import sys
from learner import RemoteVectorEnv
envs = RemoteVectorEnv([sys.argv[1]], client_name="other-learner")
envs.reset(seed=0)
print("holding", flush=True)
sys.stdin.readline()
envs.close()
print("released", flush=True)
sys.stdin.readline()
"""


class Holder:
    """The other learner's process, holding one server."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_UNTIL_TOLD, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._said() == "holding"

    def _said(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()
        assert self._said() == "released"  # (its claim is released by now)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


Hold = Callable[[str], Holder]


@pytest.fixture
def hold() -> Iterator[Hold]:
    """``hold(address)``: another learner holds that server (stopped after the test)."""
    holders: list[Holder] = []

    def start(address: str) -> Holder:
        holders.append(Holder(address))
        return holders[-1]

    yield start
    for holder in holders:
        holder.stop()


def metrics_url(server: ServerProcess) -> str:
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", server.logs())
    assert match is not None, server.logs()
    return match.group(1)


def rollouts(envs: RemoteVectorEnv, seconds: float) -> tuple[int, FleetChange | None, float]:
    """As learner train goes on: a few steps, a refresh, and again, for up to ``seconds`` or until the fleet
    changes: (refreshes, the change or None, when it changed: time.monotonic())."""
    refreshes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(4):
            envs.step(envs.action_space.sample())
        change = envs.refresh(wait=0.2)
        refreshes += 1
        if change is not None:
            return refreshes, change, time.monotonic()
        time.sleep(0.02)  # (a rollout's time, shortened)
    return refreshes, None, 0.0


@pytest.mark.slow
def test_a_server_another_learner_holds_is_tried_a_handful_of_times_and_joins_within_the_cap_once_freed(
    spawn_server: SpawnServer, hold: Hold, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: a handshake at every refresh (between rollouts; ~4 a second with CartPole), each refused and
    logged by the server. Now: after 1 s, doubling up to 15 s (shortened here to 0.25 s and 2 s); once
    freed, the server joins at its next try, within the longest wait. The reminder that it has not joined
    says why (the last refusal)."""
    first, cap = 0.25, 2.0
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (first, cap))
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 3.0)
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K, "--metrics-port", "0", "--log-level", "info")
    url = metrics_url(b)
    holder = hold(b.address)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True) as envs:
        started = time.monotonic()
        assert (envs.num_envs, envs.servers_not_joined) == (K, [b.address])
        assert scrape(url)[REFUSED] == 1  # the start's handshake
        envs.reset(seed=0)
        refreshes, change, _ = rollouts(envs, 6.0)
        assert change is None and refreshes > 50
        # Tried again 0.25, 0.75, 1.75, 3.75, 5.75 s after the start (the rollouts began a moment after it).
        tries = scrape(url)[REFUSED] - 1
        assert 3 <= tries <= 6, f"{tries:g} handshakes refused in {refreshes} refreshes"
        assert time.monotonic() - started > first + 2 * first + 4 * first + cap  # (at the cap by now)
        assert re.search(
            rf"env server {re.escape(b.address)} has not joined since the start went on without it \d+ s ago "
            r"\(last tried \d+ s ago: Handshake failed \[RESOURCE_EXHAUSTED\]: this server's envs are claimed by "
            "'other-learner'",
            caplog.text,
        ), caplog.text

        holder.release()
        freed = time.monotonic()
        _, change, joined_at = rollouts(envs, cap + 5.0)
        assert change is not None and change.added == (b.address,), "the server did not join once freed"
        assert joined_at - freed <= cap + 1.5, f"joined {joined_at - freed:.1f} s after it was freed"
        assert envs.num_envs == 2 * K and envs.servers_not_joined == []
        envs.step(envs.action_space.sample())


@pytest.mark.slow
def test_the_starts_warning_is_not_repeated_by_the_refresh_and_a_new_problem_is_warned_once(
    spawn_server: SpawnServer, hold: Hold, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The start warns that it goes on without the server, and why; a refresh refused alike a moment
    later says so at DEBUG (was: the same warning again). A refusal of another kind is warned of once."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.2, 0.4))
    caplog.set_level(logging.DEBUG, logger="learner.remote")
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    hold(b.address)
    refused = f"refresh: env server {b.address} does not join: "

    def lines(prefix: str) -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith(prefix)]

    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True) as envs:
        (start,) = [
            r.getMessage() for r in caplog.records if "starting with the 1 of 2 that answered" in r.getMessage()
        ]
        assert (
            f"{b.address}: Handshake failed [RESOURCE_EXHAUSTED]: this server's envs are claimed by 'other-learner'"
            in start
        )
        envs.reset(seed=0)
        rollouts(envs, 1.5)
        said = lines(refused)
        assert len(said) >= 2 and {level for level, _ in said} == {"DEBUG"}, said  # (tried again: not warned again)
        assert "Handshake failed [RESOURCE_EXHAUSTED]: this server's envs are claimed by 'other-learner'" in said[0][1]
        assert said[0][1].endswith("(tried again in 0.4 s)"), said[0][1]

        # Another problem: the server at that address, started again, serves another env.
        b.kill()
        b.argv[b.argv.index("--env") + 1] = "Acrobot-v1"
        b.start()  # (same port; it says it is listening once its envs are built)
        caplog.clear()
        rollouts(envs, 2.0)
        said = lines(refused)
        assert [level for level, _ in said][:1] == ["WARNING"] and len(said) >= 2, said
        assert {level for level, _ in said[1:]} == {"DEBUG"}, said
        assert "it has another observation_space than the fleet's" in said[0][1]
        assert envs.num_envs == K


# A fleet whose look-up fails while LOOK_UP_FAILS is set (a DNS server that does not answer, say).
_FLAKY: dict[str, list[str]] = {}
LOOK_UP_FAILS: list[bool] = []


def _flaky(name: str) -> list[str]:
    if LOOK_UP_FAILS:
        raise AddressError(f"flaky:{name}: the look-up failed")
    return list(_FLAKY[name])


register_resolver("flaky", _flaky)


@pytest.mark.slow
def test_a_failed_look_up_forgets_no_server_out_of_the_fleet(
    spawn_server: SpawnServer, hold: Hold, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A look-up that fails says nothing of the servers not in the fleet: the held one keeps its backoff
    and what was said of it (was: forgotten, so warned of again at the next refresh)."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.2, 0.4))
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    hold(b.address)
    _FLAKY["two"] = [a.address, b.address]
    refused = f"refresh: env server {b.address} does not join: "
    with RemoteVectorEnv("flaky:two", fault_tolerant=True) as envs, caplog.at_level(logging.WARNING):
        assert envs.servers_not_joined == [b.address]
        envs.reset(seed=0)
        rollouts(envs, 1.0)
        LOOK_UP_FAILS.append(True)
        try:
            rollouts(envs, 0.5)
        finally:
            LOOK_UP_FAILS.clear()
        rollouts(envs, 1.0)
        assert "refresh: flaky:two: the look-up failed; keeping the 1 server(s) connected now" in caplog.text
        assert not [r for r in caplog.records if r.getMessage().startswith(refused)], caplog.text
        assert envs.servers_not_joined == [b.address]


@pytest.mark.slow
def test_look_ups_that_keep_failing_are_warned_of_once_in_a_while_and_their_end_is_said(
    spawn_server: SpawnServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A look-up that fails between rollouts keeps the fleet as it is, and so does every one after it while
    the cause lasts (a file: address's file gone, a compose engine that does not answer): servers added or
    moved meanwhile are not found. Said at once, then once per LOOKUP_FAILED_LOG_S with how long (was: once for
    the whole run, then DEBUG at every refresh), not at each refresh; the first look-up that works again says
    so (INFO)."""
    monkeypatch.setattr(membership, "LOOKUP_FAILED_LOG_S", 1.0)  # (60 s: too long to wait for here)
    a = spawn_server("CartPole-v1", K)
    _FLAKY["three"] = [a.address]
    failed = "refresh: flaky:three: the look-up failed; keeping the 1 server(s) connected now"
    with RemoteVectorEnv("flaky:three", fault_tolerant=True) as envs, caplog.at_level(logging.INFO, "learner"):
        envs.reset(seed=0)
        LOOK_UP_FAILS.append(True)
        try:
            refreshes, _, _ = rollouts(envs, 2.7)
        finally:
            LOOK_UP_FAILS.clear()
        rollouts(envs, 0.3)
    said = [r for r in caplog.records if r.getMessage().startswith(failed)]
    assert refreshes > len(said) and 2 <= len(said) <= 4, [r.getMessage() for r in said]
    assert all(r.levelno == logging.WARNING for r in said)
    assert said[0].getMessage() == failed
    for record in said[1:]:
        assert re.fullmatch(
            re.escape(failed) + r" \(look-ups failing for \d+ s: servers added or moved since are not found; one "
            r"such line every 1 s while they fail\)",
            record.getMessage(),
        ), record.getMessage()
    back = [r for r in caplog.records if r.getMessage().startswith("refresh: flaky:three looked up again, after ")]
    assert len(back) == 1 and back[0].levelno == logging.INFO, caplog.text


# A fleet whose look-ups fail with a text of their own each time (the Docker SDK's errors name a connection
# object: "<urllib3.connection.HTTPConnection object at 0x7f...>"), or every other time (an engine that times out
# now and then), while _ODD_FAILS is set.
_ODD: dict[str, list[str]] = {}
_ODD_FAILS: list[str] = []  # ("each": every look-up fails, its text new; "every other": one in two fails)
_odd_calls = itertools.count()


def _odd(name: str) -> list[str]:
    call = next(_odd_calls)
    if "each" in _ODD_FAILS:
        raise AddressError(f"odd:{name}: the engine did not answer (<connection object at {hex(id(object()) + call)}>)")
    if "every other" in _ODD_FAILS and call % 2:
        raise AddressError(f"odd:{name}: the engine did not answer (read timed out)")
    return list(_ODD[name])


register_resolver("odd", _odd)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["each", "every other"])
def test_look_ups_failing_with_new_texts_or_now_and_then_are_warned_of_once_a_minute_at_most(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A look-up's error whose text changes from try to try (the Docker SDK's name a connection object at its
    memory address) was news at every refresh: a WARNING each, several a second, and each text kept for the
    whole run. A look-up that fails every other time (an engine that times out now and then) was warned of at
    each failure, and its end said at each success, for the whole run. Now: once per LOOKUP_FAILED_LOG_S (60 s:
    once in this test) whatever the text, and the end of failures that were not warned of at DEBUG."""
    a = spawn_server("CartPole-v1", K)
    _ODD["one"] = [a.address]
    with RemoteVectorEnv("odd:one", fault_tolerant=True) as envs, caplog.at_level(logging.INFO, "learner"):
        envs.reset(seed=0)
        _ODD_FAILS.append(how)
        try:
            refreshes, _, _ = rollouts(envs, 2.0)
        finally:
            _ODD_FAILS.clear()
        rollouts(envs, 0.3)
    said = [r for r in caplog.records if r.getMessage().startswith("refresh: odd:one: the engine did not answer")]
    assert refreshes >= 4, refreshes
    assert [r.levelno for r in said] == [logging.WARNING], [r.getMessage() for r in said]
    back = [r for r in caplog.records if r.getMessage().startswith("refresh: odd:one looked up again, after ")]
    assert len(back) <= 1, [r.getMessage() for r in back]


def test_reminders_of_servers_away_grow_rarer_as_they_stay_away(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server the start went on without, and still away an hour later, was said to be so every 20 s: 180
    lines an hour each (64 replicas away, ~11,500). Now as a server lost in the run is said to be still down:
    every STILL_DOWN_LOG_S at first, then once per a third of its time away, up to STILL_DOWN_LOG_MAX_S."""
    clock = [1000.0]
    monkeypatch.setattr(membership, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    fleet_ = membership.FleetMembership.__new__(membership.FleetMembership)  # (its reminders alone)
    away = membership._Away()
    away.missing_since = away.said_at = clock[0]
    fleet_._away, fleet_._connecting, fleet_._joining = {"127.0.0.1:1": away}, {}, {}
    said_at = []
    with caplog.at_level(logging.WARNING, "learner"):
        for _ in range(3600):
            clock[0] += 1.0
            before = len(caplog.records)
            fleet_._remind_missing(set())
            if len(caplog.records) > before:
                said_at.append(clock[0] - 1000.0)
    assert said_at[:3] == [20.0, 40.0, 60.0], said_at  # (as before, in its first minute)
    gaps = [b - a for a, b in itertools.pairwise(said_at)]
    assert all(gap >= faults.STILL_DOWN_LOG_S for gap in gaps) and max(gaps) <= faults.STILL_DOWN_LOG_MAX_S
    assert 10 <= len(said_at) <= 20, said_at  # (was 180)
    assert all("has not joined since the start went on without it" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_server_listed_later_that_keeps_refusing_to_join_is_said_to_once_in_a_while(
    spawn_server: SpawnServer, hold: Hold, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server listed after the start (a replica scaled up, a host added to a file: address) whose handshake
    keeps failing (claimed by another learner, serving another env, refusing the token, hung) was warned of at
    its first refusal, then at DEBUG at each try for as long as it stayed out: the reminder was the start's
    missing servers' alone. Now it is reminded of as they are (STILL_DOWN_LOG_S, rarer as it stays away), with
    the last refusal, until it joins or is listed no more; then the fleet grows without a word more."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.2, 0.4))
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    holder = hold(b.address)
    address, servers = fleet(a.address)
    reminder = rf"env server {re.escape(b.address)}, listed \d+ s ago, has not joined \(last tried \d+ s ago: "

    def reminders() -> list[str]:
        return [r.getMessage() for r in caplog.records if re.match(reminder, r.getMessage())]

    with RemoteVectorEnv(address, fault_tolerant=True) as envs, caplog.at_level(logging.WARNING, "learner"):
        envs.reset(seed=0)
        servers.append(b.address)
        _, change, _ = rollouts(envs, 2.5)
        assert change is None
        refused = [r for r in caplog.records if r.getMessage().startswith(f"refresh: env server {b.address} does")]
        assert len(refused) == 1, [r.getMessage() for r in refused]  # (its first refusal; the rest at DEBUG)
        said = reminders()
        assert 2 <= len(said) <= 5, said
        assert all("Handshake failed [RESOURCE_EXHAUSTED]: this server's envs are claimed by" in m for m in said)
        assert said[0].endswith("; it is tried again until it joins or is listed no more"), said[0]
        holder.release()
        _, change, _ = rollouts(envs, 3.0)
        assert change is not None and change.added == (b.address,)
        count = len(reminders())
        rollouts(envs, 1.0)
        assert len(reminders()) == count  # (joined: no more)


def test_a_server_listed_again_is_tried_at_once(
    spawn_server: SpawnServer, hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backoff is forgotten when the server is no longer listed: listed again, it is new."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (30.0, 30.0))
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    holder = hold(b.address)
    address, servers = fleet(a.address, b.address)
    with RemoteVectorEnv(address, fault_tolerant=True) as envs:
        assert envs.servers_not_joined == [b.address]
        envs.reset(seed=0)
        assert envs.refresh() is None  # (refused at the start: not tried again for 30 s)
        holder.release()
        assert envs.refresh() is None  # (still waiting its turn)
        servers.remove(b.address)
        assert envs.refresh() is None and envs.servers_not_joined == []
        servers.append(b.address)
        change = envs.refresh()
        assert change is not None and change.added == (b.address,) and envs.num_envs == 2 * K


@pytest.mark.slow
def test_a_server_still_building_its_envs_is_tried_again_after_the_first_wait_each_time(
    spawn_server: SpawnServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that answers it is starting (UNAVAILABLE) is soon there: it is tried again after the first
    wait each time, not less and less often (its envs would join up to the longest wait late)."""
    monkeypatch.setattr(faults, "JOIN_BACKOFF", (0.5, 30.0))
    caplog.set_level(logging.DEBUG, logger="learner.remote")
    a = spawn_server("tests.envs:ClockEnv", K)  # (the same spaces as SlowToBuildEnv)
    # (it listens within ~1 s, then builds its envs for 4 s: answering UNAVAILABLE, "starting")
    with (
        slow_to_build_server(4.0, K) as slow,
        RemoteVectorEnv([a.address, slow], fault_tolerant=True, connect_timeout=2.0) as envs,
    ):
        assert envs.servers_not_joined == [slow]
        envs.reset(seed=0)
        _, change, _ = rollouts(envs, 15.0)
        assert change is not None and change.added == (slow,)
    waits = re.findall(rf"env server {re.escape(slow)} does not join: .*\(tried again in (\S+) s\)", caplog.text)
    assert len(waits) >= 2 and set(waits) == {"0.5"}, waits


@pytest.mark.slow
def test_a_listed_server_that_does_not_answer_its_handshake_holds_a_refresh_up_for_its_wait_not_the_timeout(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed server that connects but answers no handshake (its event loop hangs) has refresh()'s ``wait``
    to answer (at least 1 s), as a new server has to connect: not the fleet's whole ``timeout``, at every
    refresh that tries it again."""
    a = spawn_server("CartPole-v1", K)
    hung = hung_server(spawn_server)
    address, servers = fleet(a.address)
    with RemoteVectorEnv(address, timeout=10.0) as envs:
        envs.reset(seed=0)
        servers.append(hung.address)
        started = time.monotonic()
        assert envs.refresh(wait=0.2) is None
        took = time.monotonic() - started
        assert 0.9 < took < 3.0, took
        assert f"refresh: env server {hung.address} does not join: Handshake failed [DEADLINE_EXCEEDED]" in caplog.text
        assert "no answer within the 1 s deadline" in caplog.text


def test_a_listed_server_that_takes_no_connection_is_said_to_once_in_a_while(
    spawn_server: SpawnServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server a look-up lists that takes no connection (nothing listens at its port: a port not published, a
    firewall) stayed out of the fleet with no line saying so (a Swarm test once waited 180 s for a fifth task
    that never joined, unsaid). Now a warning names it and its channel's state, once per STILL_DOWN_LOG_S,
    until it is listed no more."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)
    a = spawn_server("CartPole-v1", K)
    address, servers = fleet(a.address)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "has not taken a connection" in r.getMessage()]

    with socket.socket() as unreachable, RemoteVectorEnv(address) as envs:
        unreachable.bind(("127.0.0.1", 0))  # (bound, never listening: connections to it are refused)
        dead = f"127.0.0.1:{unreachable.getsockname()[1]}"
        envs.reset(seed=0)
        servers.append(dead)
        assert envs.refresh(wait=0.1) is None and said() == []  # (listed a moment ago: not yet)
        time.sleep(0.6)
        assert envs.refresh(wait=0.1) is None and envs.refresh(wait=0.1) is None
        assert len(said()) == 1, said()
        assert re.fullmatch(
            rf"env server {re.escape(dead)}, listed \d+ s ago, has not taken a connection yet \(gRPC channel "
            r"(TRANSIENT_FAILURE|CONNECTING|IDLE)\); its envs join when it answers",
            said()[0],
        ), said()
        time.sleep(0.6)
        assert envs.refresh(wait=0.1) is None
        assert len(said()) == 2, said()
        servers.remove(dead)
        assert envs.refresh(wait=0.1) is None
        time.sleep(0.6)
        assert envs.refresh(wait=0.1) is None
        assert len(said()) == 2, said()
        assert envs.num_envs == K
