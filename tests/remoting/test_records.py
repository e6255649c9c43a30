"""The records of host processes: written whole, read back leniently, ids never paths."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from apirctl.remoting.records import RecordStore


class _Proc(BaseModel):
    id: str
    pid: int


def test_a_record_round_trips_and_is_removed(tmp_path: Path) -> None:
    store = RecordStore(_Proc, lambda: tmp_path / "procs")
    assert store.all() == []  # no folder yet
    store.write("b2", _Proc(id="b2", pid=2))
    store.write("a1", _Proc(id="a1", pid=1))
    assert [r.pid for r in store.all()] == [1, 2]
    assert store.get("a1") == _Proc(id="a1", pid=1)
    assert not list((tmp_path / "procs").glob("*.tmp"))
    store.remove("a1")
    assert store.get("a1") is None and [r.id for r in store.all()] == ["b2"]


def test_damaged_files_and_path_like_ids_are_no_record(tmp_path: Path) -> None:
    folder = tmp_path / "procs"
    store = RecordStore(_Proc, lambda: folder)
    store.write("ok", _Proc(id="ok", pid=1))
    (folder / "half.json").write_text('{"id": "half", "pi')
    (folder / "wrong.json").write_text('{"id": "wrong", "pid": "not a number"}')
    (tmp_path / "outside.json").write_text('{"id": "x", "pid": 9}')
    assert [r.id for r in store.all()] == ["ok"]
    for bad in ("../outside", "", "a/b", "half"):
        assert store.get(bad) is None


def test_the_folder_follows_the_environment_at_each_use(tmp_path: Path) -> None:
    where = [tmp_path / "one"]
    store = RecordStore(_Proc, lambda: where[0])
    store.write("r", _Proc(id="r", pid=1))
    where[0] = tmp_path / "two"
    assert store.get("r") is None
    assert (tmp_path / "one" / "r.json").is_file()
