"""`apirctl chat`: a streaming chat with any OpenAI-compatible server."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from apirctl.serve import Server

EPILOG = (
    "Examples:\n\n"
    "  apirctl chat                          talk to the running server\n\n"
    "  apirctl chat 'Why is the sky blue?'   print only the answer\n\n"
    "  git diff | apirctl chat 'Review:'     the piped text follows the prompt\n\n"
    "  apirctl chat -p 8080                  the server on 127.0.0.1:8080\n\n"
    "  apirctl chat --url 127.0.0.1:8080     any OpenAI-compatible server\n\n"
    "  apirctl chat --plain                  raw answers, not rendered as Markdown\n\n"
    "  apirctl chat --image cat.png 'What is in the picture?'   a vision model\n\n"
    "  apirctl chat --temp 0.2 --seed 42     sampling settings for every answer\n\n"
    "  apirctl chat -c 8192                  fail unless the server holds 8192 tokens of context\n\n"
    "In the session: /clear, /system TEXT, /set temp 0.2, /image FILE, /stats, /help, /exit; "
    '\'"""\' or a line ending in \'\\\' '
    "for a message of several lines. Ctrl-C stops the answer."
)

_IMAGE = typer.Option(
    None, "--image", metavar="FILE",
    help="Send this image with the (first) message; repeatable. Needs a vision model (served with its projector).",
)
_WORDS = typer.Argument(
    None, metavar="PROMPT", show_default=False,
    help="Ask once, print only the answer and exit (stdin, if piped, is appended). Several words are one prompt.",
)


def _port(value: str | None) -> int | None:
    """-p is the port in every command; a prompt typed after it (the old `chat -p TEXT`) gets a
    message that says where the prompt goes now."""
    if value is None:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise typer.BadParameter(
            f"{value!r} is not a port. -p is the port, as in serve; the prompt is an argument: "
            "apirctl chat 'TEXT' (or --prompt 'TEXT')"
        )
    return int(value)


def chat(
    words: list[str] = _WORDS,
    url: str = typer.Option(
        None, "--url", help="OpenAI base URL (e.g. http://127.0.0.1:1234/v1). Default: the running server."
    ),
    port: str = typer.Option(
        None, "--port", "-p", metavar="PORT", callback=_port, show_default=False,
        help="The server published on this port of 127.0.0.1 (as `serve --port`): --url http://127.0.0.1:PORT/v1.",
    ),
    name: str = typer.Option(None, "--name", "-n", help="Which running apirctl server to use, when several run."),
    model: str = typer.Option(None, "--model", "-m", help="Model name sent to the server (default: the served one)."),
    system: str = typer.Option(None, "--system", "-s", help="System prompt."),
    prompt: str = typer.Option(
        None, "--prompt", help="The prompt as an option (for one that starts with '-'); the same as PROMPT."
    ),
    max_tokens: int = typer.Option(None, "--max-tokens", min=1, help="Stop each answer after N tokens."),
    temperature: float = typer.Option(None, "--temp", "--temperature", min=0.0, help="Sampling temperature."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed: the same seed and prompt repeat an answer."),
    ctx_size: int = typer.Option(
        None, "--ctx-size", "-c", min=1,
        help="Fail unless the server's context holds this many tokens. The context size is set by the server "
        "(`serve --ctx-size`); a client can only check it (llama-server's /props).",
    ),
    image: list[str] = _IMAGE,
    api_key: str = typer.Option(None, "--api-key", help="Bearer token, for servers started with an API key."),
    api: str = typer.Option(
        "openai", "--api", metavar="API",
        help="The API to speak: openai (chat completions, the default) or anthropic (the Messages API, at "
        "{URL}/messages; the key goes as x-api-key). llama-server serves both.",
    ),
    timeout: float = typer.Option(
        None, "--timeout", min=0.0, help="Seconds to wait while the server is still loading its model."
    ),
    first_byte_timeout: float = typer.Option(
        300.0, "--first-byte-timeout", min=0.1, help="Seconds to wait for an answer to begin (prompt processing)."
    ),
    stall_timeout: float = typer.Option(
        60.0, "--stall-timeout", min=0.1, help="Seconds a streamed answer may pause before it is an error."
    ),
    json_: bool = typer.Option(False, "--json", help="One-shot: print the server's whole JSON response."),
    markdown: bool = typer.Option(
        None,
        "--markdown/--plain",
        help="Interactive: show each finished answer rendered as Markdown (default on a terminal), or as "
        "plain text. A prompt, --json, pipes and files always get the plain text.",
    ),
) -> None:
    """Chat with a served model, streaming the answer as it is generated.

    Without --url or --port it talks to the running `apirctl serve` container.

    With a prompt (`apirctl chat 'TEXT'`) or a pipe on stdin it prints only the answer, for scripts.

    Otherwise it opens an interactive session with line editing and history kept across sessions.
    """
    from apirctl.chat import dialects
    from apirctl.errors import ApirctlError

    if api not in dialects.APIS:
        raise ApirctlError(f"unknown API {api!r}", hint=f"--api takes {' or '.join(dialects.APIS)}")
    if words and prompt is not None:
        raise ApirctlError("the prompt is given twice (as an argument and as --prompt)", hint="give one of them")
    if words:
        prompt = " ".join(words)
    chosen = [flag for flag, value in (("--url", url), ("--port", port), ("--name", name)) if value]
    if len(chosen) > 1:
        raise ApirctlError(f"{' and '.join(chosen)} exclude each other",
                           hint="--name picks one of our servers; --port one on this machine; --url any")
    if port:
        url = f"http://127.0.0.1:{port}/v1"
    interactive = prompt is None and sys.stdin.isatty() and not json_
    base_url, served_model = _target(url, name, interactive, model)
    talk(base_url, model or served_model, system=system, prompt=prompt, max_tokens=max_tokens,
         temperature=temperature, seed=seed, images=list(image or []), api_key=api_key, timeout=timeout,
         json_=json_, markdown=markdown, first_byte_timeout=first_byte_timeout, stall_timeout=stall_timeout,
         ctx_size=ctx_size, api=api)


def talk(base_url: str, model: str | None, *, system: str | None = None, prompt: str | None = None,
         max_tokens: int | None = None, temperature: float | None = None, seed: int | None = None,
         images: list[str] | None = None, api_key: str | None = None, timeout: float | None = None,
         first_byte_timeout: float = 300.0, stall_timeout: float = 60.0,
         json_: bool = False, markdown: bool | None = None, ctx_size: int | None = None,
         api: str = "openai") -> None:
    """The chat itself, with a server already chosen (`chat` and `run`)."""
    from apirctl import chat as lib
    from apirctl.cli.output import console, err_console, print_json
    from apirctl.errors import ApirctlError

    interactive = prompt is None and sys.stdin.isatty() and not json_
    parts = [lib.image_part(path) for path in images or []]  # a bad file fails before anything is sent
    with lib.ChatClient(base_url, model=model, api_key=api_key, load_timeout=timeout,
                        first_byte_timeout=first_byte_timeout, stall_timeout=stall_timeout, api=api) as client:
        if seed is not None:
            client.sampling["seed"] = seed
        if ctx_size is not None:
            notice = client.require_context(ctx_size)
            if notice:
                print(f"apirctl: notice: {notice}", file=sys.stderr)
        if interactive:
            from apirctl.cli.chat_session import Session
            from apirctl.cli.chat_view import markdown_wanted

            conversation = lib.Conversation(client, system=system, max_tokens=max_tokens, temperature=temperature)
            conversation.images = parts
            session = Session(conversation, console(), markdown=markdown_wanted(markdown, console()))
            session.banner(f"{client.model or 'the server'} at {client.base_url}")
            session.run()
            return
        question = lib.read_prompt(prompt, sys.stdin)
        messages = ([{"role": "system", "content": system}] if system else []) + [lib.user_message(question, parts)]
        waiting = _LoadingNotice(err_console)
        if json_:
            try:
                response = client.complete(messages, max_tokens, temperature, on_loading=waiting)
            finally:
                waiting.stop()
            print_json(response)
            return

        written = [""]

        def write(piece: str) -> None:
            waiting.stop()
            sys.stdout.write(piece)
            sys.stdout.flush()
            written[0] = piece or written[0]

        try:
            reply = client.stream(messages, write, max_tokens, temperature, on_loading=waiting)
        except ApirctlError:
            if written[0] and not written[0].endswith("\n"):  # a cut answer: the error on a line of its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        finally:
            waiting.stop()
        if reply.content and not reply.content.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        if reply.interrupted:
            print("apirctl: interrupted", file=sys.stderr)
            raise typer.Exit(130)


class _LoadingNotice:
    """While the server answers 503: a spinner on a terminal's stderr, else one line."""

    def __init__(self, console: Callable[[], Console]) -> None:
        self.console = console  # made on first use: rich's import is not paid by a ready server
        self.status: Any = None
        self.shown = False

    def __call__(self, elapsed: float) -> None:
        text = f"the model is still loading… {elapsed:.0f} s"
        console = self.console()
        if self.status is not None:
            self.status.update(text)
        elif console.is_terminal and not self.shown:
            self.status = console.status(text)
            self.status.start()
        elif not self.shown:
            console.print("apirctl: the model is still loading, waiting…")
        self.shown = True

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _target(url: str | None, name: str | None, interactive: bool, model: str | None = None) -> tuple[str, str | None]:
    """The base URL (and served model) to talk to: --url, or the running server found by its labels.

    With several servers running and a terminal to ask on, the user picks one. A server of several
    models needs --model, one of them.
    """
    if url:
        return url, None
    from apirctl import serve
    from apirctl.errors import ApirctlError

    try:
        server = serve.find_server(name)
    except ApirctlError:
        running = (
            []
            if name or not interactive
            else [s for s in serve.list_servers(probe_health=False) if s.state == "running"]
        )
        if len(running) < 2:
            raise
        server = _choose(running)
    refuse_non_chat(server)
    if server.router:
        _pick_of_several(server, model)
        return server.url, None
    return server.url, server.model if server.model != "?" else None


def _pick_of_several(server: Server, model: str | None) -> None:
    """A router server answers the model a request names: --model must be one it serves."""
    from apirctl.errors import ApirctlError

    names = server.model_names
    shown = ", ".join(names) or "see `apirctl ps`"
    if not model:
        raise ApirctlError(f"{server.name} serves several models ({shown})",
                           hint=f"pick one with --model, e.g. `apirctl chat --model {names[0] if names else 'NAME'}`")
    if names and model not in names:
        raise ApirctlError(f"{server.name} serves no model {model!r} (its models: {shown})",
                           hint="pick one of them with --model")


def refuse_non_chat(server: Server) -> None:
    """An embedding or reranking server does not chat: say so, and what it does answer."""
    from apirctl.errors import ApirctlError

    kind = server.kind
    if kind == "embedding":
        raise ApirctlError(f"{server.name} serves an embedding model ({server.model}): it does not chat",
                           hint=f"it answers POST {server.url}/embeddings; chat with a chat model")
    if kind == "reranking":
        raise ApirctlError(f"{server.name} serves a reranking model ({server.model}): it does not chat",
                           hint=f"it answers POST {server.url}/rerank; chat with a chat model")


def _choose(servers: list[Any]) -> Any:
    """Ask which of several running servers to chat with."""
    from apirctl.cli.output import console

    for number, server in enumerate(servers, 1):
        console().print(f"  {number}. {server.name}  {server.model}  {server.url}", markup=False)
    from apirctl.errors import ApirctlError

    while True:
        try:
            answer = input(f"Chat with which server? [1-{len(servers)}] ").strip()
        except EOFError:
            raise ApirctlError("no server chosen", hint="pick one with --name NAME") from None
        if answer.isdigit() and 1 <= int(answer) <= len(servers):
            return servers[int(answer) - 1]
        for server in servers:
            if answer == server.name:
                return server


def register(app: typer.Typer) -> None:
    app.command(epilog=EPILOG)(chat)
