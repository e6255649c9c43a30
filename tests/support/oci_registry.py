"""Test infrastructure: a read-only OCI image registry on 127.0.0.1, made with `http.server`.

No image registry is reachable from the machines the tests run on, so `apirctl serve --image`
pulls from this one. It serves an OCI image layout (what `podman save --format oci-dir` writes:
`index.json` and `blobs/sha256/<hex>`) through the GET and HEAD endpoints of the OCI
distribution API that a pull uses, written from the distribution spec:

- `/v2/`: 200 with `Docker-Distribution-API-Version: registry/2.0` (the API version check);
- `/v2/<name>/manifests/<tag or digest>`: the manifest bytes as stored, with its media type as
  `Content-Type`, its digest as `Docker-Content-Digest`, and `Content-Length`;
- `/v2/<name>/blobs/<digest>`: the blob (config or layer), streamed from the file.

Errors carry the spec's JSON body (`{"errors": [{"code": "MANIFEST_UNKNOWN", ...}]}`): 404 for an
unknown repository, tag or blob, 405 for anything that would write. It is plain HTTP, so the
Podman service that pulls must be told the registry is insecure (registries.conf).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_NAME = r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
_DIGEST = r"sha256:[0-9a-f]{64}"


def insecure_registries_conf(*hosts: str) -> str:
    """A registries.conf that lets Podman pull from these plain-HTTP registries."""
    return "".join(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n\n' for host in hosts)


def export_oci_layout(podman: list[str], image: str, dest: Path, env: dict[str, str] | None = None) -> Path:
    """Write `image` as an OCI image layout directory with `podman save --format oci-dir`."""
    done = subprocess.run([*podman, "save", "--format", "oci-dir", "-o", str(dest), image],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"podman save {image} failed: {done.stderr.strip()}")
    return dest


@dataclass
class OciRegistry:
    """What the registry holds (one repository, from one layout) and what it was asked."""

    layout: Path
    repository: str
    tags: dict[str, str] = field(default_factory=dict)  # tag -> manifest digest
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    url: str = ""  # host:port, as an image reference spells it
    _server: ThreadingHTTPServer | None = None

    def tag(self, tag: str, digest: str | None = None) -> str:
        """Publish the layout's (first) manifest, or `digest`, under `tag`; returns the image reference."""
        if digest is None:
            index = json.loads((self.layout / "index.json").read_text())
            digest = str(index["manifests"][0]["digest"])
        self.tags[tag] = digest
        return f"{self.url}/{self.repository}:{tag}"

    def manifest(self) -> dict[str, Any]:
        """The layout's (first) image manifest."""
        index = json.loads((self.layout / "index.json").read_text())
        path = self.blob(str(index["manifests"][0]["digest"]))
        assert path is not None, "the layout's index names a manifest it does not hold"
        return dict(json.loads(path.read_bytes()))

    def blob(self, digest: str) -> Path | None:
        if not re.fullmatch(_DIGEST, digest):
            return None
        path = self.layout / "blobs" / "sha256" / digest.split(":", 1)[1]
        return path if path.is_file() else None

    def media_type(self, manifest: bytes) -> str:
        """A manifest's media type: its own field, else the layout index's entry for it."""
        data = json.loads(manifest)
        if data.get("mediaType"):
            return str(data["mediaType"])
        return OCI_INDEX if "manifests" in data else "application/vnd.oci.image.manifest.v1+json"

    def blobs_fetched(self) -> list[str]:
        return [path.rsplit("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/blobs/" in path]

    def start(self) -> OciRegistry:
        handler = type("BoundHandler", (_Handler,), {"registry": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    registry: OciRegistry
    protocol_version = "HTTP/1.1"  # keep-alive, as registries answer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _head(self, code: int, headers: dict[str, str]) -> None:
        self.send_response(code)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def _error(self, code: int, error: str, message: str) -> None:
        body = json.dumps({"errors": [{"code": error, "message": message, "detail": self.path}]}).encode()
        self._head(code, {"Content-Type": "application/json", "Content-Length": str(len(body))})
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        reg = self.registry
        reg.requests.append((self.command, self.path))
        path = self.path.split("?", 1)[0]
        if path in ("/v2", "/v2/"):
            self._head(200, {"Content-Type": "application/json", "Content-Length": "2"})
            if self.command != "HEAD":
                self.wfile.write(b"{}")
            return
        m = re.fullmatch(rf"/v2/({_NAME})/(manifests|blobs)/([^/]+)", path)
        if not m:
            return self._error(404, "NOT_FOUND", "no such endpoint")
        name, kind, ref = m.groups()
        if name != reg.repository:
            return self._error(404, "NAME_UNKNOWN", f"repository {name} is not known to this registry")
        if kind == "manifests":
            digest = ref if ref.startswith("sha256:") else reg.tags.get(ref)
            blob = reg.blob(digest) if digest else None
            if blob is None:
                return self._error(404, "MANIFEST_UNKNOWN", f"manifest {ref} unknown")
            data = blob.read_bytes()
            self._head(200, {"Content-Type": reg.media_type(data), "Docker-Content-Digest": str(digest),
                             "Content-Length": str(len(data))})
            if self.command != "HEAD":
                self.wfile.write(data)
            return
        blob = reg.blob(ref)
        if blob is None:
            return self._error(404, "BLOB_UNKNOWN", f"blob {ref} unknown")
        self._head(200, {"Content-Type": "application/octet-stream", "Docker-Content-Digest": ref,
                         "Content-Length": str(blob.stat().st_size)})
        if self.command != "HEAD":
            with blob.open("rb") as handle:
                shutil.copyfileobj(handle, self.wfile, 1 << 20)

    def _read_only(self) -> None:
        self.registry.requests.append((self.command, self.path))
        self._error(405, "UNSUPPORTED", "this registry is read-only")

    do_POST = do_PUT = do_PATCH = do_DELETE = _read_only
