"""benchmarks/gpu_serving.py's step figures: a row's llama_decode calls, read from llama-server's own
counters (`--metrics`) around the row, against the build's real llama-server on the CPU."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from apirctl.build import llamacpp
from tests.support.build_servers import llama_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_serving  # noqa: E402

pytestmark = pytest.mark.integration


PROMPT = "Count: one two three"


def _post(url: str, path: str, payload: dict) -> dict:
    req = urllib.request.Request(url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def _complete(url: str, n: int) -> None:
    done = _post(url, "/completion", {"prompt": PROMPT, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                      "cache_prompt": False})
    assert len(done["content"]) > 0


def test_a_rows_steps_are_the_servers_own_decode_calls(llama_build: llamacpp.Build, demo_model: Path,
                                                       tmp_path: Path) -> None:
    with llama_server(llama_build, demo_model, tmp_path, ["-ngl", "0", "--metrics"]) as (_, url, _log):
        host, port = url.removeprefix("http://").split(":")
        before = gpu_serving.server_counters(host, int(port))
        assert "n_decode_total" in before and "tokens_predicted_total" in before
        _complete(url, 12)
        _complete(url, 12)
        after = gpu_serving.server_counters(host, int(port))
        prompt_tokens = len(_post(url, "/tokenize", {"content": PROMPT, "add_special": True})["tokens"])
    steps = gpu_serving.step_figures(before, after, requests=2)
    # one prompt decode and 11 generation decodes a request (the first token comes from the prompt's)
    assert steps["steps"] == 24, (before, after)
    # over the time between the two reads, not over a window the caller names
    seconds = after["read_at_s"] - before["read_at_s"]
    assert steps["seconds"] == round(seconds, 3) > 0
    assert steps["steps_per_s"] == round(24 / seconds, 1) and steps["ms_per_step"] == round(seconds * 1e3 / 24, 3)
    assert steps["tokens_per_step"] == 1.0
    # neither request was answered from a cache: each evaluated its whole prompt
    assert steps["prompt_tokens"] == 2 * prompt_tokens and steps["prompt_tokens_per_request"] == prompt_tokens
    assert steps["prompt_tokens_cached"] == 0


def test_a_server_without_counters_gives_a_row_no_step_figures(tmp_path: Path) -> None:
    assert gpu_serving.server_counters("127.0.0.1", 9) == {}
    assert gpu_serving.step_figures({}, {"n_decode_total": 5.0, "read_at_s": 1.0}) == {}
    assert gpu_serving.step_figures({"n_decode_total": 1.0}, {"n_decode_total": 5.0}) == {}
    text = "# HELP llamacpp:n_decode_total calls\nllamacpp:n_decode_total 7\nllamacpp:x{a=\"b\"} 1\nother 3\n"
    assert gpu_serving.parse_counters(text) == {"n_decode_total": 7.0}
