"""Hosts of our own for tests and benchmarks: Linux network namespaces wired to one switch.

A ``Lab`` is a switch (a bridge in a namespace of its own) and hosts (namespaces), each joined to
the switch by a veth pair with an address of 198.18.0.0/24 (RFC 2544's range for benchmarking
networks) on its end. Nothing is added to the namespace this process runs in, so no packet of a lab
can leave it: every address a lab uses exists only inside it. Processes run in a host through
``ip netns exec``; ``cut``/``restore`` take a host's link down and up, as pulling and replugging its
cable. Needs root and iproute2 (``ip``).

    with Lab(["learner", "h0", "h1"]) as lab:
        server = lab.start_server("h0", "CartPole-v1", 4)     # listens on 198.18.0.11:50051
        lab.run("learner", [sys.executable, "-m", "learner", "train", "--servers", server.address])
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBNET = "198.18.0"
PORT = 50051
_NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts


def netns_problem() -> str | None:
    """Why labs cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    name = f"efprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _remove_stale_labs() -> None:
    """Namespaces of labs whose process died without cleaning up (names carry the creator's pid)."""
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith("eflab") or "-" not in name:
            continue
        pid = name[len("eflab") :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)


class Server:
    """An env server started in a lab host."""

    def __init__(self, proc: subprocess.Popen[str], address: str) -> None:
        self.proc = proc
        self.address = address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Lab:
    """A switch and ``hosts`` (names), each host at 198.18.0.(10 + its index) on the switch."""

    def __init__(self, hosts: Sequence[str]) -> None:
        _remove_stale_labs()
        self.prefix = f"eflab{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.hosts = list(hosts)
        self.addresses = {host: f"{SUBNET}.{10 + i}" for i, host in enumerate(self.hosts)}
        self._made: list[str] = []
        self._servers: list[Server] = []
        try:
            switch = self.netns("switch")
            self._add(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.netns(host)
                self._add(ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", switch)
                _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def netns(self, host: str) -> str:
        """The namespace name of a host (or of the switch)."""
        return f"{self.prefix}-{host}"

    def _port(self, host: str) -> str:
        return f"p{self.hosts.index(host)}"

    # -- running things in hosts ------------------------------------------------------------------

    def command(self, host: str, args: Sequence[str]) -> list[str]:
        """``args`` run in ``host``'s namespace (``ip netns exec`` becomes the command: same pid)."""
        return ["ip", "netns", "exec", self.netns(host), *args]

    def popen(self, host: str, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(host, args), text=True, **kwargs)

    def run(
        self, host: str, args: Sequence[str], timeout: float = 600, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(host, args), text=True, capture_output=True, timeout=timeout, **kwargs)

    def start_servers(
        self,
        hosts: Sequence[str],
        env: str,
        num_envs: int,
        *,
        loopback: bool = False,
        server_args: Sequence[str] = (),
        timeout: float = 60,
    ) -> list[Server]:
        """An env server in each of ``hosts``, on the host's address (port 50051) or, with ``loopback``,
        on 127.0.0.1 (a free port each); returns once all listen. They stop with the lab, or when this
        process dies (each watches its parent)."""
        started = []
        for host in hosts:
            bind = (
                ["--host", "127.0.0.1", "--port", "0"]
                if loopback
                else ["--host", self.addresses[host], "--port", str(PORT)]
            )
            args = [sys.executable, "-m", "env_server", "--env", env, "--num-envs", str(num_envs), *bind]
            args += ["--parent-pid", str(os.getpid()), "--log-level", "warning", *server_args]
            proc = self.popen(host, args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            started.append(proc)
        servers = []
        deadline = time.monotonic() + timeout
        for proc in started:
            assert proc.stdout is not None
            line = _read_line(proc, deadline)
            if not line.startswith("listening on "):
                for p in started:
                    p.kill()
                raise RuntimeError(
                    f"env server printed {line!r} instead of 'listening on ADDRESS': {proc.stderr.read() if proc.stderr else ''}"
                )
            servers.append(Server(proc, line[len("listening on ") :].strip()))
        self._servers += servers
        return servers

    # -- the network ------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the switch: its packets go nowhere, its connections hang."""
        _ip("-n", self.netns("switch"), "link", "set", self._port(host), "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.netns("switch"), "link", "set", self._port(host), "up")

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(bytes sent by, bytes received by) ``host`` over its link so far, as the switch counted them."""
        stats = json.loads(_ip("-n", self.netns("switch"), "-s", "-j", "link", "show", self._port(host)))[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def set_hosts_file(self, host: str, entries: Sequence[tuple[str, str]]) -> None:
        """What ``host`` resolves names to: ``(address, name)`` lines of its /etc/hosts (read at every look-up).

        Written in place: the running processes of the host see the file through a bind mount of it.
        """
        path = _NETNS_ETC / self.netns(host) / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:  # same inode: never replace the file
            f.write("127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for address, name in entries))

    def close(self) -> None:
        for server in self._servers:
            server.stop()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
        self._made = []

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str:
    """The first line ``proc`` prints, or what it said before dying; waits until ``deadline``."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return proc.stdout.readline()
            if proc.poll() is not None:
                return f"(exited {proc.returncode})"
    return "(nothing within the time limit)"
