"""A gRPC proxy that spreads calls over several env servers, as an nginx upstream of several servers or Caddy's
reverse_proxy to several does: each call to the next server in turn, bytes in, bytes out."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import grpc

_SERVICE = "/envfleet.v1.EnvService/"
_STREAMS_ANSWERED = {_SERVICE + "Hold"}  # (unary request, streamed answers)
_STREAMS_BOTH_WAYS = {_SERVICE + "StepStream"}


class CallBalancer(grpc.GenericRpcHandler):
    """Listens on ``address`` (127.0.0.1, a port of its own) once entered; every call goes to the next of
    ``targets`` (a stream whole to one)."""

    def __init__(self, targets: list[str]) -> None:
        self.channels = [grpc.insecure_channel(target) for target in targets]
        self.turn = itertools.count()
        # Unary calls in flight, by method (the name's last part), and the most there were at once.
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.most_at_once: collections.Counter[str] = collections.Counter()
        self.answers: collections.defaultdict[str, list[bytes]] = collections.defaultdict(list)  # (unary, by method)
        self._counting = threading.Lock()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), handlers=[self])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def __enter__(self) -> CallBalancer:
        self._server.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._server.stop(None)
        for channel in self.channels:
            channel.close()

    def _next(self) -> grpc.Channel:
        return self.channels[next(self.turn) % len(self.channels)]

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        name = method.rpartition("/")[2]

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._counting:
                self.in_flight[name] += 1
                self.most_at_once[name] = max(self.most_at_once[name], self.in_flight[name])
            try:
                answer: bytes = self._next().unary_unary(method)(request, timeout=10)
            except grpc.RpcError as err:  # (the server's status passed on, as a proxy does)
                context.abort(err.code(), err.details())
            finally:
                with self._counting:
                    self.in_flight[name] -= 1
            self.answers[name].append(answer)
            return answer

        def forward_answers(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            return _relay(self._next().unary_stream(method)(request), context)

        def forward_both(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            return _relay(self._next().stream_stream(method)(requests), context)

        if method in _STREAMS_ANSWERED:
            return grpc.unary_stream_rpc_method_handler(forward_answers)
        if method in _STREAMS_BOTH_WAYS:
            return grpc.stream_stream_rpc_method_handler(forward_both)
        return grpc.unary_unary_rpc_method_handler(forward)


def _relay(call: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
    """The server's answers on a stream ``call``, then its status, as a proxy passes them on; cancelled with
    the caller's call."""
    context.add_callback(call.cancel)
    try:
        yield from call
    except grpc.RpcError as err:
        context.abort(err.code(), err.details())
