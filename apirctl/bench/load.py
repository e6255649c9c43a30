"""Serving load: streamed chat requests against an OpenAI-compatible endpoint, per concurrency level.

Each level sends at most `requests` requests with `concurrency` of them in flight and
stops at `time_limit` seconds whatever happens (requests still running then are
cancelled and counted as errors), so a slow or stuck server cannot hang a benchmark.

Measured per request from the stream: time to first token (TTFT, from sending the
request to the first content chunk), inter-token latency (the gaps between content
chunks) and output tokens/s after the first token. Per level: the p50/p95 of those,
total output tokens/s and completed requests/s over the level's wall time, and errors.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from apirctl import serve
from apirctl.bench import system
from apirctl.bench.results import LevelResult, Run, new_id, now_iso
from apirctl.errors import ApirctlError

#: Called with (concurrency, finished requests, requests) as requests finish.
LoadProgressFn = Callable[[int, int, int], None]

_WORDS = ("the", "river", "carries", "light", "stone", "past", "quiet", "fields", "while", "birds", "count",
          "slow", "clouds", "over", "green", "hills", "and", "old", "roads", "bend", "toward", "a", "small",
          "town", "where", "people", "share", "bread", "and", "stories")


@dataclass(frozen=True)
class LoadParams:
    concurrency: tuple[int, ...] = (1, 4)
    requests: int = 8
    prompt_tokens: int = 128
    max_tokens: int = 64
    time_limit: float = 300.0
    request_timeout: float = 120.0

    def validate(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ApirctlError("--concurrency needs positive integers, e.g. 1,4,8")
        if self.requests < 1:
            raise ApirctlError("--requests must be at least 1")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ApirctlError("--prompt-tokens and --max-tokens must be at least 1")
        if self.time_limit <= 0 or self.request_timeout <= 0:
            raise ApirctlError("time limits must be positive")


def parse_concurrency(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ApirctlError(f"--concurrency {text!r}: expected integers separated by commas, e.g. 1,4,8") from None
    if not values or any(v < 1 for v in values):
        raise ApirctlError(f"--concurrency {text!r}: expected positive integers, e.g. 1,4,8")
    return values


def prompt_text(tokens: int, label: str = "") -> str:
    """About `tokens` tokens of plain words (common English words are mostly one token each), opening
    with `label`: a label no other request has makes the prompt new to the server from its first words,
    so that its prompt cache cannot answer it and the time to first token includes the prompt's."""
    words = [_WORDS[i % len(_WORDS)] for i in range(max(tokens - 8, 1))]
    opening = f"Request {label}. " if label else ""
    return opening + "Continue this text without stopping: " + " ".join(words)


def base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/`, `http://h:p/v1` and `.../v1/chat/completions` all give `http://h:p`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ApirctlError(f"--url {url!r}: expected an http:// or https:// address")
    for suffix in ("/chat/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    duration: float = 0.0
    #: from the stream's usage, where the server reports it
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None

    @property
    def decode_tps(self) -> float | None:
        """Output tokens/s after the first token (the generation speed the user sees)."""
        span = sum(self.gaps)
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


async def model_name(client: httpx.AsyncClient, base: str) -> str | None:
    """The served model's id from /v1/models; also proves the endpoint is up."""
    try:
        resp = await client.get(f"{base}/v1/models", timeout=30.0)
    except httpx.TimeoutException:
        raise ApirctlError(f"{base} did not answer /v1/models within 30 s",
                           hint="is the server still loading its model? `apirctl ps` shows its health") from None
    except httpx.HTTPError as exc:
        raise ApirctlError(f"cannot reach {base}: {type(exc).__name__}: {exc}".rstrip(": "),
                           hint="start a server with `apirctl serve MODEL`, or check --url") from None
    if resp.status_code != 200:
        raise ApirctlError(f"{base}/v1/models answered HTTP {resp.status_code}: not an OpenAI-compatible server?")
    try:
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (ValueError, KeyError, IndexError, AttributeError, TypeError):
        return None


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return str(delta.get("content") or delta.get("reasoning_content") or "")


async def one_request(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> RequestResult:
    """Send one streamed chat request and time its chunks."""
    start = time.perf_counter()
    last: float | None = None
    result = RequestResult(ok=False)
    usage_tokens: int | None = None
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace").strip().replace("\n", " ")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if "error" in chunk:
                    result.error = f"server error: {json.dumps(chunk['error'])[:200]}"
                    return result
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    result.prompt_tokens, result.cached_prompt_tokens = _prompt_usage(usage)
                if _content(chunk):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.gaps.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return result
    result.duration = time.perf_counter() - start
    result.tokens = usage_tokens if usage_tokens is not None else chunks
    if chunks == 0:
        result.error = "the stream carried no tokens"
        return result
    result.ok = True
    return result


def _prompt_usage(usage: dict[str, Any]) -> tuple[int | None, int | None]:
    """Prompt tokens and, where the server counts them (llama-server, vLLM), those it took from its cache."""
    def count(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return count(usage.get("prompt_tokens")), cached


async def run_level(client: httpx.AsyncClient, base: str, model: str | None, concurrency: int,
                    params: LoadParams, on_progress: LoadProgressFn | None = None) -> LevelResult:
    # every request's prompt opens with a label of its own, this level's and this run's: a server's prompt
    # cache (llama-server keeps each slot's last prompt, and more in memory) would otherwise answer all but
    # the first request of each slot by evaluating a token, and the times to first token would hide prompts
    run_label = secrets.token_hex(4)
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,  # llama-server and vLLM: always generate max_tokens, so runs compare
    }
    if model:
        body["model"] = model
    results: list[RequestResult] = []
    issued = 0
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def worker() -> None:
        nonlocal issued
        while issued < params.requests:
            issued += 1
            prompt = prompt_text(params.prompt_tokens, f"{run_label}-{concurrency}-{issued}")
            results.append(await one_request(client, base,
                                             body | {"messages": [{"role": "user", "content": prompt}]}))
            if on_progress:
                on_progress(concurrency, len(results), params.requests)

    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, params.requests))]
    _done, pending = await asyncio.wait(tasks, timeout=params.time_limit)
    timed_out = bool(pending)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    wall = loop.time() - start
    cancelled = issued - len(results)
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    per_request = [tps for r in ok if (tps := r.decode_tps) is not None]
    tokens = sum(r.tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached_counts = [r.cached_prompt_tokens for r in ok if r.cached_prompt_tokens is not None]
    sample = failed[0].error if failed else (f"{cancelled} request(s) cancelled at the {params.time_limit:.0f} s "
                                             "time limit" if cancelled else None)
    return LevelResult(
        concurrency=concurrency,
        requests=issued,
        completed=len(ok),
        errors=len(failed) + cancelled,
        error_sample=sample,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p95_ms=_ms(percentile(ttfts, 95)),
        itl_p50_ms=_ms(percentile(gaps, 50)),
        itl_p95_ms=_ms(percentile(gaps, 95)),
        output_tps_per_request=(sum(per_request) / len(per_request)) if per_request else None,
        output_tps_total=tokens / wall if wall > 0 else None,
        request_throughput=len(ok) / wall if wall > 0 else None,
        output_tokens=tokens,
        prompt_tokens=sum(prompt_counts) if len(prompt_counts) == len(ok) and ok else None,
        cached_prompt_tokens=sum(cached_counts) if len(cached_counts) == len(ok) and ok else None,
        wall_s=wall,
        timed_out=timed_out,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


async def _run(url: str, params: LoadParams, on_progress: LoadProgressFn | None) -> tuple[str | None,
                                                                                          list[LevelResult]]:
    base = base_url(url)
    limits = httpx.Limits(max_connections=max(params.concurrency) + 2,
                          max_keepalive_connections=max(params.concurrency) + 2)
    timeout = httpx.Timeout(params.request_timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await model_name(client, base)
        levels = []
        for conc in params.concurrency:
            levels.append(await run_level(client, base, model, conc, params, on_progress))
    return model, levels


def run(url: str, params: LoadParams, on_progress: LoadProgressFn | None = None) -> tuple[str | None,
                                                                                        list[LevelResult]]:
    """Run every concurrency level in order; returns the served model's id and the levels."""
    params.validate()
    base_url(url)
    return asyncio.run(_run(url, params, on_progress))


def bench(url: str, params: LoadParams, on_progress: LoadProgressFn | None = None,
          label: str | None = None) -> Run:
    """A serving run, ready to print and save, with the same system description as llama-bench runs."""
    served, levels = run(url, params, on_progress)
    return Run(
        id=new_id(), created=now_iso(), kind="serving",
        model=label or (served.rsplit("/", 1)[-1] if served else base_url(url)),
        params={"url": base_url(url), "concurrency": list(params.concurrency), "requests": params.requests,
                "prompt_tokens": params.prompt_tokens, "max_tokens": params.max_tokens,
                "time_limit": params.time_limit},
        system=system.collect(), levels=levels,
    )


def running_server_url(name: str | None = None) -> str:
    """The API address of an apirctl inference server: the one named, else the only one running."""
    return serve.find_server(name).url
