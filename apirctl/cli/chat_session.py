"""The interactive `apirctl chat`: a prompt loop over a `chat.Conversation`, with slash commands.

The conversation's state and the commands' changes live in `apirctl.chat`; this module reads what is
typed (`chat.composer`), shows the answers as they stream (`chat_view`) and prints everything else.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.markup import escape

from apirctl.chat import Conversation, Reply, format_stats
from apirctl.chat.composer import Composer, LineEditor, history_file
from apirctl.cli.chat_view import AnswerView, MarkdownView, PlainView
from apirctl.errors import ApirctlError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.status import Status

HELP = '''\
/clear         forget the conversation (keeps the system prompt)
/system TEXT   set the system prompt (without TEXT: show it)
/stats         prompt and generation speed of the last answer
/set NAME VALUE  a sampling setting for the next answers: temp, seed, max-tokens, top-k, top-p
               (`/set parameter temperature 0.2` too); /set alone shows them
/image FILE    send this image with the next message (a vision model: served with its projector)
/exit          leave (also /quit, /bye or Ctrl-D)
Messages of several lines:
  """            on a line of its own opens a block; a line of """ alone sends it
  line \\         a backslash at the end of a line continues the message on the next one
  paste          pasted text, newlines included, is sent as one message on Enter
Ctrl-C stops the current answer (or drops a message being written); Up/Down recall earlier lines,
also from past sessions.'''


class Session:
    """The interactive chat: a prompt loop with multi-turn history and slash commands."""

    def __init__(self, conversation: Conversation, console: Console, out: TextIO | None = None,
                 history: Path | None = None, markdown: bool = False) -> None:
        self.conversation = conversation
        self.console = console
        self.out = out or sys.stdout
        self.history_path = history
        self.markdown = markdown

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave the session. Its argument may span lines."""
        chat = self.conversation
        name, *rest = line.split(maxsplit=1)
        name = name.lower()
        arg = rest[0].strip() if rest else ""
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/clear":
            chat.clear()
            self.console.print("[dim]conversation cleared[/]")
        elif name == "/system":
            if arg:
                chat.set_system(arg)
                self.console.print("[dim]system prompt set[/]")
            else:
                shown = escape(chat.system) if chat.system else "(none)"
                self.console.print(f"[dim]system prompt:[/] {shown}", markup=True, highlight=False)
        elif name == "/stats":
            self.console.print(format_stats(chat.last), markup=False, highlight=False)
        elif name == "/set":
            self.console.print(chat.set(arg), markup=False, highlight=False)
        elif name == "/image":
            self.console.print(chat.attach(arg), markup=False, highlight=False)
        elif name in ("/help", "/?"):
            self.console.print(HELP, markup=False, highlight=False)
        else:
            self.console.print(f"unknown command {name}; /help lists them", markup=False, highlight=False)
        return True

    def _view(self) -> AnswerView:
        return MarkdownView(self.console) if self.markdown else PlainView(self.out)

    def ask(self, text: str) -> Reply | None:
        """Send one user turn and show the answer as it streams; None when it failed (the error shown)."""
        status: Status | None = None
        started = time.monotonic()
        view = self._view()

        def stop_spinner() -> None:
            nonlocal status
            if status is not None:
                status.stop()
                status = None

        def on_loading(elapsed: float) -> None:
            if status is not None:
                status.update(f"[dim]the model is loading… {elapsed:.0f} s[/]")

        def on_reasoning(_: str) -> None:
            if status is not None:
                status.update(f"[dim]thinking… {time.monotonic() - started:.0f} s[/]")

        def on_token(piece: str) -> None:
            stop_spinner()
            view.token(piece)

        try:
            status = self.console.status("[dim]waiting for the server…[/]", spinner="dots")
            status.start()
            reply = self.conversation.send(text, on_token, on_loading=on_loading, on_reasoning=on_reasoning)
        except KeyboardInterrupt:  # before the turn was sent (e.g. while the spinner started)
            reply = Reply(content="", interrupted=True)
        except ApirctlError as exc:
            stop_spinner()
            view.abort()
            self.console.print(f"[bold red]error:[/] {escape(exc.message)}")
            if exc.hint:
                self.console.print(f"[dim]hint: {escape(exc.hint)}[/]")
            return None
        finally:
            stop_spinner()
        view.finish(reply.content)
        if reply.interrupted:
            self.console.print("[dim]\\[interrupted][/]")
        return reply

    def banner(self, where: str) -> None:
        self.console.print(
            f"[bold]apirctl chat[/] with {escape(where)}\n"
            '[dim]/help for commands · """ or a line ending in \\ for several lines\n'
            "Ctrl-C stops an answer · /exit or Ctrl-D quits[/]"
        )

    def run(self) -> None:
        """The loop: read input (readline editing, several lines when asked), run a command or ask,
        until /exit or end of input."""
        editor = LineEditor(self.history_path or history_file())
        composer = Composer()
        try:
            while True:
                try:
                    entries = composer.feed(input(composer.prompt))
                except EOFError:
                    self.out.write("\n")
                    pending = composer.finish()  # Ctrl-D in a block sends it; at the prompt it quits
                    if pending is None:
                        break
                    entries = [pending]
                except KeyboardInterrupt:
                    self.out.write("\n")
                    if composer.pending:
                        composer.cancel()
                        self.console.print("[dim](message dropped)[/]")
                    else:
                        self.console.print("[dim](Ctrl-C cancels a line or an answer; /exit or Ctrl-D quits)[/]")
                    continue
                for entry in entries:
                    if not entry.text:
                        continue
                    if entry.command:
                        if not self.command(entry.text):
                            return
                        continue
                    try:
                        self.ask(entry.text)
                    except KeyboardInterrupt:  # a second Ctrl-C while the first one was being handled
                        self.out.write("\n")
                        self.console.print("[dim]\\[interrupted][/]")
        finally:
            editor.save()
