"""`errors.tail`, the one helper that quotes the end of a tool's output (a one-line reason or a log's last lines)."""

from __future__ import annotations

from pathlib import Path

from apirctl import errors
from apirctl.errors import tail


def test_one_line_is_the_last_non_blank_one_stripped() -> None:
    assert tail("first\n  Error: the last word  \n\n   \n") == "Error: the last word"
    assert tail(None, default="(no output)") == "(no output)"
    assert tail(" \n\n", default="no output") == "no output"


def test_several_lines_keep_their_indentation_and_drop_blank_ones() -> None:
    text = "a\nDevices:\n  CUDA0: H100\n\n  CPU: host   \nlast\n"
    assert tail(text, 3) == "  CUDA0: H100\n  CPU: host\nlast"
    assert tail(text, 100).splitlines()[0] == "a"


def test_a_telling_line_wins_over_the_farewell_in_any_case() -> None:
    text = "loading\nGGML_ASSERT(buf) failed\nthe library was unloaded\n"
    assert tail(text, telling=("ggml_assert",)) == "GGML_ASSERT(buf) failed"
    assert tail(text, telling=("nothing matches",)) == "the library was unloaded"


def test_a_file_is_read_from_its_end(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text("x" * (errors.TAIL_BYTES * 2) + "\nerror: the compiler stopped\n")
    assert tail(log) == "error: the compiler stopped"
    assert tail(tmp_path / "missing.log", default="no output") == "no output"


def test_nothing_else_in_the_package_picks_lines_from_the_end() -> None:
    """The helpers this replaced (`last_line`, `_tail`, `log_tail`, `_telling_line`, `stderr_tail()`) stay gone:
    a slice of split lines from the end, outside `errors.py`, is one of them coming back."""
    package = Path(errors.__file__).parent
    found = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py")) if path.name != "errors.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if "splitlines()[-" in line or "def last_line" in line or "def _tail" in line or "def log_tail" in line]
    assert found == []
