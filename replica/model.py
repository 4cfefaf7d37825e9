"""Model providers: the clients that stream a reply, and the ``--model`` spec that picks one.

A provider turns a conversation and the offered tools into a stream of events: text deltas,
complete tool calls, then exactly one :class:`Finish` (the types and the ``ModelError`` tree
live in ``replica.model_types`` and are re-exported here). Three providers exist:

- :class:`MockModel`: instant and deterministic (the script in ``replica.model_script``);
- :class:`StubModel`: the same script delivered with a declared latency (time to first token,
  time per token), so load tests see the think time a real model would impose;
- :class:`OpenAIModel`: any OpenAI-compatible streaming chat-completions endpoint.

Consumers should close an abandoned stream (``contextlib.aclosing``) so the HTTP response
behind it is released at once rather than when the generator is collected.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import re
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import certifi
import httpx

from replica import http1_wire, model_script, model_wire
from replica.errors import ConfigError
from replica.http1_client import (
    ConnectError,
    ConnectionPool,
    HTTPError,
    Origin,
    Response,
    TimeoutException,
    TransportError,
)
from replica.http_proxied import ProxiedClient, ProxiedResponse, proxy_applies
from replica.model_types import (
    ChatMessage,
    Finish,
    FinishReason,
    ModelError,
    ModelEvent,
    ModelHTTPError,
    ModelProtocolError,
    ModelProvider,
    ModelStreamError,
    ModelTimeout,
    ModelUnavailable,
    Role,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    ToolSpec,
)

__all__ = [
    "ChatMessage",
    "Finish",
    "FinishReason",
    "MockModel",
    "MockSpec",
    "ModelError",
    "ModelEvent",
    "ModelHTTPError",
    "ModelProtocolError",
    "ModelProvider",
    "ModelSpec",
    "ModelStreamError",
    "ModelTimeout",
    "ModelUnavailable",
    "OpenAIModel",
    "OpenAISpec",
    "Role",
    "StubModel",
    "StubSpec",
    "TextDelta",
    "ToolCall",
    "ToolCallEvent",
    "ToolSpec",
    "make_provider",
    "parse_model_spec",
]


# --- scripted providers -------------------------------------------------------------------


class _ScriptedModel:
    """Delivers ``model_script`` replies as events, on a declared latency schedule."""

    def __init__(
        self, ttft_s: float, per_token_s: float, default_words: int | None, tick_s: float = 0.0
    ) -> None:
        if ttft_s < 0 or per_token_s < 0 or tick_s < 0:
            raise ValueError("latencies must not be negative")
        self._ttft_s = ttft_s
        self._per_token_s = per_token_s
        self._default_words = default_words
        self._tick_s = tick_s

    async def stream(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
    ) -> AsyncIterator[ModelEvent]:
        reply = model_script.plan_reply(
            messages,
            {t.name for t in tools},
            max_tokens=max_tokens,
            default_words=self._default_words,
        )
        if reply.error_status is not None:
            raise ModelHTTPError(
                f"scripted model answered {reply.error_status}", status=reply.error_status
            )
        # The finish is the last unit of a stream, so a hang-up at len(units) loses only it.
        cut = reply.hangup_after
        if cut is not None and cut > len(reply.units):
            cut = None
        loop = asyncio.get_running_loop()
        start = loop.time()
        units = reply.units[:cut]
        ttft, per_token = self._ttft_s, self._per_token_s
        # An instant stream (no time per token) keeps a step per token: its tokens are all due
        # at once, and one delta of all of them is not a stream.
        tick = self._tick_s if per_token > 0 else 0.0
        woke = -math.inf
        i = 0
        while i < len(units):
            due = start + model_script.unit_offset(i, ttft, per_token)
            # Sleep even at zero delay: an instant model must still let other tasks run. With
            # a tick, wake at most once a tick and give out every unit due by then together:
            # one timer per tick rather than one per token.
            await asyncio.sleep(max(0.0, max(due, woke + tick) - loop.time()))
            woke = loop.time()
            # Unit i is due now; with a tick, so is every unit up to the last due by ``woke``.
            end = i + 1
            if tick:
                end = max(
                    end, min(len(units), model_script.units_due(woke - start, ttft, per_token))
                )
            text = [u.text for u in units[i:end] if isinstance(u, model_script.TextPiece)]
            i = end
            if text:
                yield TextDelta("".join(text))
        if cut is not None:
            raise ModelStreamError(f"scripted model stream broke off after {cut} units")
        for call in reply.calls:
            yield ToolCallEvent(ToolCall(call.id, call.name, call.arguments))
        yield Finish(reply.finish, reply.prompt_tokens, reply.completion_tokens)

    async def aclose(self) -> None:
        return None


class MockModel(_ScriptedModel):
    """Instant, deterministic answers (see ``replica.model_script`` for the directives)."""

    def __init__(self) -> None:
        super().__init__(0.0, 0.0, None)

    def __repr__(self) -> str:
        return "MockModel()"


class StubModel(_ScriptedModel):
    """The mock's script with a declared latency; plain replies are ``tokens`` words long.
    ``tick_s`` above zero wakes the stream at most once a tick, with every token due by then in
    one delta (a real model's tokens arrive as the network delivers them, not on a timer each);
    zero gives each token at its own moment."""

    def __init__(
        self,
        ttft_s: float = 0.3,
        per_token_s: float = 0.012,
        tokens: int = 200,
        tick_s: float = 0.0,
    ) -> None:
        if tokens < 1:
            raise ValueError("tokens must be at least 1")
        super().__init__(ttft_s, per_token_s, tokens, tick_s)
        self.ttft_s = ttft_s
        self.per_token_s = per_token_s
        self.tokens = tokens
        self.tick_s = tick_s

    def __repr__(self) -> str:
        return (
            f"StubModel(ttft_s={self.ttft_s}, per_token_s={self.per_token_s}, "
            f"tokens={self.tokens}, tick_s={self.tick_s})"
        )


# --- OpenAI-compatible client -------------------------------------------------------------

_MAX_ERROR_BODY = 64 * 1024
_DRAIN_S = 0.5
_DRAIN_BYTES = 64 * 1024
_MAX_READ_WINDOW_S = 1.0
_PORTS = {"http": 80, "https": 443}
_USER_AGENT = "beyond-fleet-replica"
# Servers quote keys back in their 401 text (OpenAI masks the middle); none of it is shown.
_KEYLIKE = re.compile(r"\b(?:sk|key)-[A-Za-z0-9_*.\-]{6,}")
_HEADER_SAFE = re.compile(r"[\x21-\x7e]{1,4096}")


class _Secret:
    """Holds the API key so that no repr, log line or traceback local shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<redacted>"


class OpenAIModel:
    """Streaming chat completions against an OpenAI-compatible server.

    The API key is read once, at construction, from the environment variable ``api_key_env``;
    when it is unset or empty no ``Authorization`` header is sent (local servers need none).
    User-info in ``base_url`` is sent as Basic credentials instead, as httpx did.
    ``timeout`` bounds connecting, sending, and each wait for the next chunk of the stream.

    Requests go through ``replica.http1_client`` (pooled keep-alive connections, the answer
    read as it arrives, ``https`` verified against certifi's bundle or ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR``, as httpx verified it). That client knows no proxies: when
    ``HTTP_PROXY``, ``HTTPS_PROXY`` or ``ALL_PROXY`` applies to the endpoint (``NO_PROXY``
    considered, at construction), requests go through httpx instead
    (``replica.http_proxied``), which honours them.

    ``read_window_s`` above zero reads the stream at most once per that window, so the
    tokens a server sends meanwhile arrive as one read (see ``Response.pace``). The replica
    passes its coalescing window (``--coalesce-ms``): text that arrives within a window of the
    last frame waits for the window's end anyway, so reading once a window delays nothing
    (but a burst past ``--coalesce-max-chars`` waits for the window's end too); with
    coalescing off the stream is read as it arrives.
    """

    def __init__(
        self,
        base_url: str,
        model: str = "gpt-4o-mini",
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60.0,
        *,
        read_window_s: float = 0.0,
    ) -> None:
        url = httpx.URL(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("base_url must be an http(s) URL with a host")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not 0 <= read_window_s <= _MAX_READ_WINDOW_S:
            raise ValueError(f"read_window_s must be from 0 to {_MAX_READ_WINDOW_S:g}")
        self.model = model
        self.api_key_env = api_key_env
        self._read_window_s = read_window_s
        endpoint = url.copy_with(path=url.path + "/chat/completions")
        self._shown_url = str(url.copy_with(username=None, password=None))
        key = os.environ.get(api_key_env, "")
        if key and not _HEADER_SAFE.fullmatch(key):
            # Checked here so the failure names the variable, never the value.
            raise ConfigError(f"environment variable {api_key_env} does not hold a usable key")
        self._key = _Secret(key) if key else None
        self._authorization = _authorization(endpoint, self._key)
        self._headers: tuple[tuple[str, str], ...] = (
            ("host", url.netloc.decode("ascii")),
            ("user-agent", _USER_AGENT),
            ("accept", "text/event-stream"),
            ("accept-encoding", "identity"),
            ("content-type", "application/json"),
        )
        self._url = str(endpoint)
        self._origin = Origin(
            url.scheme, url.raw_host.decode("ascii"), url.port or _PORTS[url.scheme]
        )
        self._target = endpoint.raw_path
        self._proxied: ProxiedClient | None = None
        if proxy_applies(url.scheme, url.host):
            self._proxied = ProxiedClient(timeout)
        self._pool = ConnectionPool(timeout, ssl_context=_ssl_context)

    def __repr__(self) -> str:
        key = "set" if self._key else "unset"
        return f"OpenAIModel({self._shown_url!r}, model={self.model!r}, key {key})"

    async def aclose(self) -> None:
        await self._pool.aclose()
        if self._proxied is not None:
            await self._proxied.aclose()

    async def stream(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], *, max_tokens: int
    ) -> AsyncIterator[ModelEvent]:
        body = model_wire.request_body(self.model, messages, tools, max_tokens=max_tokens)
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        # Failures are raised after the except clauses, not inside them, so no exception
        # carries an unredacted predecessor in __context__.
        failure: ModelError | None = None
        response: Response | ProxiedResponse | None = None
        try:
            response = await self._send(content.encode())
            if not 200 <= response.status < 300:
                raise await self._http_error(response)
            ctype = response.header("content-type") or ""
            if ctype.startswith("application/json"):
                raise ModelProtocolError(
                    f"model server {self._shown_url} answered JSON, not an event stream"
                )
            if _encoded(response):
                raise ModelProtocolError(
                    f"model server {self._shown_url} sent an encoded body it was not asked for"
                )
            response.pace(self._read_window_s)
            decoder = model_wire.SSEDecoder()
            assembler = model_wire.StreamAssembler()
            # Everything that has arrived since the last read at once: one step per read, and
            # the text of every token in it goes on as one delta.
            while chunk := await response.read():
                events: list[ModelEvent] = []
                for data in decoder.feed_bytes(chunk):
                    events += assembler.feed_data(data)
                    if assembler.done:
                        break
                for event in model_wire.merge_text(events):
                    yield event
                if assembler.done:
                    # What follows [DONE] (normally just the end of the body) is read so the
                    # connection can be reused; a server that keeps the stream open after it
                    # is cut off.
                    with contextlib.suppress(HTTPError, TimeoutError):
                        async with asyncio.timeout(_DRAIN_S):
                            await response.drain(_DRAIN_BYTES)
                    return
            for data in decoder.close():
                for event in assembler.feed_data(data):
                    yield event
            for event in assembler.end_of_stream():
                yield event
        except ModelError as exc:
            failure = self._redacted(exc)
        except TimeoutException as exc:
            failure = ModelTimeout(
                f"model server {self._shown_url} timed out ({type(exc).__name__})"
            )
        except ConnectError as exc:
            failure = ModelUnavailable(
                f"cannot connect to model server {self._shown_url} ({type(exc).__name__})"
            )
        except TransportError as exc:
            failure = ModelStreamError(
                f"connection to model server {self._shown_url} broke off ({type(exc).__name__})"
            )
        except HTTPError as exc:
            failure = ModelProtocolError(
                f"model server {self._shown_url} sent an unreadable response ({type(exc).__name__})"
            )
        finally:
            # An abandoned stream (the consumer's aclose) closes its connection here, at once;
            # one read to its end goes back to the pool.
            if response is not None:
                await response.aclose()
        if failure is not None:
            raise failure

    async def _send(self, content: bytes) -> Response | ProxiedResponse:
        headers = self._headers
        if self._authorization is not None:
            headers += (("authorization", self._authorization.reveal()),)
        if self._proxied is not None:
            direct = tuple(h for h in headers if h[0] != "host")  # httpx writes its own
            return await self._proxied.request(self._url, direct, content)
        return await self._pool.request(
            self._origin, http1_wire.encode_request("POST", self._target, headers, content)
        )

    async def _http_error(self, response: Response | ProxiedResponse) -> ModelHTTPError:
        raw = bytearray()
        while len(raw) < _MAX_ERROR_BODY and (chunk := await response.read()):
            raw += chunk
        detail = ""
        if not _encoded(response):
            detail = _redact(model_wire.error_detail(bytes(raw[:_MAX_ERROR_BODY])), self._key)
        retry_after = model_wire.retry_after_seconds(response.header("retry-after"))
        message = f"model server {self._shown_url} answered {response.status}"
        if detail:
            message += ": " + detail
        return ModelHTTPError(message, status=response.status, retry_after=retry_after)

    def _redacted(self, exc: ModelError) -> ModelError:
        text = str(exc)
        clean = _redact(text, self._key)
        if clean == text:
            return exc
        if isinstance(exc, ModelHTTPError):
            return ModelHTTPError(clean, status=exc.status, retry_after=exc.retry_after)
        return type(exc)(clean)


def _authorization(url: httpx.URL, key: _Secret | None) -> _Secret | None:
    """The ``Authorization`` value: Basic from the URL's user-info when it has any (httpx
    sent that over the bearer key), else the bearer key, else none."""
    if url.username or url.password:
        pair = f"{url.username}:{url.password}".encode()
        return _Secret("Basic " + base64.b64encode(pair).decode("ascii"))
    if key is not None:
        return _Secret("Bearer " + key.reveal())
    return None


def _encoded(response: Response | ProxiedResponse) -> bool:
    """A content coding the client did not ask for (it sends ``accept-encoding: identity``;
    httpx decodes the codings it asked for itself)."""
    if isinstance(response, ProxiedResponse):
        return False
    coding = (response.header("content-encoding") or "identity").strip().lower()
    return coding != "identity"


def _ssl_context() -> ssl.SSLContext:
    """Certificate and host name verification against the trust store httpx used:
    ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` when set, certifi's bundle otherwise. Made once per
    client, at its first ``https`` connection."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    return ssl.create_default_context(cafile=certifi.where())


def _redact(text: str, key: _Secret | None) -> str:
    if key is not None:
        text = text.replace(key.reveal(), "[redacted]")
    return _KEYLIKE.sub("[redacted]", text)


# --- specs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MockSpec:
    pass


@dataclass(frozen=True, slots=True)
class StubSpec:
    ttft_s: float = 0.3
    per_token_s: float = 0.012
    tokens: int = 200
    tick_s: float = 0.025  # the replica's default coalescing window: no frame waits on it


@dataclass(frozen=True, slots=True)
class OpenAISpec:
    base_url: str
    model: str = "gpt-4o-mini"
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0


ModelSpec: TypeAlias = MockSpec | StubSpec | OpenAISpec

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_STUB_TOKENS = 1_000_000


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse ``--model``: ``mock``, ``stub[:ttft=300ms,per_token=12ms,tokens=200,tick=25ms]`` or
    ``openai:URL[#model=NAME&key_env=VAR&timeout=60s]``."""
    kind, sep, rest = spec.strip().partition(":")
    if kind == "mock":
        if sep:
            raise ConfigError("--model mock takes no options")
        return MockSpec()
    if kind == "stub":
        return _parse_stub(spec.strip(), rest)
    if kind == "openai":
        return _parse_openai(rest)
    raise ConfigError(
        f"--model: unknown provider {kind[:32]!r}; expected mock, stub[:OPTIONS] or openai:URL"
    )


def _options(label: str, text: str, sep: str, allowed: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in text.split(sep) if text else []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise ConfigError(f"--model {label}: option {item!r} is not KEY=VALUE")
        if key not in allowed:
            raise ConfigError(
                f"--model {label}: unknown option {key!r} (known: {', '.join(allowed)})"
            )
        if key in options:
            raise ConfigError(f"--model {label}: option {key!r} given twice")
        options[key] = value.strip()
    return options


def _duration(label: str, key: str, value: str) -> float:
    match = _DURATION.fullmatch(value)
    if match is None:
        raise ConfigError(f"--model {label}: {key}={value!r} must be a duration like 300ms or 2s")
    number = float(match.group(1))
    return number / 1000 if match.group(2) == "ms" else number


def _parse_stub(spec: str, rest: str) -> StubSpec:
    options = _options(spec, rest, ",", ("ttft", "per_token", "tokens", "tick"))
    defaults = StubSpec()
    tokens = defaults.tokens
    if "tokens" in options:
        raw = options["tokens"]
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= _MAX_STUB_TOKENS:
            raise ConfigError(
                f"--model {spec}: tokens={raw!r} must be an integer from 1 to {_MAX_STUB_TOKENS}"
            )
        tokens = int(raw)
    return StubSpec(
        ttft_s=_duration(spec, "ttft", options["ttft"]) if "ttft" in options else defaults.ttft_s,
        per_token_s=(
            _duration(spec, "per_token", options["per_token"])
            if "per_token" in options
            else defaults.per_token_s
        ),
        tokens=tokens,
        tick_s=_duration(spec, "tick", options["tick"]) if "tick" in options else defaults.tick_s,
    )


def _parse_openai(rest: str) -> OpenAISpec:
    base, _, fragment = rest.partition("#")
    base = base.strip().rstrip("/")
    try:
        url = httpx.URL(base)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise ConfigError("--model openai:URL needs an http:// or https:// URL with a host")
    # The URL may carry user-info; messages name it only without that part.
    label = "openai:" + str(url.copy_with(username=None, password=None))
    options = _options(label, fragment, "&", ("model", "key_env", "timeout"))
    defaults = OpenAISpec(base_url=base)
    key_env = options.get("key_env", defaults.api_key_env)
    if not _ENV_NAME.fullmatch(key_env):
        raise ConfigError(f"--model: key_env={key_env!r} is not an environment variable name")
    timeout = defaults.timeout_s
    if "timeout" in options:
        timeout = _duration(label, "timeout", options["timeout"])
        if timeout <= 0:
            raise ConfigError("--model: timeout must be positive")
    return OpenAISpec(
        base_url=base,
        model=options.get("model", defaults.model),
        api_key_env=key_env,
        timeout_s=timeout,
    )


def make_provider(spec: ModelSpec | str, *, read_window_s: float = 0.0) -> ModelProvider:
    """Build the provider a ``--model`` value names. ``read_window_s``: how often at most an
    OpenAI-compatible stream is read (the replica's coalescing window; see ``OpenAIModel``)."""
    if isinstance(spec, str):
        spec = parse_model_spec(spec)
    if isinstance(spec, MockSpec):
        return MockModel()
    if isinstance(spec, StubSpec):
        return StubModel(spec.ttft_s, spec.per_token_s, spec.tokens, spec.tick_s)
    return OpenAIModel(
        spec.base_url,
        spec.model,
        spec.api_key_env,
        spec.timeout_s,
        read_window_s=read_window_s,
    )
