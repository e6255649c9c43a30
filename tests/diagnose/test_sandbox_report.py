"""The selftest report of the host servers' sandbox, as `apirctl doctor` reads it."""

from __future__ import annotations

import json

from apirctl.diagnose import sandbox


def line(**fields: object) -> str:
    data = {"who": "apir-host", "entered": True, "seccomp": True, "landlock_abi": 7, "fsize": 0, "memory": 0,
            "threads": True, "memfd": True, "self": True,
            "actions": [{"action": "fork", "denied": True, "errno": 1},
                        {"action": "execve", "denied": True, "errno": 1}]}
    data.update(fields)
    return json.dumps(data)


def test_every_attempt_denied_is_ok() -> None:
    report = sandbox.parse("apir-host", 0, "apir-host sandbox: fork  denied\n" + line() + "\n", "")
    assert report.ok and report.allowed == [] and len(report.attempts) == 2


def test_an_allowed_attempt_a_missing_layer_or_a_broken_need_is_not_ok() -> None:
    allowed = line(actions=[{"action": "fork", "denied": False, "errno": 0}])
    assert sandbox.parse("s", 1, allowed, "").allowed == ["fork"]
    assert not sandbox.parse("s", 1, allowed, "").ok
    assert not sandbox.parse("s", 0, line(landlock_abi=0), "").ok
    assert not sandbox.parse("s", 0, line(threads=False), "").ok
    assert not sandbox.parse("s", 0, line(self=False), "").ok


def test_no_report_is_an_error_with_the_last_line_and_warnings_are_kept() -> None:
    report = sandbox.parse("ggml-rpc-server", 1, "", "error: unknown argument: --sandbox-selftest=json\n")
    assert report.error is not None and "unknown argument" in report.error and not report.ok
    warned = sandbox.parse("s", 0, line(), "s: warning: this kernel has no Landlock: the sandbox runs without it\n")
    assert warned.warnings == ["s: warning: this kernel has no Landlock: the sandbox runs without it"]
