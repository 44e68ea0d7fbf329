"""The HTTP face's wiring: the app, its engine client and metrics, error shapes, the API key, and the endpoints
that are not OpenAI's (/health, /live, /version, /v1/models, /metrics, the Monitor page). The OpenAI endpoints are
in `serve/routes.py`."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import strata
from serve.config import ServeSettings
from serve.engine_client import EngineClient, engine_argv
from serve.errors import APIError
from serve.metrics import Metrics
from serve.requests import Limits
from serve.routes import BODY_MODELS, REF_TEMPLATE, Service, add_openai_routes
from serve.shutdown import Drain
from strata.errors import StrataError
from strata.model.loader import ModelFiles

log = logging.getLogger("strata.serve")
MONITOR_PAGE = Path(__file__).parent / "static" / "monitor.html"


class RequireKey:
    """`/v1/` answers 401 without `Authorization: Bearer <key>`. A plain ASGI middleware: one built on
    BaseHTTPMiddleware would hide a client's disconnect from the endpoint (`Request.is_disconnected`)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                response = APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                                    kind="authentication_error").response()
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def served_name(settings: ServeSettings, files: ModelFiles) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return "SmolLM2-135M-Instruct" if settings.model == "default" else Path(files.checkpoint.path).stem


def create_app(settings: ServeSettings) -> FastAPI:
    # config and tokenizer only (the engine process loads the weights); a --quantization it cannot apply fails here
    files = ModelFiles.open(settings.model, settings.quantization)
    if files.tokenizer is None:
        raise StrataError(f"{settings.model}: the model has no tokenizer (tokenizer.json and tokenizer_config.json "
                          "in its folder, or the tokenizer in a GGUF file's metadata); the server turns text into "
                          "tokens and back, so copy those files from the model's repository, or run `strata "
                          "generate --prompt-ids` instead")
    name = served_name(settings, files)
    max_cells = min(settings.max_cells, files.spec.max_positions)
    metrics = Metrics(name, max_cells, settings.batch)
    client = EngineClient(engine_argv(settings), metrics, settings.batch)
    drain = Drain(settings.shutdown_grace)
    drain.end_all = client.end_all

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        drain.loop = asyncio.get_running_loop()
        # anyio loads its asyncio back end (a dozen modules: task groups, memory streams) on first use, which is
        # inside the first streamed answer; loading it here took ~10 ms off the first request's TTFT (2 cores)
        await anyio.sleep(0)
        await client.start()
        yield
        drain.cancel()
        await client.close()

    app = FastAPI(title="Strata", version=strata.__version__, lifespan=lifespan)
    app.state.client, app.state.metrics, app.state.drain = client, metrics, drain
    service = Service(settings, files, name, Limits(files.spec.vocab_size, max_cells), client, metrics, drain)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        """404 (no such path), 405 (a method the path does not take) and the like, in OpenAI's error shape."""
        kind = {404: "NotFoundError", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        message = {404: f"{request.url.path}: no such endpoint (see /docs)",
                   405: f"{request.method} {request.url.path}: the endpoint does not take this method"}
        return APIError(e.status_code, message.get(e.status_code, str(e.detail)), kind=kind,
                        headers=getattr(e, "headers", None)).response()

    if settings.api_key:
        app.add_middleware(RequireKey, key=settings.api_key)

    @app.get("/health")
    async def health():
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not client.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/live")
    async def live():
        """Liveness, apart from readiness (`/health`): fails only when the engine hangs (silent while requests run,
        `--engine-silence`) or does not come back for 10 minutes after it went away; loading, warm-up and
        draining keep it alive."""
        why = client.alive(settings.engine_silence)
        if why is not None:
            return JSONResponse({"status": "not alive", "reason": why}, status_code=503)
        return {"status": "alive"}

    @app.get("/version")
    async def version():
        return {"version": strata.__version__}

    def card() -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "strata",
                "root": str(files.checkpoint.path), "max_model_len": max_cells}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """One model's card (the OpenAI client's `models.retrieve`); 404 naming the served one for another."""
        if model != name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`", param="model",
                           kind="NotFoundError")
        return card()

    @app.get("/metrics")
    async def metrics_endpoint(request: Request, format: str | None = None):
        rendered = metrics.render(request.headers.get("accept"), format)
        if rendered is None:
            return JSONResponse(metrics.facts())
        body, content_type = rendered
        return Response(body, media_type=content_type)

    @app.get("/")
    async def monitor():
        return FileResponse(MONITOR_PAGE, media_type="text/html")

    add_openai_routes(app, service)

    openapi = app.openapi

    def openapi_with_bodies() -> dict:
        """FastAPI's schema, with the request bodies' models under components (the endpoints read their bodies
        themselves, to answer bad ones in OpenAI's error shape, so FastAPI does not list them by itself)."""
        if app.openapi_schema is None:
            schema = openapi()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in BODY_MODELS:
                body = model.model_json_schema(ref_template=REF_TEMPLATE)
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi_with_bodies
    return app
