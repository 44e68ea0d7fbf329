"""The OpenAI endpoints: a body in, engine jobs out, their tokens streamed or gathered back as OpenAI objects.

`serve/requests.py` turns a body into engine requests and `serve/responses.py` turns tokens into response objects;
this module does the I/O between them: submitting jobs, following their tokens, clients that leave.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from serve.config import ServeSettings
from serve.engine_client import EngineClient, EngineDied, EngineFull, EngineRefused, Job
from serve.errors import RETRY_AFTER_S, APIError, invalid_body
from serve.metrics import Metrics, RequestRecord
from serve.requests import (Limits, ToolPlan, chat_prompt, completion_prompt, engine_requests, request_constraint,
                            tokenize_ids, tool_plan)
from serve.responses import (Piece, chat_choice, chat_delta_choices, completion_choice, gather, prompt_logprobs,
                             usage)
from serve.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                           TokenizeRequest)
from serve.shutdown import Drain
from serve.text import TextStream
from serve.tools import ToolCallStream, add_delta
from strata.errors import StrataError
from strata.grammar import Constraint, GrammarVocab, Grammars
from strata.model.loader import ModelFiles
from strata.protocol import Request as EngineRequest

DISCONNECT_POLL_S = 0.5


@dataclass
class Service:
    """What the endpoints share: the model's files and limits, the engine client, the metrics, the drain."""

    settings: ServeSettings
    files: ModelFiles
    name: str
    limits: Limits
    client: EngineClient
    metrics: Metrics
    drain: Drain
    _grammars: Grammars | None = None
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokenizer(self):
        return self.files.tokenizer

    def grammars(self) -> Grammars:
        """The compiled-grammar cache, built on first use (reading the vocabulary takes ~0.3 s at 49K tokens)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(GrammarVocab.build(self.tokenizer, width=self.files.spec.vocab_size))
            return self._grammars

    async def check_constraint(self, constraint: Constraint | None, param: str | None) -> None:
        """Compile the constraint before the engine gets it (~1 ms, cached; the engine compiles it again in its
        own process), so one the library cannot compile gets a 400 naming the field and the reason at once."""
        if constraint is None:
            return
        try:
            await asyncio.to_thread(lambda: self.grammars().compile(constraint))
        except StrataError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None


async def read_body(http: Request, model: type, service: Service):
    try:
        data = await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply to read") from None
    except ClientDisconnect:  # the client left while sending its body: nobody reads the answer
        raise APIError(400, "the client disconnected before its request body was complete") from None
    # A lone surrogate can only come from a \\uD800-\\uDFFF escape (raw UTF-8 cannot hold one): only a body with
    # such an escape is serialized again to find it, so other requests pay a byte scan, not a second pass.
    raw = await http.body()
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
        raise invalid_body(e) from None
    if body.model is not None and body.model not in (service.name, service.settings.model):
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{service.name}`",
                       param="model", kind="NotFoundError")
    return body


def _lone_surrogate(data) -> bool:
    """Whether a parsed JSON value holds a string with an unpaired UTF-16 surrogate (not encodable as UTF-8)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class Answer:
    """The jobs of one request (one per sample), submitted to the engine and followed to their end."""

    def __init__(self, service: Service, body: SamplingFields, ids: list[int], http: Request,
                 grammar: Constraint | None = None, tools: ToolPlan | None = None):
        self.service, self.body, self.ids, self.http = service, body, ids, http
        self.tools = tools  # tools offered: each sample's text is parsed for calls
        self.requests = engine_requests(body, ids, service.limits, grammar)
        self.request_id = uuid.uuid4().hex[:16]
        self.jobs: list[Job] = []

    async def submit(self) -> None:
        """Send every sample to the engine and wait for each to be taken (it then waits for a slot or runs)."""
        if self.service.drain.draining:
            raise APIError(503, "the server is shutting down; send the request to another replica or retry later",
                           kind="service_unavailable")
        try:
            suffix = (lambda index: f"-{index}") if len(self.requests) > 1 else (lambda index: "")
            self.jobs = self.service.client.submit_all([
                (request, RequestRecord(self.request_id + suffix(index), len(request.ids), request.max_new,
                                        time.monotonic())) for index, request in enumerate(self.requests)])
            for job in self.jobs:
                await self.service.client.accept(job)
        except BaseException as e:
            for job in self.jobs:
                self.service.client.abandon(job)
            if isinstance(e, EngineDied):
                raise APIError(503, str(e), kind="service_unavailable") from None
            if isinstance(e, EngineFull):
                raise APIError(429, f"the server is busy: {e}", kind="rate_limit_exceeded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(e, EngineRefused):
                if e.code == "invalid":
                    raise APIError(400, str(e)) from None
                raise APIError(500, str(e), kind="internal_server_error") from None
            raise

    def usage(self) -> dict:
        return usage(len(self.ids), sum(len(j.generated) for j in self.jobs))

    async def pieces(self, index: int) -> AsyncIterator[Piece]:
        """Sample `index`'s answer as it comes: the tokens that came while the consumer was busy are taken together,
        as one piece of text (when many streams share the event loop, a stream that fell behind catches up in
        fewer, larger writes). The job is stopped if the consumer goes away or a stop string ends the text, or,
        with tools offered and `parallel_tool_calls` false, when its first call has been read: the slot is freed
        at once, and the answer's finish reason is "tool_calls". With tools, each token's text goes through a
        `ToolCallStream` and the pieces carry its deltas."""
        job, client = self.jobs[index], self.service.client
        tokenizer, request = self.service.tokenizer, job.request
        ends = (tokenizer.stop_ids if not request.ignore_eos else frozenset()) | request.stop_ids  # the engine's
        stream = TextStream(tokenizer, self.body.stop_strings(), self.body.min_tokens,
                            self.body.include_stop_str_in_output, self.body.skip_special_tokens, ends)
        calls = ToolCallStream(self.tools.fmt, self.tools.names) if self.tools is not None else None
        one_call = self.tools is not None and not self.tools.parallel
        wants_logprobs = job.request.logprobs is not None
        taken = 0
        try:
            while True:
                try:
                    item = job.events.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        item = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await self.http.is_disconnected():
                            return
                        continue
                text, tokens = [], []
                deltas = [] if calls is not None else None
                while isinstance(item, int):
                    tokens.append(item)
                    released = stream.push(item)
                    text.append(released)
                    if calls is not None and released:
                        for d in calls.feed(released):
                            add_delta(deltas, d)
                    if stream.stopped or (one_call and calls.ended):
                        client.abandon(job, reason="stop")
                        piece = self._piece(index, "".join(text), tokens, taken, wants_logprobs, "stop", deltas)
                        yield self._last(piece, calls)
                        return
                    try:
                        item = job.events.get_nowait()
                    except asyncio.QueueEmpty:
                        item = None
                if tokens:
                    yield self._piece(index, "".join(text), tokens, taken, wants_logprobs, None, deltas)
                    taken += len(tokens)
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, tuple):
                    tail = stream.finish()
                    deltas = [] if calls is not None else None
                    if calls is not None and tail:
                        for d in calls.feed(tail):
                            add_delta(deltas, d)
                    piece = Piece(index, tail, [], [] if wants_logprobs else None, item[1], deltas)
                    yield self._last(piece, calls)
                    return
        finally:
            client.abandon(job)  # no-op when it already ended

    def _piece(self, index: int, text: str, tokens: list[int], taken: int, wants_logprobs: bool,
               finish: str | None, deltas: list[dict] | None = None) -> Piece:
        entries = self.jobs[index].logprobs[taken: taken + len(tokens)] if wants_logprobs else None
        return Piece(index, text, tokens, entries, finish, deltas)

    @staticmethod
    def _last(piece: Piece, calls: ToolCallStream | None) -> Piece:
        """The answer's last piece: with tools, the parser flushed (held-back text, a call cut off by the end) and
        the finish reason "tool_calls" when a call was made (unless the answer ran out of tokens: "length")."""
        if calls is None:
            return piece
        rest, called = calls.finish()
        for d in rest:
            add_delta(piece.deltas, d)
        if called and piece.finish != "length":
            piece.finish = "tool_calls"
        return piece

    async def merged(self) -> AsyncIterator[Piece]:
        """Every sample's pieces as they come, interleaved."""
        if len(self.jobs) == 1:
            async for piece in self.pieces(0):
                yield piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def follow(index: int) -> None:
            try:
                async for piece in self.pieces(index):
                    await queue.put(piece)
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
            finally:
                await queue.put(index)

        tasks = [asyncio.create_task(follow(i)) for i in range(len(self.jobs))]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if isinstance(item, int):
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def abandon_on_disconnect(self) -> None:
        """A non-streaming answer's client that leaves (times out, closes its connection) aborts the request at
        once, while its tokens are still coming (a streaming response's disconnect cancels its generator
        instead). Its body has been read, so the next ASGI message is the disconnect."""
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                for job in self.jobs:
                    self.service.client.abandon(job)
                return


def add_openai_routes(app: FastAPI, service: Service) -> None:
    tokenizer = service.tokenizer

    async def respond(answer: Answer, chat: bool, echo: str = ""):
        body = answer.body
        rid = ("chatcmpl-" if chat else "cmpl-") + answer.request_id
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        headers = _request_id_header(answer.http)

        def choice(piece: Piece, delta: bool, first: bool = False, offset: int = 0) -> dict:
            if chat:
                return chat_choice(piece, tokenizer, delta, first)
            return completion_choice(piece, tokenizer, offset)

        def stream_choices(piece: Piece, offset: int) -> list[dict]:
            if chat:
                return chat_delta_choices(piece, tokenizer)
            return [completion_choice(piece, tokenizer, offset)]

        scored = not chat and echo and body.logprobs is not None  # the prompt's log-probabilities asked for
        if not body.stream:
            per_sample: list[list[Piece]] = [[] for _ in answer.jobs]
            watcher = asyncio.create_task(answer.abandon_on_disconnect())
            try:
                async for piece in answer.merged():
                    per_sample[piece.index].append(piece)
            except EngineRefused as e:
                raise APIError(400, str(e)) from None
            except EngineDied as e:  # the engine went away (it restarts) or the server shuts down: retry elsewhere
                raise APIError(503, str(e), kind="service_unavailable") from None
            finally:
                watcher.cancel()
            choices = []
            for index, pieces in enumerate(per_sample):
                whole = gather(pieces)
                whole.index, whole.text = index, echo + whole.text
                choices.append(choice(whole, delta=False, offset=len(echo)))
                if scored:  # echo with logprobs: the prompt's own first
                    c = choices[-1]
                    c["logprobs"] = prompt_logprobs(tokenizer, answer.ids, answer.jobs[index].prompt_logprobs,
                                                    c["logprobs"])
            return _json({"id": rid, "object": kind, "created": created, "model": service.name,
                          "choices": choices, "usage": answer.usage()}, headers)

        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)

        async def events() -> AsyncIterator[str]:
            chunk = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": service.name}

            def sse(choices: list, **extra) -> str:
                if continuous and "usage" not in extra:
                    extra["usage"] = answer.usage()
                return "data: " + json.dumps({**chunk, "choices": choices, **extra}) + "\n\n"

            offsets = [0] * len(answer.jobs)
            for index in range(len(answer.jobs)):
                if chat:
                    yield sse([choice(Piece(index, ""), True, first=True)])
                elif echo and not scored:
                    yield sse([choice(Piece(index, echo), True)])
                    offsets[index] = len(echo)
            try:
                async for piece in answer.merged():
                    if scored and not offsets[piece.index]:  # the prompt scored before its first token: echo it now
                        c = choice(Piece(piece.index, echo), True)
                        c["logprobs"] = prompt_logprobs(tokenizer, answer.ids, answer.jobs[piece.index].prompt_logprobs,
                                                        None)
                        yield sse([c])
                        offsets[piece.index] = len(echo)
                    if piece.text or piece.tokens or piece.finish is not None:
                        for c in stream_choices(piece, offsets[piece.index]):
                            yield sse([c])
                        offsets[piece.index] += len(piece.text)
                if include_usage:
                    yield sse([], usage=answer.usage())
            except (EngineRefused, EngineDied) as e:
                yield "data: " + json.dumps({"error": {"message": str(e), "type": "internal_server_error",
                                                       "code": 500}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(http: Request):
        body = await read_body(http, ChatCompletionRequest, service)
        plan = tool_plan(body, tokenizer, service.files.family.name)
        ids = chat_prompt(body, tokenizer)
        constraint, param = request_constraint(body, plan)
        await service.check_constraint(constraint, param)
        answer = Answer(service, body, ids, http, constraint, plan)
        await answer.submit()
        return await respond(answer, chat=True)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(http: Request):
        body = await read_body(http, CompletionRequest, service)
        ids, echo = completion_prompt(body, tokenizer)
        constraint, param = request_constraint(body)
        await service.check_constraint(constraint, param)
        answer = Answer(service, body, ids, http, constraint)
        await answer.submit()
        return await respond(answer, chat=False, echo=echo)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(http: Request):
        body = await read_body(http, TokenizeRequest, service)
        ids = tokenize_ids(body, tokenizer, service.files.family.name)
        out = {"count": len(ids), "max_model_len": service.limits.max_cells, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
        return _json(out, _request_id_header(http))

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(http: Request):
        body = await read_body(http, DetokenizeRequest, service)
        bad = [i for i in body.tokens if i >= service.limits.vocab_size]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is outside the vocabulary (0..{service.limits.vocab_size - 1})",
                           param="tokens")
        return _json({"prompt": tokenizer.decode(body.tokens)}, _request_id_header(http))


def _request_id_header(http: Request) -> dict[str, str]:
    """`X-Request-Id` as the client sent it, echoed on the response."""
    rid = http.headers.get("x-request-id")
    return {"X-Request-Id": rid} if rid else {}


def _json(content: dict, headers: dict[str, str]):
    from fastapi.responses import JSONResponse

    return JSONResponse(content, headers=headers)


REF_TEMPLATE = "#/components/schemas/{model}"
BODY_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def request_body(model: type) -> dict:
    """The OpenAPI requestBody of an endpoint that takes `model` as JSON."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}}
