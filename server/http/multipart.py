"""The Files API's upload body: one reader for multipart/form-data, every malformation a 400.

Why this module exists: issue 50. aiohttp's multipart reader raises whatever
it meets (ValueError, AssertionError, RuntimeError, LookupError, an unknown
charset, a boundary missing, too long or never found, a body cut short), and
each was a 500. Every call into it goes through `_parsing`, which turns any
of those into one 400 in OpenAI's shape; only our own refusals (a 413 while
the file streams) and a cancellation pass through unchanged. The reader also
refuses what it could only store wrongly: a part that is itself multipart, a
part with a Content-Transfer-Encoding or Content-Encoding (the bytes must come
as they are, RFC 7578 4.7), and a text field that is not UTF-8 or is longer
than a field name can need.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from aiohttp import BodyPartReader, web

from server.errors import SluiceError

__all__ = ["Form", "read_form"]

T = TypeVar("T")
_CHUNK: Final = 1 << 16
_TEXT_MOST: Final = 1024  # a text field's bytes (`purpose` is one word)
_PLAIN: Final = frozenset({"", "binary", "7bit", "8bit", "identity"})
_UTF8: Final = frozenset({"", "utf-8", "utf8", "us-ascii", "ascii"})


@dataclass(frozen=True, slots=True)
class Form(Generic[T]):
    """The text fields (name -> text; the first of each name) and what the
    store made of the first `file` part (None: there was none)."""

    fields: dict[str, str]
    file: T | None


def malformed(why: str) -> SluiceError:
    return SluiceError(f"the body is not valid multipart/form-data: {why}", status=400)


@contextlib.contextmanager
def _parsing() -> Iterator[None]:
    """Around each call into aiohttp's multipart reader: whatever it raises
    for the body's bytes is a 400."""
    try:
        yield
    except (SluiceError, web.HTTPException):
        raise
    except Exception as exc:  # the reader's errors are the body's
        raise malformed(str(exc) or type(exc).__name__) from None


async def read_form(
    request: web.Request,
    store: Callable[[str, AsyncIterator[bytes]], Awaitable[T]],
    *,
    text: frozenset[str],
) -> Form[T]:
    """Read `request`'s multipart body: the parts named in `text` as UTF-8
    text, the first part named `file` handed to `store` (its filename and its
    bytes, streamed; `store` may raise to refuse them), any other part skipped."""
    with _parsing():  # the standard library's header parser raises on some bytes
        multipart = request.content_type.startswith("multipart/")
    if not multipart:
        raise SluiceError("the body must be multipart/form-data with `purpose` and `file`")
    fields: dict[str, str] = {}
    stored: T | None = None
    have_file = False
    with _parsing():
        reader = await request.multipart()
    while True:
        with _parsing():
            part = await reader.next()
            if part is None:
                break
            if not isinstance(part, BodyPartReader):
                raise malformed("a part is itself multipart")
            _plain(part)
            name = part.name
        if name in text and name not in fields:
            fields[name] = await _text(part, name)
        elif name == "file" and not have_file:
            with _parsing():
                filename = part.filename or "upload.jsonl"
            have_file = True
            stored = await store(filename, _chunks(part))
    return Form(fields, stored if have_file else None)


def _plain(part: BodyPartReader) -> None:
    """A part whose bytes are as they came: no transfer or content coding."""
    for header in ("Content-Transfer-Encoding", "Content-Encoding"):
        coding = part.headers.get(header, "").strip().lower()
        if coding not in _PLAIN:
            raise malformed(f"a part's {header} {coding!r} is not supported: send it as it is")


async def _text(part: BodyPartReader, name: str) -> str:
    """A text field: UTF-8 (as declared, or undeclared), at most _TEXT_MOST bytes."""
    with _parsing():
        charset = (part.get_charset("") or "").strip().lower()
    if charset not in _UTF8:
        raise SluiceError(f"`{name}` must be UTF-8 text, not {charset}", status=400, param=name)
    data = b""
    async for chunk in _chunks(part):
        data += chunk
        if len(data) > _TEXT_MOST:
            raise SluiceError(f"`{name}` is over {_TEXT_MOST} bytes", status=400, param=name)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SluiceError(f"`{name}` must be UTF-8 text", status=400, param=name) from None


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    """A part's bytes as they come (a body cut short, or a part without its
    closing boundary, is a 400)."""
    while True:
        with _parsing():
            chunk = await part.read_chunk(_CHUNK)
        if not chunk:
            return
        yield chunk
