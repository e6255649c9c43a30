"""How an answer appears in the interactive chat: streamed as plain text, then shown as Markdown.

Models answer in Markdown (code blocks, lists, bold), which reads badly as raw text; but rendering
Markdown while it streams means re-rendering a half-written document at every token, and waiting
for the whole answer delays the first token. So the answer streams as plain text, each piece as it
arrives, and once it is complete it is replaced by its Markdown rendering (rich's `Markdown`).

Replacing it is the hard part for answers taller than the terminal: text that has scrolled off the
screen cannot be erased, so re-rendering raw streamed output in place would leave the raw top of
a long answer in the scrollback above its rendered copy, and a rich `Live` Markdown view taller
than the screen repeats itself on every refresh. `MarkdownView` therefore streams the plain text
into a live region never taller than the screen: it shows the newest lines (like `tail -f`, the
older ones leave the region, not into the scrollback), and when the answer is complete the region
is erased and the rendered answer is printed once, in full, as normal output. Whatever the length,
the scrollback then holds each answer exactly once, rendered, and the end of the answer is on the
screen where the streamed text was. The cost: while a long answer streams, its beginning cannot be
scrolled back to; it comes back, rendered, when the answer is complete (or interrupted).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.live import Live

REFRESH_INTERVAL = 0.05  # seconds: at most 20 redraws a second of the streaming region


class AnswerView(Protocol):
    """Shows one answer: pieces while it streams, then the whole."""

    def token(self, piece: str) -> None: ...

    def finish(self, content: str) -> None:
        """The answer is complete (or was interrupted): `content` is all of it."""

    def abort(self) -> None:
        """The answer failed midway: keep what was shown and end its line."""


def markdown_wanted(requested: bool | None, console: Console) -> bool:
    """Markdown only where a person sees it: a real terminal, unless `--plain` said no.

    `--markdown` cannot make a pipe or a file get escape codes: those always get the plain text.
    """
    if requested is False:
        return False
    return bool(console.is_terminal and not console.is_dumb_terminal)


class PlainView:
    """The answer's text exactly as the server sent it, written as it comes."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.shown = ""

    def token(self, piece: str) -> None:
        self.shown += piece
        self.out.write(piece)
        self.out.flush()

    def finish(self, content: str) -> None:
        self._end_line()

    def abort(self) -> None:
        self._end_line()

    def _end_line(self) -> None:
        if self.shown and not self.shown.endswith("\n"):
            self.out.write("\n")
        self.out.flush()


class _Tail:
    """The newest lines of the streaming text, word-wrapped, one line fewer than the terminal's height.

    One fewer, because rich's `Live` ends its region with a newline when it stops: the whole region
    must stay on the screen to be erased. The size is the terminal's own: rich prefers `LINES` and
    `COLUMNS` from the environment, which may be stale (exported by a shell, or by a GNU readline in
    a parent process, before the terminal was resized); too tall a region would leave its top behind.
    """

    def __init__(self, view: MarkdownView) -> None:
        self.view = view

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.containers import Lines
        from rich.text import Text

        height, width = options.size.height, options.max_width
        try:
            real = os.get_terminal_size(console.file.fileno())
            height, width = min(height, real.lines), min(width, real.columns)
        except (AttributeError, ValueError, OSError):  # not a file with a descriptor: trust rich
            pass
        rows = max(1, height - 1)
        # Each source line is at least one row: the last `rows` of them are enough to wrap.
        tail = "\n".join(self.view.text.rsplit("\n", rows)[-rows:])
        wrapped = Text(tail).wrap(console, max(1, width))
        yield Lines(wrapped[-rows:])


class MarkdownView:
    """Streams the answer as plain text in a live region, then prints it rendered as Markdown."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.text = ""
        self._live: Live | None = None
        self._lock = threading.Lock()
        self._shown_at = 0.0
        self._timer: threading.Timer | None = None

    def token(self, piece: str) -> None:
        with self._lock:
            self.text += piece
            if self._live is None:
                from rich.live import Live

                self._live = Live(
                    _Tail(self), console=self.console, auto_refresh=False, transient=True,
                    redirect_stdout=False, redirect_stderr=False, vertical_overflow="visible",
                )  # fmt: skip
                self._live.start(refresh=True)  # the first token is shown at once
                self._shown_at = time.monotonic()
                return
            wait = REFRESH_INTERVAL - (time.monotonic() - self._shown_at)
            if wait <= 0:
                self._refresh()
            elif self._timer is None:  # pieces that come faster than the redraws are shown by a timer
                self._timer = threading.Timer(wait, self._on_timer)
                self._timer.daemon = True
                self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            self._refresh()

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()
            self._shown_at = time.monotonic()

    def _stop(self) -> None:
        """Erase the streaming region."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            live, self._live = self._live, None
        if live is not None:
            live.stop()

    def finish(self, content: str) -> None:
        self._stop()
        if content.strip():
            from rich.markdown import Markdown

            self.console.print(Markdown(content))

    def abort(self) -> None:
        self._stop()
        if self.text:
            from rich.text import Text

            self.console.print(Text(self.text))
