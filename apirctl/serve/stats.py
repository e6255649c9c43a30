"""What a running llama-server is doing, from its own endpoints: `/metrics` (Prometheus text,
turned on by `serve`) and `/slots` (on by default in llama-server).

`apirctl ps --stats` shows these; a scraper can read `/metrics` itself (docs/serve.md). The
figures are counted since the server started (throughputs are its counters of tokens over its
counters of processing time); the KV-cache figure is the slots' tokens now against their context.

A router (several models) has no figures of its own: each loaded model is a llama-server of its own
behind it, and the router answers `/metrics?model=NAME` and `/slots?model=NAME` from that one
(`autoload=false`: asking loads no model). A model's counters start when it is loaded. The router's
row is the sum of its models' (throughputs: their tokens over their processing time).
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

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
    state: str | None = None  # a router's model: loaded, loading or sleeping; a one-model server: sleeping
    models: list[ServerStats] = Field(default_factory=list)  # a router: each model that is not unloaded

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
            if server.router:
                return _router_stats(server, client)
            sleeping = _sleeping(client)  # --idle-unload: its slots are not asked, as that would load it again
            found = _read(client, server.name, slots=not sleeping)
            return found.model_copy(update={"state": "sleeping"}) if sleeping and not found.problem else found
    except httpx.HTTPError as exc:
        return ServerStats(name=server.name, problem=f"unreachable: {exc}")


def _sleeping(client: httpx.Client) -> bool:
    """Whether a one-model server is asleep (`--idle-unload`): its /props says so without waking it."""
    props = client.get("/props")
    try:
        return props.status_code == 200 and props.json().get("is_sleeping") is True
    except (ValueError, AttributeError):
        return False


#: A router's models that run a llama-server of their own (an unloaded one has no figures).
RUNNING_STATES = ("loaded", "loading", "sleeping")


def _router_stats(server: Server, client: httpx.Client) -> ServerStats:
    """A router's figures: each running model's, asked through the router, and their sum."""
    models = []
    for model, state in server.models.items():
        if state not in RUNNING_STATES:
            continue
        # a sleeping model answers /metrics from its cache, but /slots would wake it: not asked
        found = _read(client, model, {"model": model, "autoload": "false"}, slots=state != "sleeping")
        if found.problem == _NOT_LOADED:  # unloaded since the router listed it
            continue
        models.append(found.model_copy(update={"state": state}))
    total = _sum(server.name, [m for m in models if not m.problem])
    if not models:
        return total.model_copy(update={"problem": "no model loaded"})
    if all(m.problem for m in models):  # the same reason for each (metrics off, the API key): the server's
        return total.model_copy(update={"problem": models[0].problem, "models": models})
    return total.model_copy(update={"models": models})


_NOT_LOADED = "not loaded"


def _read(client: httpx.Client, name: str, params: dict[str, str] | None = None, slots: bool = True) -> ServerStats:
    """One llama-server's figures (a router's model: `params` name it)."""
    metrics = client.get("/metrics", params=params)
    if metrics.status_code == 401:
        return ServerStats(name=name, problem="the server wants its API key")
    if params and metrics.status_code == 400 and "not loaded" in metrics.text:
        return ServerStats(name=name, problem=_NOT_LOADED)
    if metrics.status_code != 200:
        return ServerStats(name=name,
                           problem=f"no metrics (HTTP {metrics.status_code}): started without them or by another tool")
    try:
        values = parse_metrics(metrics.text)
    except ValueError as exc:
        return ServerStats(name=name, problem=f"unreadable metrics: {exc}")
    stats = ServerStats(
        name=name,
        generation_tps=_rate(values, "tokens_predicted_total", "tokens_predicted_seconds_total"),
        prompt_tps=_rate(values, "prompt_tokens_total", "prompt_seconds_total"),
        tokens_generated=_count(values.get("tokens_predicted_total")),
        prompt_tokens=_count(values.get("prompt_tokens_total")),
        busy_slots=_count(values.get("requests_processing")),
        deferred=_count(values.get("requests_deferred")),
    )
    listed = _slots(client.get("/slots", params=params)) if slots else None
    if listed is not None:
        used, size = kv_use(listed)
        stats = stats.model_copy(update={"slots": len(listed), "kv_tokens": used, "kv_size": size})
    return stats


def _sum(name: str, models: list[ServerStats]) -> ServerStats:
    """A router's figures: its models' added up; throughputs are their tokens over their processing time
    (each model's time is its tokens over its throughput)."""
    def total(field: str) -> int | None:
        values = [getattr(m, field) for m in models if getattr(m, field) is not None]
        return sum(values) if values else None

    def rate(tokens: str, tps: str) -> float | None:
        pairs = [(getattr(m, tokens), getattr(m, tps)) for m in models if getattr(m, tps)]
        seconds = sum(count / speed for count, speed in pairs)
        return sum(count for count, _ in pairs) / seconds if seconds else None

    return ServerStats(name=name, generation_tps=rate("tokens_generated", "generation_tps"),
                       prompt_tps=rate("prompt_tokens", "prompt_tps"), tokens_generated=total("tokens_generated"),
                       prompt_tokens=total("prompt_tokens"), busy_slots=total("busy_slots"), slots=total("slots"),
                       deferred=total("deferred"), kv_tokens=total("kv_tokens"), kv_size=total("kv_size"))


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
