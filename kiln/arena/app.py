"""The arena's web app (FastAPI, served by uvicorn) on 127.0.0.1 only: the page, its JSON API and /ratings.

``serve(arena, port=8765)`` blocks until Ctrl-C; ``make_app(arena)`` is the ASGI app alone (tests serve it in a
thread). Routes: GET / (the page), GET /api/round (the open round: prompt and two answers, no names),
POST /api/vote {round, vote} (names revealed, ratings), GET /ratings[?method=elo] (the ratings as JSON).
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Callable, Literal

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from pydantic import BaseModel
from starlette.middleware.trustedhost import TrustedHostMiddleware

from kiln.arena.page import PAGE
from kiln.arena.session import Arena

LOCAL_HOSTS = ("127.0.0.1", "localhost")


class VoteBody(BaseModel):
    round: str
    vote: Literal["left", "right", "tie", "both_bad"]


def make_app(arena: Arena) -> FastAPI:
    """The ASGI app over ``arena``; requests whose Host header is not 127.0.0.1 or localhost are refused (400), so
    a page elsewhere cannot reach the arena through a rebound DNS name."""
    app = FastAPI(title="kiln arena", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOCAL_HOSTS))

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE

    @app.get("/api/round")
    def current_round() -> dict:
        r = arena.round()
        return {"round": r.id, "prompt": r.prompt, "answers": list(r.answers), "votes": arena.counts()["votes"]}

    @app.post("/api/vote")
    def vote(body: VoteBody) -> dict:
        try:
            return arena.vote(body.round, body.vote)
        except KeyError as e:
            raise HTTPException(404, str(e.args[0])) from e
        except ValueError as e:
            raise HTTPException(409, str(e)) from e

    @app.get("/ratings")
    def ratings(method: Literal["bt", "elo"] = "bt") -> dict:
        return arena.ratings(method)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0 picks a free port); only 127.0.0.1 or localhost."""
    if host not in LOCAL_HOSTS:
        raise ValueError(f"arena: host {host!r}: the arena serves on 127.0.0.1 only (it has no login); reach it from "
                         "another machine through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT)")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise OSError(f"arena: cannot listen on 127.0.0.1:{port} ({e.strerror}); pick another --port") from e
    sock.listen(64)
    return sock


def server(arena: Arena):
    """A uvicorn server for the app on an already bound socket (run with ``.run(sockets=[sock])``)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(make_app(arena), log_level="warning", access_log=False, lifespan="off"))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(arena: Arena, port: int = 8765, host: str = "127.0.0.1", on_ready: Callable[[str], None] = print) -> None:
    """Serve ``arena`` until Ctrl-C or SIGTERM (uvicorn's graceful shutdown), then close its MLflow run."""
    sock = bind(host, port)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    srv = server(arena)
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _interrupt) if main else None  # what uvicorn re-raises after shutting down
    on_ready(url)
    try:
        srv.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT (or SIGTERM) it handled, once it has shut down
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
        sock.close()
        arena.close()
