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


def _complete(url: str, n: int) -> None:
    body = json.dumps({"prompt": "Count: one two three", "n_predict": n, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert len(json.load(r)["content"]) > 0


def test_a_rows_steps_are_the_servers_own_decode_calls(llama_build: llamacpp.Build, demo_model: Path,
                                                       tmp_path: Path) -> None:
    with llama_server(llama_build, demo_model, tmp_path, ["-ngl", "0", "--metrics"]) as (_, url, _log):
        host, port = url.removeprefix("http://").split(":")
        before = gpu_serving.server_counters(host, int(port))
        assert "n_decode_total" in before and "tokens_predicted_total" in before
        _complete(url, 12)
        _complete(url, 12)
        after = gpu_serving.server_counters(host, int(port))
    steps = gpu_serving.step_figures(before, after, 2.0)
    # one prompt decode and 11 generation decodes a request (the first token comes from the prompt's)
    assert steps["steps"] == 24, (before, after)
    assert steps["steps_per_s"] == 12.0 and steps["ms_per_step"] == round(2000 / 24, 3)
    assert steps["tokens_per_step"] == 1.0


def test_a_server_without_counters_gives_a_row_no_step_figures(tmp_path: Path) -> None:
    assert gpu_serving.server_counters("127.0.0.1", 9) == {}
    assert gpu_serving.step_figures({}, {"n_decode_total": 5.0}, 30.0) == {}
    text = "# HELP llamacpp:n_decode_total calls\nllamacpp:n_decode_total 7\nllamacpp:x{a=\"b\"} 1\nother 3\n"
    assert gpu_serving.parse_counters(text) == {"n_decode_total": 7.0}
