"""The operations listener (``REDPACKET_METRICS_PORT``, loopback by default): ``/metrics``, and with
``REDPACKET_CONSOLE_KEY`` the operators' console (``server.hub.console``), kept off the port strangers reach.

It is a uvicorn server of its own, with the hub's HTTP protocol and bounds (``server.hub.handshake``: a
request whole within the handshake deadline, its head and body limited) and the hub's uvicorn options
(``options``), run on the metrics socket beside the hub's server in the same loop, leaving the process's
signals to the hub's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from server.hub.handshake import HttpLimits, bounded_http
from server.hub.httpkit import EveryAnswer
from server.settings import Settings

log = logging.getLogger(__name__)

# How long the listener may take to start.
START_SECONDS = 10
# How long connections still open when the hub stops are given to finish their answer.
CLOSE_SECONDS = 2


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


class _Beside(uvicorn.Server):
    """uvicorn's server, run beside the hub's in the same process: the process's signals stay the hub's
    (uvicorn's ``capture_signals``, a public method, is not taken here); it stops when the hub stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def options(settings: Settings) -> dict[str, Any]:
    """What the hub's listener and this one share: uvicorn's logging as the settings say (JSON lines: its
    records go to the root handler), no access log, the HTTP bounds, X-Forwarded-For only from the
    proxies named."""
    return {
        "http": bounded_http(settings.handshake_seconds, HttpLimits.of(settings)),
        "log_level": "warning",
        "access_log": False,
        "log_config": None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        "proxy_headers": bool(settings.trusted_proxy_list),
        "forwarded_allow_ips": list(settings.trusted_proxy_list),
    }


class OperationsServer:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None]) -> None:
        self.server = server
        self.task = task
        task.add_done_callback(_said_if_it_died)

    async def close(self) -> None:
        """Stop taking connections; those open get ``CLOSE_SECONDS`` to finish their answer. Never raises:
        the hub is stopping either way (what went wrong is logged)."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), CLOSE_SECONDS + 5)
        except TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, 5)
        except Exception:
            pass  # (said by the done callback)


def _said_if_it_died(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the operations listener (metrics, console) stopped: %r", task.exception())


async def serve_operations(sock: socket.socket, app: Starlette, settings: Settings) -> OperationsServer:
    """``app`` on ``sock`` (bound by the caller) until ``close``; started when this returns. A start that
    fails (or is cancelled) stops the server and closes the socket before it raises."""
    config = uvicorn.Config(
        app,
        ws="none",
        lifespan="off",
        server_header=False,
        timeout_graceful_shutdown=CLOSE_SECONDS,
        **options(settings),
    )
    server = _Beside(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(START_SECONDS):
            while not server.started:
                if task.done():
                    await task
                    raise RuntimeError("the operations listener stopped as it started")
                await asyncio.sleep(0.01)
    except BaseException:
        server.should_exit = True
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        sock.close()
        raise
    return OperationsServer(server, task)
