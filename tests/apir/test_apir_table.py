"""The function table, the generated headers and the CLI around them, against the pinned source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apirctl.apir import headers, protocol, table
from apirctl.cli import app


def test_table_indexes_are_dense_and_unique() -> None:
    fns = table.functions()
    assert [f.index for f in fns] == list(range(len(fns)))
    assert len({f.qualname for f in fns}) == len(fns) == 23
    assert table.by_name("backend_graph_compute").index == 22
    assert all(f.enabled for f in fns)
    assert "graph_optimize" not in {f.name for f in fns}  # disabled upstream: no command index


def test_deprecated_function_keeps_its_index_but_has_no_prototype() -> None:
    fn = table.by_name("buffer_type_is_host")
    assert fn.deprecated and fn.index == 13
    decl = headers.parse(headers.virtgpu_forward_header())
    assert "apir_buffer_type_is_host" not in decl.prototypes
    assert "backend_buffer_type_is_host" in headers.parse(headers.backend_dispatched_header()).prototypes


def test_parser_sees_through_whitespace_and_comments() -> None:
    a = headers.parse("/* x */ void   apir_f( struct virtgpu *gpu,\n size_t * free );")
    b = headers.parse("void apir_f(struct virtgpu* gpu, size_t *free); // y")
    assert a.prototypes == b.prototypes
    assert a.prototypes["apir_f"].params == (("virtgpu*", "gpu"), ("size_t*", "free"))
    c = headers.parse("void apir_f(struct virtgpu *gpu, size_t free);")
    assert c.prototypes != a.prototypes


@pytest.mark.integration
@pytest.mark.parametrize("name", headers.NAMES)
def test_generated_headers_declare_what_upstream_declares(name: str, virtgpu_src: Path) -> None:
    ours = headers.parse(headers.generate()[name])
    theirs = headers.parse((virtgpu_src / headers.UPSTREAM_PATHS[name]).read_text())
    assert ours == theirs
    assert ours.enum or ours.prototypes  # each header declares something we compared


@pytest.mark.integration
def test_a_changed_table_is_caught(virtgpu_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    changed = tuple(replace(f, frontend_return="int") if f.name == "get_type" else f for f in table.functions())
    monkeypatch.setattr(table, "functions", lambda: changed)
    diffs = headers.compare_with_source(virtgpu_src)
    assert any("apir_device_get_type" in d for d in diffs[headers.VIRTGPU_FORWARD])


@pytest.mark.integration
def test_protocol_constants_match_upstream_text(virtgpu_src: Path) -> None:
    text = (virtgpu_src / "backend/shared/api_remoting.h").read_text()
    defines = dict(re.findall(r"#define\s+(APIR_\w+)\s+(\w+)", text))
    assert int(defines["APIR_PROTOCOL_MAJOR"]) == protocol.PROTOCOL_MAJOR
    assert int(defines["APIR_PROTOCOL_MINOR"]) == protocol.PROTOCOL_MINOR
    assert int(defines["APIR_HANDSHAKE_MAGIC"], 16) == protocol.HANDSHAKE_MAGIC
    venus = (virtgpu_src / "virtgpu.h").read_text()
    assert f"VENUS_COMMAND_TYPE_LENGTH {protocol.VENUS_COMMAND_TYPE_LENGTH}" in venus


def test_cli_generate_writes_three_headers(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    result = CliRunner().invoke(app, ["apir", "generate", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)["written"]
    assert sorted(Path(p).name for p in written) == sorted(headers.NAMES)
    assert headers.parse((out / headers.APIR_BACKEND).read_text()).enum["APIR_BACKEND_DISPATCH_TABLE_COUNT"] == 23


def test_cli_generate_refuses_a_file_as_directory(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("keep me")
    result = CliRunner().invoke(app, ["apir", "generate", "--out", str(target)])
    assert result.exit_code != 0
    assert "not a directory" in str(result.exception) or "not a directory" in result.output
    assert target.read_text() == "keep me"


@pytest.mark.integration
def test_cli_check_agrees_with_pinned_source(virtgpu_src: Path) -> None:
    source = virtgpu_src.parent.parent.parent
    result = CliRunner().invoke(app, ["apir", "check", "--source", str(source), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"same": True, "differences": {n: [] for n in headers.NAMES}}


def test_cli_table_json_lists_every_function() -> None:
    result = CliRunner().invoke(app, ["apir", "table", "--json"])
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert [r["index"] for r in rows] == list(range(23))
    row = next(r for r in rows if r["name"] == "buffer_set_tensor")
    assert row["request"] == ["buffer:handle", "tensor:rpc_tensor", "res_id:res_id", "offset:size", "size:size"]


def test_docs_carry_the_generated_function_reference() -> None:
    from apirctl.apir import reference

    doc = (Path(__file__).resolve().parents[2] / "docs" / "apir.md").read_text()
    assert reference.section_of(doc) == reference.markdown(), "run `apirctl apir table --markdown` into docs/apir.md"
