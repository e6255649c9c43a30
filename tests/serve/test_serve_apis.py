"""What a served model offers besides OpenAI chat: Prometheus metrics (`ps --stats`), the Anthropic
Messages API and OpenAI's Responses API, each through the real client package, against the real
image and the demo model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from apirctl.serve import stats
from tests.serve.conftest import apirctl

pytestmark = pytest.mark.integration


def _stats(name: str) -> dict[str, object]:
    done = apirctl("ps", "--stats", "--json")
    assert done.returncode == 0, done.stderr
    return next(s["stats"] for s in json.loads(done.stdout) if s["name"] == name)


def test_metrics_grow_with_a_chat_and_ps_stats_shows_them(served: dict[str, object], name: str) -> None:
    base = str(served["url"]).removesuffix("/v1")
    before = stats.parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
    shown_before = _stats(name)
    answer = apirctl("chat", "--url", str(served["url"]), "Say hello.", "--max-tokens", "8")
    assert answer.returncode == 0, answer.stderr
    after = stats.parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
    assert after["tokens_predicted_total"] > before["tokens_predicted_total"]
    assert after["prompt_tokens_total"] > before["prompt_tokens_total"]
    shown = _stats(name)
    assert shown["problem"] is None
    assert shown["tokens_generated"] == int(after["tokens_predicted_total"]) > int(shown_before["tokens_generated"])
    assert shown["generation_tps"] > 0 and shown["busy_slots"] == 0 and shown["deferred"] == 0
    # the slot kept the conversation: its tokens are in the KV cache, within the context
    assert 0 < shown["kv_tokens"] <= shown["kv_size"] and shown["slots"] >= 1
    table = apirctl("ps", "--stats")
    line = next(row for row in table.stdout.splitlines() if row.startswith(name))
    assert f"{shown['tokens_generated']}" in line and "%" in line


def test_a_server_without_metrics_says_so(podman: str, llama_image: str, demo_model: Path, name: str,
                                          port: int) -> None:
    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--no-metrics", "--json")
    assert done.returncode == 0, done.stderr
    try:
        assert "started without them" in str(_stats(name)["problem"])
    finally:
        apirctl("stop", name)


def test_the_anthropic_messages_api_with_the_anthropic_package(served: dict[str, object]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=str(served["url"]).removesuffix("/v1"), api_key="unused")
    message = client.messages.create(model=str(served["model"]), max_tokens=8,
                                     messages=[{"role": "user", "content": "Say hello."}])
    assert message.role == "assistant" and message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens > 0
    pieces = []
    with client.messages.stream(model=str(served["model"]), max_tokens=8,
                                messages=[{"role": "user", "content": "Count to three."}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text  # streamed, piece by piece


def test_the_responses_api_with_the_openai_package(served: dict[str, object]) -> None:
    import openai

    client = openai.OpenAI(base_url=str(served["url"]), api_key="unused")
    response = client.responses.create(model=str(served["model"]), input="Say hello.", max_output_tokens=8)
    assert response.output_text
    # the raw event stream (the package's `responses.stream()` helper wants a `content_index` on each
    # delta, which the pinned llama-server does not send: docs/serve.md)
    deltas, completed = [], None
    for event in client.responses.create(model=str(served["model"]), input="Count to three.", max_output_tokens=8,
                                         stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and len(deltas) > 1 and "".join(deltas) == completed.output_text


def test_chat_speaks_the_messages_api(served: dict[str, object]) -> None:
    """`chat --api anthropic`: the answer streams from /v1/messages; --json prints the Messages API's
    own object; the OpenAI default gives the same greedy answer."""
    url = str(served["url"])
    args = ("--url", url, "--max-tokens", "8", "--temp", "0", "--seed", "1", "Name a colour.")
    anthropic_answer = apirctl("chat", "--api", "anthropic", *args)
    openai_answer = apirctl("chat", *args)
    assert anthropic_answer.returncode == 0, anthropic_answer.stderr
    assert anthropic_answer.stdout.strip() and anthropic_answer.stdout == openai_answer.stdout
    whole = apirctl("chat", "--api", "anthropic", "--json", *args)
    assert whole.returncode == 0, whole.stderr
    message = json.loads(whole.stdout)
    assert message["type"] == "message" and message["content"][0]["text"].strip() == anthropic_answer.stdout.strip()
    bad = apirctl("chat", "--api", "gemini", *args)
    assert bad.returncode != 0 and "unknown API 'gemini'" in bad.stderr and "Traceback" not in bad.stderr


def test_ps_stats_leaves_a_sleeping_server_asleep(podman: str, llama_image: str, demo_model: Path, name: str,
                                                  port: int) -> None:
    """A server put to sleep by --idle-unload keeps its figures, and `ps --stats` does not load its model
    again (its /slots would: they are not asked)."""
    from tests.support.waiting import wait_for

    done = apirctl("serve", str(demo_model), "--transport", "none", "--port", str(port), "--name", name,
                   "--idle-unload", "12s", "--json")  # room for a loaded machine
    assert done.returncode == 0, done.stderr
    base = f"http://127.0.0.1:{port}"
    try:
        assert apirctl("chat", "--url", f"{base}/v1", "Say hello.", "--max-tokens", "4").returncode == 0
        awake = _stats(name)
        assert awake["state"] is None and awake["kv_tokens"] > 0

        def asleep() -> bool:
            return httpx.get(f"{base}/props", timeout=10).json().get("is_sleeping") is True

        wait_for("the server to sleep", asleep, timeout=60, interval=0.5)
        shown = _stats(name)
        assert shown["state"] == "sleeping" and shown["problem"] is None and shown["kv_tokens"] is None
        assert shown["tokens_generated"] == awake["tokens_generated"] > 0
        assert asleep(), "ps --stats woke it"
        row = next(line for line in apirctl("ps", "--stats").stdout.splitlines() if line.startswith(name))
        assert row.startswith(f"{name} (sleeping)")
    finally:
        apirctl("stop", name)
