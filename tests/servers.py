"""An env-server subprocess a test controls, its log in a file: the servers of tests/test_server_logs.py,
tests/test_addressing.py and tests/test_server_lifecycle.py (each a subclass of :class:`ServerSubprocess`
that builds its command line)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest


def bindable(host: str) -> bool:
    """Whether this machine has ``host`` (an IP address) to listen on."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


needs_ipv6_loopback = pytest.mark.skipif(not bindable("::1"), reason="needs IPv6's loopback, ::1, which is not here")


class ServerSubprocess:
    """``argv`` (an env server's command line) run at once, its stdout a pipe (for its ready line) and its
    stderr (its log) in the file ``log``, or in an anonymous temporary file without one; ``popen``: more of
    Popen's arguments (``env``, ``preexec_fn``, ...). :meth:`ready` reads its ready line; :meth:`stop` kills it."""

    def __init__(self, argv: Sequence[str], log: Path | None = None, **popen: Any) -> None:
        self.log = log
        self.address = ""
        # (the log in a file: a pipe nobody reads could fill up and block the server)
        self._file: IO[str] | None = None
        if log is None:
            self._file = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._file, text=True, **popen)
        else:
            with log.open("w") as stderr:
                self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, **popen)

    def ready(self) -> str:
        """The address of its ready line, ``listening on ADDRESS`` (also kept as ``address``); a server that
        says anything else first, or exits, fails the test (and is stopped)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            text = self.text()
            self.stop()
            pytest.fail(f"env-server did not start: {line!r} {text[-3000:]}")
        self.address = line.removeprefix("listening on ")
        return self.address

    def text(self) -> str:
        """What it logged so far."""
        if self._file is None:
            assert self.log is not None
            return self.log.read_text()
        self._file.seek(0)
        return self._file.read()

    def wait_for(self, fragment: str, within: float = 30) -> str:
        """The log, once it holds ``fragment`` (it must within ``within`` seconds)."""
        deadline = time.monotonic() + within
        while fragment not in (text := self.text()):
            assert time.monotonic() < deadline, f"{fragment!r} not logged within {within:g} s: {text[-3000:]}"
            time.sleep(0.05)
        return text

    def wait(self, within: float = 60) -> int:
        """Its exit status, once it has exited (it must within ``within`` seconds)."""
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"env-server still running {within:g} s later: {self.text()[-3000:]}")

    def stop(self) -> None:
        """Kill it (if it still runs) and wait for it; its pipe and temporary log file closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._file is not None:
            self._file.close()
