"""A streaming client for any OpenAI-compatible chat server, and a conversation's state.

The client speaks only the common subset (`POST {base}/chat/completions`, SSE with
`data:` lines and `[DONE]`), so `apirctl chat --url` works against llama-server, vLLM,
Ollama's `/v1` and the like; or the Anthropic Messages API (`dialects`: `chat --api anthropic`).
Two llama-server extras are used when present: the
`timings` object on the last chunk (for `/stats`), and `503` while the model loads
(we wait instead of failing: a server started a moment ago, with `serve --detach` or by
hand, answers on its port before its model is loaded).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

if "httpx" not in sys.modules:
    # Importing the httpx package also imports its own command-line client (click, rich, pygments)
    # whenever click is installed; chat never runs it, and it would triple the import time of
    # `apirctl chat -p`. A None entry makes that optional import fail, as if click were missing.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

import httpx  # noqa: E402

from apirctl.chat import dialects
from apirctl.chat.dialects import Delta
from apirctl.config import settings
from apirctl.errors import ApirctlError  # noqa: E402

Message = dict[str, Any]  # content: text, or a list of parts (text and images)

POLL_INTERVAL = 0.2  # seconds between retries while the server answers 503


def normalize_base_url(url: str) -> str:
    """Turn what a user pastes into an OpenAI base URL.

    `host:port` gets `http://`; a bare origin gets `/v1` (the convention of every
    OpenAI-compatible server); a pasted `.../chat/completions` endpoint is cut back to its base.
    """
    raw = url.strip()
    if not raw:
        raise ApirctlError("--url is empty", hint="example: --url http://127.0.0.1:1234/v1")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ApirctlError(f"invalid URL {url!r}: {exc}", hint="example: --url http://127.0.0.1:1234/v1") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApirctlError(
            f"invalid URL {url!r}: expected http(s)://HOST:PORT[/v1]",
            hint="example: --url http://127.0.0.1:1234/v1",
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ApirctlError(f"invalid URL {url!r}: bad port", hint="example: --url http://127.0.0.1:1234/v1") from None
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    if not path:
        path = "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass
class Timings:
    """Speed of one answer: the server's own numbers when it sends them, else ours."""

    first_token_s: float | None = None  # measured here: request sent -> first content token
    total_s: float = 0.0  # measured here: request sent -> stream closed
    prompt_tokens: int | None = None
    prompt_per_second: float | None = None
    predicted_tokens: int | None = None
    predicted_per_second: float | None = None
    cached_tokens: int | None = None
    from_server: bool = False

    @classmethod
    def from_llama_server(cls, data: dict[str, Any], first_token_s: float | None, total_s: float) -> Timings:
        """Read llama-server's `timings` (prompt_n, prompt_per_second, predicted_n, ...)."""

        def num(key: str) -> float | None:
            value = data.get(key)
            return float(value) if isinstance(value, (int, float)) else None

        def count(key: str) -> int | None:
            value = data.get(key)
            return int(value) if isinstance(value, (int, float)) else None

        return cls(
            first_token_s=first_token_s,
            total_s=total_s,
            prompt_tokens=count("prompt_n"),
            prompt_per_second=num("prompt_per_second"),
            predicted_tokens=count("predicted_n"),
            predicted_per_second=num("predicted_per_second"),
            cached_tokens=count("cache_n"),
            from_server=True,
        )


@dataclass
class Reply:
    """One assistant answer as it was streamed (possibly cut short by Ctrl-C)."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    timings: Timings = field(default_factory=Timings)
    interrupted: bool = False


def _error_message(response: httpx.Response) -> str:
    """The server's own words for a failure: OpenAI-style `{"error": {"message"}}` or the raw body."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip().splitlines()
        return text[0][:300] if text else response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    return json.dumps(body)[:300]


NOT_A_CHAT_MODEL = "the server's model does not chat: it is an embedding or reranking model"
NO_VISION = "the server's model takes no images: it was started without a vision projector"


def image_part(path: str | Path) -> dict[str, Any]:
    """An image file as an OpenAI content part (a data URL), for servers started with a projector."""
    import base64
    import mimetypes

    file = Path(path).expanduser()
    kind = mimetypes.guess_type(file.name)[0] or ""
    if not kind.startswith("image/"):
        raise ApirctlError(f"{file} is not an image file (png, jpeg, webp, gif …)")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ApirctlError(f"cannot read {file}: {exc.strerror or exc}") from None
    return {"type": "image_url", "image_url": {"url": f"data:{kind};base64,{base64.b64encode(data).decode()}"}}


def user_message(text: str, images: list[dict[str, Any]]) -> Message:
    """A user turn: plain text, or text and images as content parts."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


class ServerError(ApirctlError):
    """The server answered, but with an error (HTTP status or an error event in the stream)."""

    def __init__(self, base_url: str, message: str, status: int | None = None) -> None:
        where = f"HTTP {status}" if status else "error in stream"
        hint = None
        if status in (401, 403):
            hint = "the server wants an API key: pass --api-key KEY"
        elif status == 404:
            hint = f"is {base_url} an OpenAI-compatible base URL (usually ending in /v1)?"
        if "logits computation" in message or "does not support chat" in message:  # llama-server's words
            message, hint = NOT_A_CHAT_MODEL, f"ask {base_url}/embeddings or {base_url}/rerank instead"
        elif "image input is not supported" in message:  # llama-server without a projector (--mmproj)
            message, hint = NO_VISION, ("serve a vision model with its projector: ollama:// and hf:// vision models "
                                        "bring one (apirctl inspect MODEL shows it)")
        super().__init__(f"server error ({where}): {message}", hint=hint)
        self.status = status


class StillLoading(ApirctlError):
    """The server kept answering 503 (model loading) past the timeout."""


CONNECT_TIMEOUT = 10.0
FIRST_BYTE_TIMEOUT = 300.0  # a long prompt on a CPU is processed before the first byte
STALL_TIMEOUT = 60.0


def _unreachable(base_url: str, exc: Exception) -> ApirctlError:
    reason = str(exc) or type(exc).__name__
    return ApirctlError(
        f"cannot reach {base_url}: {reason}",
        hint="is the server running? `apirctl ps` lists ours; start one with `apirctl serve`",
    )


def _sse_events(lines: Iterator[str]) -> Iterator[str]:
    """Yield the data of each server-sent event (data lines joined; comments and pings skipped)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


class ChatClient:
    """One connection (kept alive between turns) to an OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        load_timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        first_byte_timeout: float = FIRST_BYTE_TIMEOUT,
        stall_timeout: float = STALL_TIMEOUT,
        api: str = "openai",
    ) -> None:
        """`api` is the API spoken (`dialects.APIS`: openai, anthropic).

        Every request has three limits, so a server that accepts and never answers, or stops in
        the middle of an answer, is an error and never a hang: `connect_timeout` to connect,
        `first_byte_timeout` for the response to begin (prompt processing happens before it), and
        `stall_timeout` between two pieces of a streamed answer."""
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.sampling: dict[str, Any] = {}  # more request fields: seed, top_k, top_p (`/set`)
        self._load_timeout = load_timeout
        self.connect_timeout, self.first_byte_timeout = connect_timeout, first_byte_timeout
        self.stall_timeout = stall_timeout
        self.dialect = dialects.dialect(api)
        headers = {"Accept": "text/event-stream, application/json", **self.dialect.headers(api_key)}
        # No TLS context for plain-http servers (the usual loopback case): building one loads the CA
        # bundle, which costs more than the whole request. Redirects are not followed, so a plain-http
        # client never meets TLS.
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(connect=connect_timeout, read=first_byte_timeout, write=30.0, pool=connect_timeout),
            verify=self.base_url.startswith("https:"),
        )

    @property
    def load_timeout(self) -> float:
        """How long to wait for a loading model: given, else the `health_timeout` setting.

        Read only when a server actually answers 503, so a chat with a ready server never pays
        for loading the settings.
        """
        if self._load_timeout is None:
            self._load_timeout = settings().health_timeout
        return self._load_timeout

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def models(self) -> list[str]:
        """Model ids from `GET {base}/models`."""
        try:
            response = self._http.get(f"{self.base_url}/models")
        except httpx.HTTPError as exc:
            raise self._failure(exc, started=False) from None
        if response.status_code >= 400:
            raise ServerError(self.base_url, _error_message(response), response.status_code)
        try:
            data = response.json().get("data", [])
            return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError):
            return []

    def context_size(self) -> int | None:
        """The tokens one conversation may hold on this server: llama-server's `GET /props` (its
        per-slot `n_ctx`, beside the base URL's `/v1`); None from a server that does not say."""
        origin = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        try:
            response = self._http.get(f"{origin}/props")
            n_ctx = response.json().get("default_generation_settings", {}).get("n_ctx")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None

    def require_context(self, tokens: int) -> str | None:
        """Fail when the server's context is smaller than `tokens`; a notice when it cannot be known.

        The context size is the server's setting (it sizes the KV cache when the model loads), so a
        client can only check it, never change it.
        """
        have = self.context_size()
        hint = f"the context size is the server's setting: `apirctl serve MODEL --ctx-size {tokens}` (or `run`)"
        if have is None:
            return f"{self.base_url} does not report its context size; --ctx-size {tokens} is not checked"
        if have < tokens:
            raise ApirctlError(f"{self.base_url} has a context of {have} tokens, fewer than --ctx-size {tokens}",
                               hint=hint)
        return None

    def _body(
        self, messages: list[Message], stream: bool, max_tokens: int | None, temperature: float | None
    ) -> dict[str, Any]:
        return self.dialect.body(messages, stream=stream, model=self.model, max_tokens=max_tokens,
                                 temperature=temperature, sampling=self.sampling)

    def build_request(self, body: dict[str, Any]) -> httpx.Request:
        """The request of one turn for `body` (not sent): chat completions, or the Messages API."""
        return self._http.build_request("POST", f"{self.base_url}{self.dialect.path}", json=body)

    @contextmanager
    def _open(self, body: dict[str, Any], on_loading: Callable[[float], None] | None) -> Iterator[httpx.Response]:
        """POST the request; while the server answers 503 (loading), retry until `load_timeout`.

        A request without a model that the server refuses (most servers other than
        llama-server need one) is retried once with the first id from `/models`.
        """
        start = time.monotonic()
        tried_model_lookup = False
        while True:
            request = self.build_request(body)
            try:
                response = self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise self._failure(exc, started=False) from None
            # The response has begun: from now on a read waits at most the stall limit. httpcore reads
            # the request's "timeout" extension again for each body read, so this applies to the rest.
            timeouts = request.extensions.get("timeout")
            if isinstance(timeouts, dict):
                timeouts["read"] = self.stall_timeout
            if response.status_code < 400:
                try:
                    yield response
                finally:
                    response.close()
                return
            try:
                response.read()
            except httpx.HTTPError as exc:
                raise self._failure(exc, started=True) from None
            finally:
                response.close()
            elapsed = time.monotonic() - start
            if response.status_code == 503:
                if elapsed >= self.load_timeout:
                    raise StillLoading(
                        f"{self.base_url} is still loading its model after {elapsed:.0f} s "
                        f"({_error_message(response)})",
                        hint="wait longer with --timeout SECONDS, or check `apirctl logs`",
                    )
                if on_loading:
                    on_loading(elapsed)
                time.sleep(POLL_INTERVAL)
                continue
            if (
                response.status_code in (400, 404, 422)
                and "model" not in body
                and not tried_model_lookup
                and "model" in _error_message(response).lower()
            ):
                tried_model_lookup = True
                found = self.models()
                if found:
                    self.model = found[0]
                    body = {**body, "model": self.model}
                    continue
            raise ServerError(self.base_url, _error_message(response), response.status_code)

    def complete(
        self,
        messages: list[Message],
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_loading: Callable[[float], None] | None = None,
    ) -> dict[str, Any]:
        """One non-streamed answer: the server's whole JSON response (for `--json`)."""
        body = self._body(messages, False, max_tokens, temperature)
        with self._open(body, on_loading) as response:
            try:
                response.read()
            except httpx.HTTPError as exc:
                raise self._failure(exc, started=True) from None
        try:
            data = response.json()
        except ValueError:
            raise ServerError(self.base_url, "the response is not JSON", response.status_code) from None
        if not isinstance(data, dict):
            raise ServerError(self.base_url, "the response is not a JSON object", response.status_code)
        return data

    def stream(
        self,
        messages: list[Message],
        on_token: Callable[[str], None],
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_loading: Callable[[float], None] | None = None,
        on_reasoning: Callable[[str], None] | None = None,
    ) -> Reply:
        """Stream one answer, calling `on_token` with each piece of text as it arrives.

        Ctrl-C (KeyboardInterrupt) stops this answer, not the caller: the connection is
        closed, which makes llama-server stop generating, and the partial reply comes back
        with `interrupted=True`.
        """
        body = self._body(messages, True, max_tokens, temperature)
        reply = Reply()
        start = time.monotonic()
        server_timings: dict[str, Any] | None = None
        pieces = 0
        try:
            with self._open(body, on_loading) as response:
                content_type = response.headers.get("content-type", "")
                if "text/event-stream" not in content_type:
                    # A server that ignored "stream": read the whole answer as one piece.
                    response.read()
                    deltas: Iterator[Delta | None] = iter([self.dialect.whole(response.json())])
                else:
                    deltas = (self.dialect.event(data) for data in _sse_events(response.iter_lines()))
                for delta in deltas:
                    if delta is None:
                        continue
                    if delta.error is not None:
                        raise ServerError(self.base_url, delta.error)
                    if delta.done:
                        break
                    server_timings = delta.timings or server_timings
                    if delta.usage:
                        reply.usage = {**(reply.usage or {}), **delta.usage}
                    reply.model = delta.model or reply.model
                    if delta.reasoning:
                        reply.reasoning += delta.reasoning
                        if on_reasoning:
                            on_reasoning(delta.reasoning)
                    if delta.text:
                        if reply.timings.first_token_s is None:
                            reply.timings.first_token_s = time.monotonic() - start
                        reply.content += delta.text
                        pieces += 1
                        on_token(delta.text)
                    reply.finish_reason = delta.finish_reason or reply.finish_reason
        except KeyboardInterrupt:
            reply.interrupted = True
        except httpx.HTTPError as exc:
            raise self._failure(exc, started=True) from None
        total = time.monotonic() - start
        first = reply.timings.first_token_s
        if server_timings and not reply.interrupted:
            reply.timings = Timings.from_llama_server(server_timings, first, total)
        else:
            reply.timings = self._client_timings(reply, first, total, pieces)
        return reply

    def _failure(self, exc: httpx.HTTPError, started: bool) -> ApirctlError:
        """What went wrong with a request, in the user's terms: no connection, no answer, a stalled
        or a cut answer (`started`: the response had begun)."""
        if isinstance(exc, httpx.ConnectTimeout):
            return ApirctlError(f"cannot reach {self.base_url}: no connection within {self.connect_timeout:g} s",
                                hint="is the server running? `apirctl ps` lists ours")
        if isinstance(exc, (httpx.ReadTimeout, httpx.PoolTimeout)) and not started:
            return ApirctlError(
                f"{self.base_url} accepted the request but sent no answer within {self.first_byte_timeout:g} s",
                hint="the server may be hung or overloaded: see `apirctl logs`; --first-byte-timeout waits longer")
        if isinstance(exc, httpx.ReadTimeout):
            return ApirctlError(f"the answer from {self.base_url} stalled: nothing for {self.stall_timeout:g} s",
                                hint="the server may be hung: see `apirctl logs`; --stall-timeout waits longer")
        if started and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            return ApirctlError(f"the connection to {self.base_url} closed in the middle of the answer",
                                hint="the server stopped or crashed: see `apirctl logs` and `apirctl ps`")
        return _unreachable(self.base_url, exc)

    @staticmethod
    def _client_timings(reply: Reply, first: float | None, total: float, pieces: int) -> Timings:
        """Our own estimate when the server sends no timings: tokens from `usage`, else stream pieces."""
        usage = reply.usage or {}
        generated = usage.get("completion_tokens")
        predicted = int(generated) if isinstance(generated, int) else pieces
        prompt = usage.get("prompt_tokens")
        gen_time = total - first if first is not None else None
        return Timings(
            first_token_s=first,
            total_s=total,
            prompt_tokens=int(prompt) if isinstance(prompt, int) else None,
            predicted_tokens=predicted,
            predicted_per_second=(predicted - 1) / gen_time if gen_time and predicted > 1 else None,
            from_server=False,
        )


def format_stats(reply: Reply | None) -> str:
    """The `/stats` text for the last answer."""
    if reply is None:
        return "no answer yet: ask something first"
    t = reply.timings
    lines = []
    if t.prompt_tokens is not None:
        speed = f", {t.prompt_per_second:.1f} tokens/s" if t.prompt_per_second else ""
        cached = f" (+{t.cached_tokens} cached)" if t.cached_tokens else ""
        lines.append(f"prompt:     {t.prompt_tokens} tokens{cached}{speed}")
    if t.predicted_tokens is not None:
        speed = f", {t.predicted_per_second:.1f} tokens/s" if t.predicted_per_second else ""
        lines.append(f"generation: {t.predicted_tokens} tokens{speed}")
    if t.first_token_s is not None:
        lines.append(f"first token after {t.first_token_s * 1000:.0f} ms, answer took {t.total_s:.2f} s")
    source = "server timings" if t.from_server else "measured by apirctl (the server sent no timings)"
    if reply.interrupted:
        source += "; the answer was interrupted"
    lines.append(f"({source})")
    return "\n".join(lines)


class Conversation:
    """A multi-turn chat's state: the history, the system prompt, the sampling settings and the images
    for the next turn. The interactive session (`apirctl.cli.chat_session`) reads what is typed and
    prints; the slash commands' changes happen here and come back as the text to show."""

    def __init__(self, client: ChatClient, system: str | None = None, max_tokens: int | None = None,
                 temperature: float | None = None) -> None:
        self.client = client
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.messages: list[Message] = []
        self.last: Reply | None = None
        self.images: list[dict[str, Any]] = []  # attached with /image, sent with the next message
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def set_system(self, text: str) -> None:
        self.system = text or None
        turns = [m for m in self.messages if m["role"] != "system"]
        self.messages = ([{"role": "system", "content": text}] if text else []) + turns

    def attach(self, path: str) -> str:
        """`/image FILE`: the image goes with the next message; the reply line."""
        if not path:
            return "usage: /image FILE"
        try:
            self.images.append(image_part(path))
        except ApirctlError as exc:
            return f"error: {exc.message}"
        return f"{len(self.images)} image(s) go with the next message"

    def set(self, arg: str) -> str:
        """`/set NAME VALUE` (or Ollama's `/set parameter NAME VALUE`): change a sampling setting; the reply line."""
        words = arg.split()
        if words[:1] == ["parameter"]:
            words = words[1:]
        if not words:
            shown = {"temp": self.temperature, "max-tokens": self.max_tokens, **self.client.sampling}
            return "  ".join(f"{k}={v}" for k, v in shown.items() if v is not None) or "(server defaults)"
        if len(words) != 2:
            return "usage: /set NAME VALUE, e.g. /set temp 0.2"
        key, value = words[0].lower().replace("_", "-"), words[1]
        key = {"temperature": "temp", "num-predict": "max-tokens", "n-predict": "max-tokens"}.get(key, key)
        kinds: dict[str, type] = {"temp": float, "seed": int, "max-tokens": int, "top-k": int, "top-p": float}
        if key not in kinds:
            return f"unknown setting {words[0]}; one of: {', '.join(kinds)}"
        try:
            number = kinds[key](value)
        except ValueError:
            return f"{key} takes a number, not {value!r}"
        if number < 0 or (key == "max-tokens" and number < 1):
            return f"{key} must be {'at least 1' if key == 'max-tokens' else 'positive'}"
        if key == "temp":
            self.temperature = float(number)
        elif key == "max-tokens":
            self.max_tokens = int(number)
        else:
            self.client.sampling[key.replace("-", "_")] = number
        return f"{key} = {number}"

    def send(self, text: str, on_token: Callable[[str], None], *, on_loading: Callable[[float], None] | None = None,
             on_reasoning: Callable[[str], None] | None = None) -> Reply:
        """One user turn, its answer streamed to `on_token`. The turn joins the history only with an
        answer: an `ApirctlError` leaves the history as it was; Ctrl-C keeps what had come."""
        self.messages.append(user_message(text, self.images))
        self.images = []
        pieces: list[str] = []

        def token(piece: str) -> None:
            pieces.append(piece)
            on_token(piece)

        try:
            reply = self.client.stream(self.messages, token, max_tokens=self.max_tokens,
                                       temperature=self.temperature, on_loading=on_loading,
                                       on_reasoning=on_reasoning)
        except KeyboardInterrupt:  # outside the stream's own handling (it returns an interrupted reply)
            reply = Reply(content="".join(pieces), interrupted=True)
        except ApirctlError:
            self.messages.pop()
            raise
        if reply.content:
            self.messages.append({"role": "assistant", "content": reply.content})
        else:
            self.messages.pop()
        self.last = reply
        return reply


def read_prompt(prompt: str | None, stdin: TextIO) -> str:
    """The one-shot question: `-p`, piped stdin, or both (the prompt, then the piped text)."""
    piped = None if stdin.isatty() else stdin.read()
    parts = [p for p in (prompt, piped.strip() if piped else None) if p]
    if not parts:
        raise ApirctlError(
            "nothing to ask: the prompt is empty",
            hint="pass -p TEXT, pipe text on stdin, or run `apirctl chat` in a terminal",
        )
    return "\n\n".join(parts)
