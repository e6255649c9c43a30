"""What a running llama-server is doing, from its own endpoints: `/metrics` (Prometheus text,
turned on by `serve`) and `/slots` (on by default in llama-server).

`apirctl ps --stats` shows these; a scraper can read `/metrics` itself (docs/serve.md). The
figures are counted since the server started (throughputs are its counters of tokens over its
counters of processing time); the KV-cache figure is the slots' tokens now against their context.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from apirctl.podman.servers import Server

PREFIX = "llamacpp:"


class ServerStats(BaseModel):
    """One server's figures; `problem` says why there are none (not running, metrics off, an API key)."""

    name: str
    generation_tps: float | None = None  # average generation throughput since start (tokens/s)
    prompt_tps: float | None = None  # average prompt throughput since start (tokens/s)
    tokens_generated: int | None = None
    prompt_tokens: int | None = None
    busy_slots: int | None = None  # requests being processed now
    slots: int | None = None
    deferred: int | None = None  # requests waiting for a free slot
    kv_tokens: int | None = None  # tokens held in the slots' KV cache now
    kv_size: int | None = None  # the slots' context, in tokens
    problem: str | None = None

    @property
    def kv_ratio(self) -> float | None:
        return self.kv_tokens / self.kv_size if self.kv_tokens is not None and self.kv_size else None


def parse_metrics(text: str) -> dict[str, float]:
    """llama-server's samples by name without the `llamacpp:` prefix (labelled samples are left out:
    the per-position speculative counters)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and not sample.labels:
                values[sample.name.removeprefix(PREFIX)] = sample.value
    return values


def kv_use(slots: Iterable[dict[str, object]]) -> tuple[int, int]:
    """(tokens in the KV cache, context size) over all slots: a slot holds its prompt and what it
    generated of its current or last task."""
    used = size = 0
    for slot in slots:
        size += _int(slot.get("n_ctx"))
        used += _int(slot.get("n_prompt_tokens"))
        for step in slot.get("next_token") or []:  # type: ignore[attr-defined]
            used += _int(step.get("n_decoded")) if isinstance(step, dict) else 0
    return used, size


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def collect(server: Server, api_key: str | None = None, timeout: float = 2.0) -> ServerStats:
    """The figures of one server, asked now; never raises (a problem is a field)."""
    if not server.running:
        return ServerStats(name=server.name, problem=f"not running ({server.state})")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=server.base, timeout=timeout, headers=headers) as client:
            metrics = client.get("/metrics")
            slots = client.get("/slots")
    except httpx.HTTPError as exc:
        return ServerStats(name=server.name, problem=f"unreachable: {exc}")
    if metrics.status_code == 401:
        return ServerStats(name=server.name, problem="the server wants its API key")
    if metrics.status_code != 200:
        return ServerStats(name=server.name,
                           problem=f"no metrics (HTTP {metrics.status_code}): started without them or by another tool")
    try:
        values = parse_metrics(metrics.text)
    except ValueError as exc:
        return ServerStats(name=server.name, problem=f"unreadable metrics: {exc}")
    stats = ServerStats(
        name=server.name,
        generation_tps=_rate(values, "tokens_predicted_total", "tokens_predicted_seconds_total"),
        prompt_tps=_rate(values, "prompt_tokens_total", "prompt_seconds_total"),
        tokens_generated=_count(values.get("tokens_predicted_total")),
        prompt_tokens=_count(values.get("prompt_tokens_total")),
        busy_slots=_count(values.get("requests_processing")),
        deferred=_count(values.get("requests_deferred")),
    )
    listed = _slots(slots)
    if listed is not None:
        used, size = kv_use(listed)
        stats = stats.model_copy(update={"slots": len(listed), "kv_tokens": used, "kv_size": size})
    return stats


def _rate(values: dict[str, float], tokens: str, seconds: str) -> float | None:
    """Tokens per second of processing since the server started, from two counters (llama-server's own
    throughput gauges cover only the time since the previous scrape, which any scraper resets)."""
    spent = values.get(seconds)
    return values[tokens] / spent if spent and tokens in values else None


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _slots(response: httpx.Response) -> list[dict[str, object]] | None:
    if response.status_code != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    return [s for s in data if isinstance(s, dict)] if isinstance(data, list) else None
