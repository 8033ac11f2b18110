"""The operations listener (``REDPACKET_METRICS_PORT``, loopback by default): ``/metrics``, and with
``REDPACKET_CONSOLE_KEY`` the operators' console (``server.hub.console``), kept off the port strangers reach.

It is the hub's own app behind uvicorn's HTTP protocol with the hub's bounds (``server.hub.handshake``:
a request whole within the handshake deadline, its head and body limited), served on the socket given
through the protocol class's public constructor (``config``, ``server_state``, ``app_state``), beside the
hub's server in the same loop. No uvicorn ``Server`` of its own: that one would take the process's
signals from the hub's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from uvicorn.server import ServerState

from server.hub.handshake import HttpLimits, bounded_http
from server.hub.httpkit import EveryAnswer
from server.settings import Settings

# How long connections still open when the hub stops are given to finish their answer.
CLOSE_SECONDS = 2.0


def operations_app(
    settings: Settings,
    page: Callable[[], bytes],
    extra: list[BaseRoute],
    on_error: Callable[[Request, Exception], object],
) -> Starlette:
    """``/metrics`` answered with ``page()``, and the ``extra`` routes (the console's)."""

    async def metrics(request: Request) -> Response:
        return Response(page(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[Route("/metrics", metrics, methods=["GET", "HEAD"]), *extra],
        middleware=[Middleware(EveryAnswer)],
        exception_handlers={HTTPException: on_error},  # type: ignore[dict-item]
    )


class OperationsServer:
    def __init__(self, server: asyncio.Server, state: ServerState) -> None:
        self.server = server
        self.state = state

    async def close(self) -> None:
        self.server.close()
        for connection in list(self.state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                await self.server.wait_closed()
        except TimeoutError:
            for connection in list(self.state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()


async def serve_operations(sock: socket.socket, app: Starlette, settings: Settings) -> OperationsServer:
    config = uvicorn.Config(
        app,
        http=bounded_http(settings.handshake_seconds, HttpLimits.of(settings)),
        ws="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
    )
    config.load()
    state = ServerState()

    def protocol() -> asyncio.Protocol:
        return config.http_protocol_class(config=config, server_state=state, app_state={})  # type: ignore[call-arg]

    sock.setblocking(False)
    server = await asyncio.get_running_loop().create_server(protocol, sock=sock, backlog=128)
    return OperationsServer(server, state)
