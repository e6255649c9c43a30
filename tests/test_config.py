"""Settings precedence (defaults < config file < APIRCTL_* < flags) and bad values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apirctl import config
from apirctl.errors import ApirctlError
from apirctl.paths import dirs


def write_config(text: str) -> Path:
    path = dirs().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_set() -> None:
    loaded = config.load(environ={})
    assert loaded.settings.port == 1234
    assert loaded.settings.host_ip == "127.0.0.1"
    assert set(loaded.sources.values()) == {"default"}


def test_each_layer_overrides_the_one_below() -> None:
    path = write_config('port = 2000\nctx_size = 1024\ndefault_model = "file-model"\n')
    env = {"APIRCTL_PORT": "3000", "APIRCTL_CTX_SIZE": "2048"}
    loaded = config.load({"port": 4000}, environ=env)
    assert loaded.settings.port == 4000 and loaded.sources["port"] == "command line"
    assert loaded.settings.ctx_size == 2048 and loaded.sources["ctx_size"] == "environment"
    assert loaded.settings.default_model == "file-model"
    assert loaded.sources["default_model"] == f"config file {path}"
    assert loaded.sources["ngl"] == "default"


def test_flags_set_to_none_do_not_override() -> None:
    write_config("port = 2000\n")
    assert config.load({"port": None}, environ={}).settings.port == 2000


def test_bad_value_names_key_and_layer() -> None:
    with pytest.raises(ApirctlError) as info:
        config.load(environ={"APIRCTL_PORT": "80"})
    assert "'port'" in info.value.message and "environment" in info.value.message


def test_unknown_key_in_config_file_is_named() -> None:
    write_config("prot = 2000\n")
    with pytest.raises(ApirctlError, match="unknown key 'prot'"):
        config.load(environ={})


def test_broken_toml_is_a_clear_error() -> None:
    write_config("port = = 2\n")
    with pytest.raises(ApirctlError, match="config file"):
        config.load(environ={})


def test_aliases_from_env_are_json() -> None:
    loaded = config.load(environ={"APIRCTL_MODEL_ALIASES": '{"tiny": "/m/tiny.gguf"}'})
    assert loaded.settings.model_aliases == {"tiny": "/m/tiny.gguf"}
    with pytest.raises(ApirctlError, match="not a JSON object"):
        config.load(environ={"APIRCTL_MODEL_ALIASES": "{nope"})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "apirctl", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_config_show_json_reports_sources() -> None:
    write_config("rpc_port = 50100\n")
    proc = run_cli("config", "show", "--json", env={"APIRCTL_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["settings"]["rpc_port"] == {"value": 50100, "source": f"config file {dirs().config_file}"}
    assert data["settings"]["threads"] == {"value": 3, "source": "environment"}


def test_config_show_bad_env_is_one_line_error() -> None:
    proc = run_cli("config", "show", env={"APIRCTL_PORT": "not-a-port"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("apirctl: error: invalid setting 'port'")


def test_apirctl_home_moves_every_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIRCTL_HOME", str(tmp_path / "h"))
    monkeypatch.delenv("APIRCTL_CACHE_DIR")
    found = dirs()
    for path in (found.config, found.data, found.cache, found.state):
        assert path.is_relative_to(tmp_path / "h")


def test_config_set_validates_writes_and_unset_removes() -> None:
    proc = run_cli("config", "set", "rpc_port", "50100")
    assert proc.returncode == 0, proc.stderr
    assert config.load(environ={}).settings.rpc_port == 50100
    assert run_cli("config", "set", "rpc_cache", "false").returncode == 0
    assert run_cli("config", "set", "model_aliases", '{"tiny": "/m/t.gguf"}').returncode == 0
    loaded = config.load(environ={})
    assert loaded.settings.rpc_cache is False and loaded.settings.model_aliases == {"tiny": "/m/t.gguf"}
    before = dirs().config_file.read_text()
    bad = run_cli("config", "set", "port", "80")
    assert bad.returncode == 1 and "invalid value '80' for port" in bad.stderr and "Traceback" not in bad.stderr
    assert dirs().config_file.read_text() == before  # a rejected value changes nothing
    unknown = run_cli("config", "set", "prot", "1")
    assert unknown.returncode == 1 and "unknown setting 'prot'" in unknown.stderr
    assert run_cli("config", "unset", "rpc_port").returncode == 0
    assert config.load(environ={}).settings.rpc_port == 50052
