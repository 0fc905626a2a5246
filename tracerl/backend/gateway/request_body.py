"""Reading request bodies with a size limit, before anything is parsed.

A body must arrive whole within a deadline. The limit holds for the bytes on the wire
(checked as they arrive, so a chunked upload cannot grow past it) and, for
``Content-Encoding: gzip``, for the decompressed bytes too.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from ...core import settings, strict_json
from ...core.errors import BadBodyEncodingError, BodyTimeoutError, BodyTooLargeError, RequestError

BODY_TIMEOUT_S = settings.TRACERL_BODY_TIMEOUT_S.default


def body_timeout_s() -> float:
    """Seconds a request body may take to arrive (``TRACERL_BODY_TIMEOUT_S``, default 60)."""
    return settings.TRACERL_BODY_TIMEOUT_S.get()


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be one JSON object: strict JSON (:mod:`tracerl.core.strict_json`: no
    NaN, Infinity, lone surrogate or integer past 64 bits, a 400 naming the field), nesting and
    integer sizes bounded by the parser (a 100k-deep array or a 5,000-digit integer is a 400)."""
    try:
        body = strict_json.loads(raw)
    except RequestError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, int digits, NaN
        raise RequestError(f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


async def read_limited_body(request: Request, limit: int,
                            timeout_s: float | None = None) -> bytes:
    """The request body, decompressed if gzipped; raises :class:`BodyTooLargeError` past
    ``limit`` and :class:`BodyTimeoutError` when it has not all arrived within ``timeout_s``
    (a client trickling its body cannot hold a connection)."""
    timeout_s = body_timeout_s() if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_limited_body(request, limit)
    except ClientDisconnect:  # nobody is left to answer; nothing was parsed or written
        raise RequestError("the client hung up before sending the whole body") from None
    except TimeoutError:
        raise BodyTimeoutError(
            f"the request body did not arrive within {timeout_s:g} s") from None


async def _read_limited_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLargeError(
            f"request body of {length} bytes is over the limit of {limit} bytes"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding != "gzip":
        raise BadBodyEncodingError(
            f"Content-Encoding {encoding!r} is not supported (use gzip or none)"
        )
    return gunzip_limited(raw, limit)


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Decompress gzip ``data``, refusing output past ``limit`` bytes (no zip bombs)."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise BadBodyEncodingError(f"request body is not valid gzip: {e}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise BodyTooLargeError(f"decompressed request body is over the limit of {limit} bytes")
    if not inflater.eof:
        raise BadBodyEncodingError("request body is truncated gzip")
    return out


MAX_BODY_BYTES = 32 * 1024 * 1024  # a gateway request's body, decompressed
PARSE_IN_THREAD_BYTES = 256 * 1024  # larger bodies are parsed off the event loop


async def read_json_body(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """A gateway request's JSON object body, read under the size and time limits; a large one
    is parsed in a worker thread, so that it cannot stall the event loop."""
    raw = await read_limited_body(request, limit)
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)
