"""The chat APIs `ChatClient` speaks, one class each: where a turn goes, how it is written, and
how the answer (whole or streamed) is read back.

- `OpenAI`: `POST {base}/chat/completions`, SSE chunks with `choices[0].delta`, `[DONE]`
  (llama-server, vLLM, Ollama's `/v1`, most local servers).
- `Anthropic`: `POST {base}/messages` (the Messages API: llama-server serves it, as do Anthropic
  and the tools built on it), SSE events `content_block_delta` and `message_delta`, a top-level
  `system`, a required `max_tokens`, images as base64 blocks.

Both read into the same `Delta`, so the client's streaming loop, timings and errors are shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

Message = dict[str, Any]
Api = Literal["openai", "anthropic"]
APIS: tuple[Api, ...] = ("openai", "anthropic")

#: The Messages API requires a limit; Anthropic's own clients send one every time.
ANTHROPIC_DEFAULT_MAX_TOKENS = 4096
ANTHROPIC_VERSION = "2023-06-01"


@dataclass
class Delta:
    """What one streamed event (or a whole answer) adds to the reply."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None  # as OpenAI names it: prompt_tokens, completion_tokens
    timings: dict[str, Any] | None = None  # llama-server's own, when it sends them
    error: str | None = None
    done: bool = False  # the stream's end marker


class Dialect(Protocol):
    path: str

    def headers(self, api_key: str | None) -> dict[str, str]: ...

    def body(self, messages: list[Message], *, stream: bool, model: str | None, max_tokens: int | None,
             temperature: float | None, sampling: dict[str, Any]) -> dict[str, Any]: ...

    def event(self, data: str) -> Delta | None:
        """One SSE event's data, or None for an event that says nothing the reply keeps."""
        ...

    def whole(self, data: Any) -> Delta:
        """A non-streamed answer."""
        ...


def _json(data: str) -> dict[str, Any] | None:
    import json

    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_text(err: Any) -> str:
    message = err.get("message") if isinstance(err, dict) else err
    return str(message or err)


class OpenAI:
    path = "/chat/completions"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, messages: list[Message], *, stream: bool, model: str | None, max_tokens: int | None,
             temperature: float | None, sampling: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages, "stream": stream}
        if model:
            body["model"] = model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        return {**body, **sampling}

    def event(self, data: str) -> Delta | None:
        if data.strip() == "[DONE]":
            return Delta(done=True)
        chunk = _json(data)
        if chunk is None:
            return None
        if "error" in chunk:
            return Delta(error=_error_text(chunk["error"]))
        delta = Delta(model=chunk.get("model"),
                      usage=chunk["usage"] if isinstance(chunk.get("usage"), dict) else None,
                      timings=chunk["timings"] if isinstance(chunk.get("timings"), dict) else None)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            piece = choice.get("delta") or {}
            thought, text = piece.get("reasoning_content"), piece.get("content")
            delta.reasoning = thought if isinstance(thought, str) else ""
            delta.text = text if isinstance(text, str) else ""
            delta.finish_reason = choice.get("finish_reason") or None
        return delta

    def whole(self, data: Any) -> Delta:
        if not isinstance(data, dict):
            return Delta()
        delta = Delta(model=data.get("model"), usage=data["usage"] if isinstance(data.get("usage"), dict) else None,
                      timings=data["timings"] if isinstance(data.get("timings"), dict) else None)
        choices = data.get("choices") or []
        if choices and isinstance(choices[0], dict):
            message = choices[0].get("message") or {}
            delta.text = str(message.get("content") or "")
            delta.finish_reason = choices[0].get("finish_reason")
        return delta


def _anthropic_usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    named = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}
    return {k: v for k, v in named.items() if isinstance(v, int)} or None


def _anthropic_part(part: Any) -> Any:
    """An OpenAI content part as a Messages API block (images: a data URL becomes a base64 source)."""
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return part
    url = str((part.get("image_url") or {}).get("url", ""))
    header, _, data = url.partition(",")
    media_type = header.removeprefix("data:").removesuffix(";base64")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


class Anthropic:
    path = "/messages"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": api_key} if api_key else {})}

    def body(self, messages: list[Message], *, stream: bool, model: str | None, max_tokens: int | None,
             temperature: float | None, sampling: dict[str, Any]) -> dict[str, Any]:
        system = [str(m["content"]) for m in messages if m.get("role") == "system"]
        turns = [{**m, "content": [_anthropic_part(p) for p in m["content"]]} if isinstance(m.get("content"), list)
                 else m for m in messages if m.get("role") != "system"]
        body: dict[str, Any] = {"messages": turns, "stream": stream,
                                "max_tokens": max_tokens if max_tokens is not None else ANTHROPIC_DEFAULT_MAX_TOKENS}
        if model:
            body["model"] = model
        if system:
            body["system"] = "\n\n".join(system)
        if temperature is not None:
            body["temperature"] = temperature
        return {**body, **sampling}

    def event(self, data: str) -> Delta | None:
        event = _json(data)
        if event is None:
            return None
        kind = event.get("type")
        if kind == "error" or "error" in event and kind is None:
            return Delta(error=_error_text(event.get("error")))
        if kind == "message_start":
            message = event.get("message") or {}
            return Delta(model=message.get("model"), usage=_anthropic_usage(message.get("usage")))
        if kind == "content_block_delta":
            piece = event.get("delta") or {}
            if piece.get("type") == "text_delta" and isinstance(piece.get("text"), str):
                return Delta(text=piece["text"])
            if piece.get("type") == "thinking_delta" and isinstance(piece.get("thinking"), str):
                return Delta(reasoning=piece["thinking"])
            return None
        if kind == "message_delta":
            reason = (event.get("delta") or {}).get("stop_reason")
            return Delta(finish_reason=reason, usage=_anthropic_usage(event.get("usage")))
        if kind == "message_stop":
            return Delta(done=True)
        return None

    def whole(self, data: Any) -> Delta:
        if not isinstance(data, dict):
            return Delta()
        if data.get("type") == "error":
            return Delta(error=_error_text(data.get("error")))
        text = "".join(str(b.get("text", "")) for b in data.get("content") or []
                       if isinstance(b, dict) and b.get("type") == "text")
        return Delta(text=text, finish_reason=data.get("stop_reason"), model=data.get("model"),
                     usage=_anthropic_usage(data.get("usage")))


def dialect(api: str) -> Dialect:
    """The dialect of an API name (`--api`)."""
    if api == "anthropic":
        return Anthropic()
    return OpenAI()
