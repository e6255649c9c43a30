'''The chat prompt's input: line editing, history, and messages that span several lines.

Three ways to write a message of several lines (code, a long question):

- a block: a line that starts with `"""` opens it (text after the quotes is its first line), the
  lines that follow are taken as they are (indentation and empty lines kept), and a line that is
  only `"""` closes and sends it. `"""text"""` on one line is a block of one line. A block is
  always a message, never a slash command. Only a line of bare quotes closes it, so pasted Python
  with docstrings (`"""Doc."""`) stays inside;
- a trailing backslash: the line goes on, after a newline, on the next prompt line;
- a paste: terminals wrap a pasted text in bracketed-paste markers when the program asks for them,
  and GNU readline then inserts the whole text, newlines included, into the line: Enter sends it as
  one message. Python's `readline` module switches that mode off when it is imported (its own REPL
  wants pasted lines one by one), so every pasted line would be sent as a question of its own;
  `LineEditor` switches it back on. Editline (libedit, the `readline` of some Pythons on macOS) is
  left as it is: there a paste may arrive line by line, and a block is the way to send it whole.
'''

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apirctl.paths import dirs

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
HISTORY_LENGTH = 1000


@dataclass(frozen=True)
class Entry:
    """One complete input: a message to send, or (`command`) a slash command to run."""

    text: str
    command: bool = False


def _tidy(lines: list[str]) -> str:
    """Drop empty lines at both ends; one line left is stripped, several keep their indentation."""
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    kept = lines[start:end]
    return kept[0].strip() if len(kept) == 1 else "\n".join(kept)


class Composer:
    """Joins what the prompt returns into messages: blocks, backslash continuations and pastes.

    Each `feed` takes what one `input()` returned (several lines at once for a paste) and gives back
    the entries it completed, usually none or one.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._block = False
        self._continued = False

    @property
    def pending(self) -> bool:
        """A message is being written: the prompt shows the continuation prompt."""
        return self._block or self._continued

    @property
    def prompt(self) -> str:
        return CONTINUATION if self.pending else PROMPT

    def feed(self, text: str) -> list[Entry]:
        lines = text.split("\n")
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()  # the newline that ends most pastes
        done: list[Entry] = []
        for index, line in enumerate(lines):
            entry = self._line(line, more=index < len(lines) - 1)
            if entry is not None:
                done.append(entry)
        return done

    def _line(self, line: str, more: bool) -> Entry | None:
        if self._block:
            if line.strip() == BLOCK:
                return self._complete(command=False)
            self._lines.append(line)
            return None
        if not self._lines and line.lstrip().startswith(BLOCK):
            rest = line.lstrip()[len(BLOCK) :]
            if rest.rstrip().endswith(BLOCK):  # """one line"""
                self._lines.append(rest.rstrip()[: -len(BLOCK)])
                return self._complete(command=False)
            self._block = True
            if rest.strip():
                self._lines.append(rest)
            return None
        if more:  # a line of a paste: only its last line decides whether the message goes on
            self._lines.append(line)
            self._continued = True
            return None
        if line.endswith("\\"):
            self._lines.append(line[:-1])
            self._continued = True
            return None
        self._lines.append(line)
        return self._complete(command=True)

    def _complete(self, command: bool) -> Entry:
        text = _tidy(self._lines)
        self.cancel()
        return Entry(text, command=command and text.startswith("/"))

    def finish(self) -> Entry | None:
        """End of input (Ctrl-D) while a message is pending: it is complete as it stands."""
        if not self.pending:
            return None
        return self._complete(command=not self._block)

    def cancel(self) -> None:
        """Forget the pending message (Ctrl-C)."""
        self._lines = []
        self._block = False
        self._continued = False


def history_file() -> Path:
    """Where the interactive prompt keeps its line history across sessions."""
    return dirs().state / "chat_history"


class LineEditor:
    """Line editing, bracketed paste and persistent history through the stdlib `readline`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            import readline
        except ImportError:  # pragma: no cover - Windows without pyreadline
            self.readline: Any = None
            return
        self.readline = readline
        if "libedit" not in (readline.__doc__ or ""):
            readline.parse_and_bind("set enable-bracketed-paste on")
        readline.set_history_length(HISTORY_LENGTH)
        if path.exists():
            with suppress(OSError):
                readline.read_history_file(str(path))

    def save(self) -> None:
        if self.readline is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(str(self.path))
        except OSError:
            pass
