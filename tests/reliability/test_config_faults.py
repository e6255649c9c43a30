"""Config corruption of every kind: one line naming the file and the line, a hint, no traceback; the
repair commands (`config unset`, `config edit`) work on the broken file; writes keep comments and
never leave a half-written or temporary file."""

from __future__ import annotations

import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from apirctl.paths import dirs
from apirctl.resident import config_path
from tests.support.sweep import NOBODY, as_user, sweep

NOT_UTF8 = b'port = 1300\ndefault_model = "caf\xe9"\n'


def write(data: bytes | str) -> Path:
    path = dirs().config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def settings() -> dict[str, object]:
    shown = sweep("config", "show", "--json").succeeds()
    return {k: v["value"] for k, v in json.loads(shown.stdout)["settings"].items()}


@pytest.mark.parametrize("command", [["config", "show"], ["config", "set", "port", "1400"], ["serve", "smollm2"],
                                     ["config", "unset", "port"], ["config", "show", "--json"]], ids=" ".join)
def test_non_utf8_file_is_one_line_naming_file_and_line(home: Path, command: list[str]) -> None:
    path = write(NOT_UTF8)
    out = sweep(*command).fails_cleanly(code=1, says=f"config file {path}, line 2: not UTF-8")
    assert out.error_lines[1].startswith("hint:") and "config edit" in out.error_lines[1]
    assert path.read_bytes() == NOT_UTF8  # nothing rewrote it


def test_doctor_reports_a_broken_config_without_a_traceback(home: Path) -> None:
    write(NOT_UTF8)
    out = sweep("doctor")
    assert out.code == 1 and "Traceback" not in out.stdout + out.stderr
    assert "line 2: not UTF-8" in out.stdout + out.stderr


@pytest.mark.parametrize(("text", "says"), [
    ('port = 1300\ndefault_model = "unterminated\n', "line 2: invalid TOML"),
    ("port = = 3\n", "line 1: invalid TOML"),
    ("port = 1300\n[model_aliases\n", "line 2: invalid TOML"),
    ("port = 1300\nprot = 3\n", "line 2: unknown key 'prot'"),
    ('ctx_size = 1\nport = "abc"\n', "line 2): Input should be a valid integer"),
    ("port = 80\n", "line 1): Input should be greater than 1024"),
    ('transport = "carrier-pigeon"\n', "line 1): Input should be"),
], ids=["unterminated-string", "double-equals", "broken-table", "unknown-key", "port-not-int", "port-low",
        "bad-choice"])
def test_invalid_config_names_the_line(home: Path, text: str, says: str) -> None:
    path = write(text)
    sweep("config", "show").fails_cleanly(code=1, says=says)
    assert path.read_text() == text


def test_a_directory_in_place_of_the_file(home: Path) -> None:
    dirs().config_file.mkdir(parents=True)
    sweep("config", "show").fails_cleanly(code=1, says="cannot read it")


def test_unreadable_file(home: Path, elsewhere: Path) -> None:
    """As a user who may not read it (root reads any file): the config file of that user's own home,
    mode 0; every command that reads settings says so in one line, and nothing rewrites it."""
    env = as_user(elsewhere)
    path = Path(env["APIRCTL_HOME"]) / "config" / "config.toml"
    path.parent.mkdir()
    path.write_text("port = 1300\n")
    for made in (path.parent, path):
        os.chown(made, NOBODY, NOBODY)
    path.chmod(0)
    for command in (["config", "show"], ["config", "set", "port", "1400"], ["serve", "smollm2"]):
        out = sweep(*command, env=env, user=NOBODY).fails_cleanly(code=1, says=f"config file {path}: cannot read it")
        assert out.error_lines[1].startswith("hint: check its permissions"), out.stderr
    path.chmod(0o600)
    assert path.read_text() == "port = 1300\n"


def test_empty_file_is_the_defaults(home: Path) -> None:
    write("")
    assert settings()["port"] == 1234


def test_unset_repairs_a_non_utf8_value(home: Path) -> None:
    path = write(NOT_UTF8)
    sweep("config", "unset", "default_model").succeeds()
    assert path.read_text() == "port = 1300\n"
    assert settings()["port"] == 1300


def test_unset_repairs_an_invalid_line_and_keeps_the_rest(home: Path) -> None:
    path = write("# mine\nport = 1300  # my port\nctx_size = = 8\n")
    sweep("config", "unset", "ctx_size").succeeds()
    assert path.read_text() == "# mine\nport = 1300  # my port\n"


def test_unset_of_a_key_that_is_not_the_fault_changes_nothing(home: Path) -> None:
    text = "port = 1300\nctx_size = = 8\n"
    path = write(text)
    sweep("config", "unset", "port").fails_cleanly(code=1, says="line 2: invalid TOML")
    assert path.read_text() == text


def test_unset_of_an_unknown_key_in_the_file_removes_it(home: Path) -> None:
    path = write("prot = 3\nport = 1300\n")
    sweep("config", "unset", "prot").succeeds()
    assert path.read_text() == "port = 1300\n"


def test_edit_repairs_the_file(home: Path, tmp_path: Path) -> None:
    path = write(NOT_UTF8)
    editor = tmp_path / "fix.sh"
    editor.write_text("#!/bin/sh\nprintf 'port = 1301\\n# fixed\\n' > \"$1\"\n")
    editor.chmod(0o755)
    sweep("config", "edit", env={"EDITOR": str(editor)}).succeeds()
    assert path.read_text() == "port = 1301\n# fixed\n"


def test_an_invalid_edit_is_not_saved(home: Path, tmp_path: Path) -> None:
    path = write("port = 1300\n")
    editor = tmp_path / "break.sh"
    editor.write_text("#!/bin/sh\nprintf 'port = \"abc\"\\n' > \"$1\"\n")
    editor.chmod(0o755)
    sweep("config", "edit", env={"EDITOR": str(editor), "VISUAL": ""}).fails_cleanly(code=1, says="not saved")
    assert path.read_text() == "port = 1300\n"


def test_a_missing_editor(home: Path) -> None:
    write("port = 1300\n")
    sweep("config", "edit", env={"EDITOR": "no-such-editor-here", "VISUAL": ""}).fails_cleanly(
        code=1, says="cannot start the editor")


def test_unicode_values_round_trip(home: Path) -> None:
    sweep("config", "set", "default_model", "café😀").succeeds()
    assert settings()["default_model"] == "café😀"
    sweep("config", "set", "model_aliases", '{"ünï": "/m/ü.gguf"}').succeeds()
    assert settings()["model_aliases"] == {"ünï": "/m/ü.gguf"}
    assert settings()["default_model"] == "café😀"


def test_set_and_unset_keep_comments_and_order(home: Path) -> None:
    path = write('# my settings\nctx_size = 2048  # small machine\n\n'
                 '# aliases below\n[model_aliases]\nt = "/m/t.gguf"\n')
    sweep("config", "set", "port", "1300").succeeds()
    sweep("config", "unset", "ctx_size").succeeds()
    text = path.read_text()
    assert "# my settings" in text and "# aliases below" in text and 't = "/m/t.gguf"' in text
    assert settings()["port"] == 1300 and settings()["model_aliases"] == {"t": "/m/t.gguf"}


def test_set_port_abc_writes_nothing_and_says_so(home: Path) -> None:
    out = sweep("config", "set", "port", "abc").fails_cleanly(code=1, says="invalid value 'abc' for port")
    assert "from config file" not in out.stderr and "unchanged" in out.stderr
    assert not dirs().config_file.exists()


def test_set_keeps_the_files_permissions(home: Path) -> None:
    path = write("port = 1300\n")
    path.chmod(0o640)
    sweep("config", "set", "ctx_size", "1024").succeeds()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_bad_environment_value_is_one_line(home: Path) -> None:
    sweep("config", "show", env={"APIRCTL_PORT": "abc"}).fails_cleanly(code=1, says="(from environment)")


def test_twenty_concurrent_sets_lose_nothing(home: Path) -> None:
    keys = {"port": "1300", "ctx_size": "1024", "ngl": "12", "threads": "2", "rpc_port": "50100",
            "health_timeout": "99.0", "build_jobs": "3", "rpc_cache": "false", "default_model": "tiny",
            "transport": "none"}
    jobs = [(k, v) for k, v in keys.items()] * 2
    with ThreadPoolExecutor(max_workers=10) as pool:
        for out in pool.map(lambda kv: sweep("config", "set", *kv), jobs):
            out.succeeds()
    found = settings()
    for key, value in keys.items():
        assert str(found[key]).lower() == value.lower(), key


def test_the_resident_switch_reads_the_same_config_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point finds the config file without platformdirs: it must be apirctl's file."""
    assert config_path() == str(dirs().config_file)
    monkeypatch.delenv("APIRCTL_HOME")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg"))
    assert config_path() == str(dirs().config_file)
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert config_path() == str(dirs().config_file)
