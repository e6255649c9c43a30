"""`ps --stats`' reading of llama-server's endpoints, on their formats."""

from __future__ import annotations

from apirctl.podman.servers import Server
from apirctl.serve import stats

METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 42
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 31.5
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3
# HELP process_cpu_seconds_total Another exporter's metric.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 7
"""


def test_metrics_are_llama_servers_unlabelled_samples() -> None:
    assert stats.parse_metrics(METRICS) == {"prompt_tokens_total": 42.0, "predicted_tokens_seconds": 31.5}


def test_throughput_is_counted_tokens_over_counted_seconds() -> None:
    values = {"tokens_predicted_total": 90.0, "tokens_predicted_seconds_total": 3.0, "prompt_tokens_total": 5.0}
    assert stats._rate(values, "tokens_predicted_total", "tokens_predicted_seconds_total") == 30.0
    assert stats._rate(values, "prompt_tokens_total", "prompt_seconds_total") is None  # no time counted yet


def test_kv_use_counts_each_slots_prompt_and_generated_tokens() -> None:
    slots = [
        {"id": 0, "n_ctx": 2048, "n_prompt_tokens": 30, "next_token": [{"n_decoded": 8}]},
        {"id": 1, "n_ctx": 2048},  # never used
        {"id": 2, "n_ctx": 2048, "n_prompt_tokens": True, "next_token": "garbage"},  # not numbers: not counted
    ]
    assert stats.kv_use(slots) == (38, 6144)
    figures = stats.ServerStats(name="s", kv_tokens=38, kv_size=6144)
    assert figures.kv_ratio is not None and abs(figures.kv_ratio - 38 / 6144) < 1e-12
    assert stats.ServerStats(name="s").kv_ratio is None


def test_a_stopped_or_unreachable_server_is_a_problem_not_an_error() -> None:
    stopped = Server(name="a", id="1", model="m", transport="none", url="http://127.0.0.1:9/v1", state="exited",
                     health="-", port=9)
    assert stats.collect(stopped).problem == "not running (exited)"
    running = stopped.model_copy(update={"state": "running"})
    problem = stats.collect(running, timeout=0.5).problem
    assert problem is not None and problem.startswith("unreachable")


def _metrics(generated: int, seconds: float, busy: int) -> str:
    return (f"llamacpp:tokens_predicted_total {generated}\nllamacpp:tokens_predicted_seconds_total {seconds}\n"
            f"llamacpp:prompt_tokens_total 10\nllamacpp:prompt_seconds_total 1\n"
            f"llamacpp:requests_processing {busy}\nllamacpp:requests_deferred 0\n")


def test_a_routers_figures_are_its_running_models_asked_without_loading_or_waking_any() -> None:
    import httpx

    asked: list[tuple[str, str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        model, autoload = request.url.params.get("model", ""), request.url.params.get("autoload", "")
        asked.append((request.url.path, model, autoload))
        if model == "gone":  # unloaded between the listing and the asking
            return httpx.Response(400, json={"error": {"code": 400, "message": "model is not loaded"}})
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"n_ctx": 512, "n_prompt_tokens": 20, "next_token": [{"n_decoded": 5}]}])
        figures = {"a": (30, 3.0, 1), "b": (10, 2.0, 0)}[model]
        return httpx.Response(200, text=_metrics(*figures))

    server = Server(name="r", id="1", model="a,b,c,gone", transport="none", url="http://127.0.0.1:9/v1",
                    state="running", health="ok", port=9, router=True,
                    models={"a": "loaded", "b": "sleeping", "c": "unloaded", "gone": "loaded"})
    with httpx.Client(base_url=server.base, transport=httpx.MockTransport(answer)) as client:
        found = stats._router_stats(server, client)
    # the unloaded model is not asked; the sleeping one's slots are not asked (that would wake it)
    assert sorted(asked) == sorted([("/metrics", "a", "false"), ("/slots", "a", "false"), ("/metrics", "b", "false"),
                                    ("/metrics", "gone", "false")])
    assert [(m.name, m.state, m.tokens_generated) for m in found.models] == [("a", "loaded", 30), ("b", "sleeping", 10)]
    assert found.models[0].kv_tokens == 25 and found.models[1].kv_tokens is None
    assert found.problem is None and found.tokens_generated == 40 and found.busy_slots == 1
    assert found.generation_tps == 40 / 5.0  # their tokens over their time, not an average of their rates
    assert (found.kv_tokens, found.kv_size, found.slots) == (25, 512, 1)

    idle = server.model_copy(update={"models": {"c": "unloaded"}})
    with httpx.Client(base_url=server.base, transport=httpx.MockTransport(answer)) as client:
        assert stats._router_stats(idle, client).problem == "no model loaded"
