"""The OpenAI-compatible HTTP app.

Bodies are read by hand (size-limited) and validated by :mod:`minisgl.server.protocol`, so
every client mistake is a 400 in OpenAI's error shape naming the field, never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from minisgl.server.backend import Backend
from minisgl.server.errors import ApiError, unavailable
from minisgl.server.generation import Generation, start_chat, start_completion
from minisgl.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    parse_request,
)
from minisgl.server.responses import (
    chat_response,
    completion_response,
    stream_chat,
    stream_completion,
)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class ApiSettings:
    model_name: str
    accepted_models: frozenset[str]
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024


class SSEResponse(StreamingResponse):
    """Server-sent events that end the generation as soon as the client goes away.

    The body is streamed while a second task listens for ``http.disconnect``; whichever ends
    first cancels the other, and the generation's unfinished requests are aborted.
    """

    def __init__(self, content: AsyncIterator[bytes], gen: Generation) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.gen.abort()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def error_response(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) anything over ``limit`` bytes, declared or not."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if size > limit:
            raise _too_large(limit)
    chunks = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_content_type(request: Request) -> None:
    """JSON bodies only; a missing Content-Type is taken to be JSON."""
    header = request.headers.get("content-type")
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(400, "the Content-Type must be application/json", param="content-type")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def create_app(backend: Backend, settings: ApiSettings) -> FastAPI:
    """The FastAPI app serving ``backend`` (the real pipeline, or a fake one in tests)."""
    app = FastAPI(title="minisgl", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.settings = settings
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(ApiError(400, exc.message, param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(ApiError(500, f"internal error: {exc}", type="internal_error"))

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            raise ApiError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                code="invalid_api_key",
            )

    def check_model(model: str | None) -> None:
        if model is not None and model not in settings.accepted_models:
            raise ApiError(
                404,
                f"The requested model does not exist; this server serves '{settings.model_name}'.",
                code="model_not_found",
                param="model",
            )

    async def prepare(request: Request, kind: type) -> Any:
        authorize(request)
        check_content_type(request)
        body = await read_body(request, settings.max_body_bytes)
        req = parse_request(kind, body)
        check_model(req.model)
        return req

    async def finish(request: Request, gen: Generation) -> bool:
        """Wait for every choice; False if the client went away (the request is aborted)."""

        async def disconnected() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        try:
            return await gen.run_to_end(disconnected)
        except asyncio.CancelledError:
            gen.abort()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req: ChatCompletionRequest = await prepare(request, ChatCompletionRequest)
        gen = await start_chat(backend, req)
        model = req.model or settings.model_name
        want_logprobs = bool(req.logprobs)
        if req.stream:
            await gen.wait_started()
            return SSEResponse(stream_chat(gen, model, want_logprobs, req.include_usage), gen)
        if not await finish(request, gen):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(chat_response(gen, model, want_logprobs))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await prepare(request, CompletionRequest)
        gen = await start_completion(backend, req)
        model = req.model or settings.model_name
        want_logprobs = req.logprobs is not None
        if req.stream:
            await gen.wait_started()
            stream = stream_completion(gen, model, want_logprobs, req.include_usage)
            return SSEResponse(stream, gen)
        if not await finish(request, gen):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(completion_response(gen, model, want_logprobs))

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        authorize(request)
        card: dict[str, Any] = {
            "id": settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "minisgl",
        }
        if backend.facts and backend.facts.get("max_seq_len"):
            card["max_model_len"] = backend.facts["max_seq_len"]
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Any:
        if not backend.healthy:
            return error_response(unavailable(f"unhealthy: {backend.error}"))
        if not backend.ready:
            return error_response(unavailable("starting: the workers are loading", "starting"))
        if backend.stopping:
            return error_response(unavailable("shutting down", "shutting_down"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(
            backend.metrics.render(backend.num_inflight),
            media_type="text/plain; version=0.0.4",
        )

    @app.post("/abort")
    async def abort(request: Request) -> Any:
        authorize(request)
        check_content_type(request)
        req = parse_request(AbortRequest, await read_body(request, settings.max_body_bytes))
        target = req.id or req.rid
        if not target:
            raise ApiError(400, "give the response 'id' to abort", param="id")
        rids = backend.group_rids(target) or ([target] if backend.is_inflight(target) else [])
        if not rids:
            raise ApiError(
                404, f"no request '{target}' is in flight", code="request_not_found", param="id"
            )
        backend.abort(rids)
        return {"aborted": rids}

    return app
