"""The app both servers are: routers, the health checks (``GET`` and ``HEAD``), the error
handlers, the metrics middleware, the API key and the body limit, put together in one place, so
the generation server and the embeddings server guard, limit and answer errors alike."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, FastAPI
from starlette.routing import Match

from mega.core.version import __version__
from mega.inference.http.errors import install_error_handlers
from mega.inference.http.guards import MAX_BODY_BYTES, OPEN_PATHS, ApiKeyGuard, BodySizeLimit, RequestMetrics


def create_base_app(title: str, description: str, model_name: str, routers: Sequence[APIRouter], metrics=None,
                    api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """``routers`` behind the API key (when one is given) and the body limit, with ``/health`` and
    ``/v1/health`` open; ``metrics`` (a :class:`~mega.inference.engine.metrics.ServerMetrics`) counts
    every request."""
    if api_key is not None and not api_key:
        raise ValueError("the API key must not be empty (leave it out to serve without one)")
    app = FastAPI(title=title, version=__version__, description=description)
    for router in routers:
        app.include_router(router)

    async def health() -> dict:
        return {"status": "ok", "model": model_name}

    for path in sorted(OPEN_PATHS):  # HEAD too: what many load balancers probe with
        app.add_api_route(path, health, methods=["GET"], summary="liveness (open without the API key)")
        app.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)

    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        def is_route(scope) -> bool:  # the schema pages included
            return any(route.matches(scope)[0] is not Match.NONE for route in app.routes)

        app.add_middleware(ApiKeyGuard, api_key=api_key, is_route=is_route)
    if metrics is not None:
        paths = {route.path for router in routers for route in router.routes} | OPEN_PATHS
        app.add_middleware(RequestMetrics, metrics=metrics, routes=paths)
    return app
