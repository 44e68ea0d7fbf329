"""The HTTP face: OpenAI-compatible endpoints, streaming, /metrics, /health, /version and the Monitor page."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import strata
from serve.config import ServeSettings
from serve.engine_client import EngineClient, EngineDied, EngineFull, EngineRefused, Job, engine_argv
from serve.metrics import Metrics, RequestRecord
from serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from serve.shutdown import Drain
from serve.text import TextStream
from strata.errors import StrataError
from strata.model.loader import ModelFiles
from strata.protocol import Request as EngineRequest
from strata.runtime.sampling import SamplingParams

log = logging.getLogger("strata.serve")
MONITOR_PAGE = Path(__file__).parent / "static" / "monitor.html"
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An answer in OpenAI's error shape. `code`: OpenAI's string code where it has one for the case (such as
    "context_length_exceeded"), else the HTTP status, as vLLM gives it."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers
        self.code = code

    def response(self) -> JSONResponse:
        code = self.code if self.code is not None else self.status
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


RETRY_AFTER_S = 1  # what a 429 (a full waiting line) asks the client to wait


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
    files = ModelFiles.open(settings.model)  # config and tokenizer only: the engine process loads the weights
    tokenizer = files.tokenizer
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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "strata", "root": str(files.checkpoint.path),
                                            "max_model_len": max_cells}]}

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

    async def body_of(request: Request, model: type[SamplingFields]) -> SamplingFields:
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        except RecursionError:
            raise APIError(400, "the request body nests too deeply to read") from None
        except ClientDisconnect:  # the client left while sending its body: nobody reads the answer
            raise APIError(400, "the client disconnected before its request body was complete") from None
        # A lone surrogate can only come from a \\uD800-\\uDFFF escape (raw UTF-8 cannot hold one): only a body with
        # such an escape is serialized again to find it, so other requests pay a byte scan, not a second pass.
        raw = await request.body()
        try:
            lone = (b"\\ud" in raw or b"\\uD" in raw) and _lone_surrogate(data)
        except RecursionError:
            raise APIError(400, "the request body nests too deeply to read") from None
        if lone:
            raise APIError(400, "the request holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff not "
                                "paired with its other half): text must be valid Unicode")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{field}: {err['msg']}", param=field) from None
        if body.model is not None and body.model not in (name, settings.model):
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{name}`",
                           param="model", kind="NotFoundError")
        return body

    def engine_request(body: SamplingFields, ids: list[int]) -> EngineRequest:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= i < files.spec.vocab_size for i in ids):
            raise APIError(400, f"a prompt token id is outside the vocabulary (0..{files.spec.vocab_size - 1})",
                           param="prompt")
        if len(ids) >= max_cells:
            raise APIError(400, f"This model's maximum context length is {max_cells} tokens. However, your prompt has "
                                f"{len(ids)} tokens and the answer needs at least one more. Shorten the prompt.",
                           param="messages", code="context_length_exceeded")
        if any(not 0 <= i < files.spec.vocab_size for i in body.stop_token_ids or []):
            raise APIError(400, "stop_token_ids: a token id is outside the vocabulary "
                                f"(0..{files.spec.vocab_size - 1})", param="stop_token_ids")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is not None and len(ids) + max_tokens > max_cells:
            raise APIError(400, f"This model's maximum context length is {max_cells} tokens. However, you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                                "completion). Reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        params = SamplingParams(
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=max(0, body.top_k or 0),
            min_p=body.min_p or 0.0,
            seed=body.seed if body.seed is not None else secrets.randbits(62),
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
        )
        try:
            params.validate()
        except StrataError as e:
            raise APIError(400, str(e)) from None
        return EngineRequest(max_tokens or max_cells - len(ids), params, frozenset(body.stop_token_ids or []),
                             body.ignore_eos, ids)

    async def submit(body: SamplingFields, ids: list[int]) -> Job:
        """Send the request to the engine and wait for it to be taken (it then waits for a slot or runs)."""
        request = engine_request(body, ids)
        record = RequestRecord(f"{uuid.uuid4().hex[:16]}", len(ids), request.max_new, time.monotonic())
        job = None
        if drain.draining:
            raise APIError(503, "the server is shutting down; send the request to another replica or retry later",
                           kind="service_unavailable")
        try:
            job = client.submit(request, record)
            await client.accept(job)
        except asyncio.CancelledError:  # the client left before the engine took the request
            if job is not None:
                client.abandon(job)
            raise
        except EngineDied as e:
            raise APIError(503, str(e), kind="service_unavailable") from None
        except EngineFull as e:
            raise APIError(429, f"the server is busy: {e}", kind="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineRefused as e:
            if e.code == "invalid":
                raise APIError(400, str(e)) from None
            raise APIError(500, str(e), kind="internal_server_error") from None
        return job

    async def pieces(job: Job, stream: TextStream, http: Request) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) as tokens arrive; the job is stopped if the consumer goes away. The tokens that came
        while the consumer was busy are taken together, as one piece of text (one chunk of a stream): when many
        streams share the event loop, a stream that fell behind catches up in fewer, larger writes."""
        try:
            while True:
                try:
                    item = job.events.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        item = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await http.is_disconnected():
                            return
                        continue
                text = []
                while isinstance(item, int):
                    text.append(stream.push(item))
                    if stream.stopped:
                        client.abandon(job, reason="stop")
                        yield "".join(text), "stop"
                        return
                    try:
                        item = job.events.get_nowait()
                    except asyncio.QueueEmpty:
                        item = None
                if any(text):
                    yield "".join(text), None
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, tuple):
                    yield stream.finish(), item[1]
                    return
        finally:
            client.abandon(job)  # no-op when it already ended

    async def abandon_on_disconnect(job: Job, http: Request) -> None:
        """A non-streaming answer's client that leaves (times out, closes its connection) aborts the request at once,
        while its tokens are still coming (a streaming response's disconnect cancels its generator instead). Its
        body has been read, so the next ASGI message is the disconnect."""
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                client.abandon(job)
                return

    def usage(job: Job) -> dict:
        n_prompt, n_gen = len(job.request.ids), len(job.generated)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}

    async def respond(body: SamplingFields, job: Job, http: Request, chat: bool, echo: str = ""):
        stream = TextStream(tokenizer, body.stop_strings())
        rid = ("chatcmpl-" if chat else "cmpl-") + job.record.request_id
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool) -> dict:
            if chat:
                msg = {"content": text} if text is not None else {}
                if not delta:
                    msg = {"role": "assistant", "content": text}
                return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if not body.stream:
            parts, finish = [echo], None
            watcher = asyncio.create_task(abandon_on_disconnect(job, http))
            try:
                async for text, finish in pieces(job, stream, http):
                    parts.append(text)
            except EngineRefused as e:
                raise APIError(400, str(e)) from None
            except EngineDied as e:  # the engine went away (it restarts) or the server shuts down: retry elsewhere
                raise APIError(503, str(e), kind="service_unavailable") from None
            finally:
                watcher.cancel()
            return {"id": rid, "object": kind, "created": created, "model": name,
                    "choices": [choice("".join(parts), finish_reason(finish), delta=False)], "usage": usage(job)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            chunk = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": name}

            def sse(choices: list, **extra) -> str:
                return "data: " + json.dumps({**chunk, "choices": choices, **extra}) + "\n\n"

            if chat:
                yield sse([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            elif echo:
                yield sse([choice(echo, None, True)])
            try:
                async for text, finish in pieces(job, stream, http):
                    if text:
                        yield sse([choice(text, None, True)])
                    if finish is not None:
                        yield sse([choice(None if chat else "", finish_reason(finish), True)])
                if include_usage:
                    yield sse([], usage=usage(job))
            except (EngineRefused, EngineDied) as e:
                yield "data: " + json.dumps({"error": {"message": str(e), "type": "internal_server_error", "code": 500}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def finish_reason(reason: str | None) -> str:
        """OpenAI's two values: "length" when max_tokens or the context ran out, else "stop"."""
        return "length" if reason == "length" else "stop"

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(http: Request):
        body = await body_of(http, ChatCompletionRequest)
        try:
            ids = tokenizer.encode_chat([m.as_template_message() for m in body.messages])
        except StrataError as e:
            raise APIError(400, str(e), param="messages") from None
        return await respond(body, await submit(body, ids), http, chat=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(http: Request):
        body = await body_of(http, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported (n=1)", param="prompt")
            prompt = prompt[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else ""
        return await respond(body, await submit(body, ids), http, chat=False, echo=echo)

    openapi = app.openapi

    def openapi_with_bodies() -> dict:
        """FastAPI's schema, with the request bodies' models under components (the endpoints read their bodies
        themselves, to answer bad ones in OpenAI's error shape, so FastAPI does not list them by itself)."""
        if app.openapi_schema is None:
            schema = openapi()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest):
                body = model.model_json_schema(ref_template=REF_TEMPLATE)
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi_with_bodies
    return app


def _lone_surrogate(data) -> bool:
    """Whether a parsed JSON value holds a string with an unpaired UTF-16 surrogate (not encodable as UTF-8)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


REF_TEMPLATE = "#/components/schemas/{model}"


def request_body(model: type) -> dict:
    """The OpenAPI requestBody of an endpoint that takes `model` as JSON."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}}
