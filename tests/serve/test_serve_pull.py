"""serve --image with a remote image: a real pull from a registry on 127.0.0.1, with progress.

The registry (tests/support/oci_registry.py, test infrastructure) serves apirctl's real image
plus one small extra layer, so a pull really downloads a layer over HTTP while the big base
layer is already in local storage. The registry is plain HTTP: Podman learns that from a
registries.conf given, as a user would, through CONTAINERS_REGISTRIES_CONF to the Podman service
apirctl starts for itself in the test's home.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import shared_env
from tests.serve.conftest import apirctl
from tests.support.oci_registry import OciRegistry, export_oci_layout, insecure_registries_conf
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

REPOSITORY = "apirctl/llama-server"


@pytest.fixture(scope="module")
def registry(llama_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    """apirctl's image plus a marker layer, exported as an OCI layout and served on 127.0.0.1."""
    from apirctl.podman import engine

    work = tmp_path_factory.mktemp("oci-registry")
    seed = f"localhost/apirctl-test/registry-seed:{uuid.uuid4().hex[:12]}"
    (work / "context").mkdir()
    (work / "context" / "marker").write_text(f"pulled from the test registry ({seed})\n")
    (work / "context" / "Containerfile").write_text(f"FROM {llama_image}\nCOPY marker /etc/apirctl-test-marker\n")
    with shared_env():
        env = engine.podman_env()
        podman = engine.podman_cli()
        built = subprocess.run([*podman, "build", "--quiet", "--layers=false", "-t", seed, str(work / "context")],
                               capture_output=True, text=True, env=env, timeout=300)
        assert built.returncode == 0, built.stderr
        try:
            layout = export_oci_layout(podman, seed, work / "layout", env=env)
        finally:  # the marker layer must not stay in local storage, or the pull would not fetch it
            subprocess.run([*podman, "rmi", "--force", seed], capture_output=True, env=env, timeout=120)
    served = OciRegistry(layout, REPOSITORY).start()
    yield served
    served.stop()


@pytest.fixture
def own_service(registry: OciRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """apirctl's own Podman service in this test's home, started with CONTAINERS_REGISTRIES_CONF
    naming a registries.conf that marks the test registry insecure (plain HTTP)."""
    from apirctl.podman import engine

    conf = tmp_path / "registries.conf"
    conf.write_text(insecure_registries_conf(registry.url))
    monkeypatch.delenv("CONTAINER_HOST", raising=False)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(conf))
    endpoint = engine.start_service()
    assert endpoint.started_by_apirctl
    yield conf
    engine.stop_service()


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Names of containers and images to remove after the test, whatever happened."""
    from podman.errors import APIError

    from apirctl.podman import engine

    made: list[str] = []
    yield made
    for item in made:
        with contextlib.suppress(APIError):
            if engine.client().containers.exists(item):
                engine.client().containers.get(item).remove(force=True)
            elif engine.client().images.exists(item):
                engine.client().images.remove(item, force=True)


def _exists(kind: str, name: str) -> bool:
    from apirctl.podman import containers

    return containers.connect().exists("images" if kind == "image" else "containers", name)


def _one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("apirctl: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_serve_pulls_a_remote_image_with_progress(registry: OciRegistry, own_service: Path, demo_model: Path,
                                                  cleanup: list[str]) -> None:
    ref = registry.tag(f"pull-{uuid.uuid4().hex[:8]}")
    name, port = f"apirctl-test-{uuid.uuid4().hex[:8]}", free_port()
    cleanup += [name, ref]
    assert not _exists("image", ref)
    marker_layer = registry.manifest()["layers"][-1]["digest"]

    done = apirctl("serve", str(demo_model), "--image", ref, "--transport", "none", "--port", str(port),
                   "--name", name)
    assert done.returncode == 0, done.stderr
    # on a pipe every line of Podman's pull progress is printed under the image phase
    assert f"  Trying to pull {ref}" in done.stderr
    assert f"  Copying blob {marker_layer}" in done.stderr
    assert marker_layer in registry.blobs_fetched()  # the layer really came over HTTP from the registry
    assert done.stderr.index("image...") < done.stderr.index("Trying to pull") < done.stderr.index("container...")
    assert f"{name} serves" in done.stdout

    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
    from apirctl.podman import engine

    container = engine.client().containers.get(name)
    assert container.attrs["ImageName"] == ref
    # a pulled copy of apirctl's image runs with serve's `llama-server` entrypoint (found on its PATH)
    assert container.attrs["Config"]["Entrypoint"] in (["llama-server"], "llama-server")

    stop = apirctl("stop", name)
    assert stop.returncode == 0, stop.stderr
    assert not _exists("container", name)
    engine.client().images.remove(ref)
    assert not _exists("image", ref)


@pytest.mark.parametrize("case", ["missing tag", "unknown repository", "unreachable registry"])
def test_a_failed_pull_is_one_line_naming_the_image(case: str, registry: OciRegistry, own_service: Path,
                                                    demo_model: Path, cleanup: list[str]) -> None:
    ref, expected = {
        "missing tag": (f"{registry.url}/{REPOSITORY}:no-such-tag", "no such tag or digest (manifest unknown)"),
        "unknown repository": (f"{registry.url}/apirctl/other:1", "no such repository (name unknown)"),
        "unreachable registry": (f"127.0.0.1:{free_port()}/{REPOSITORY}:1", "does not answer (connection refused)"),
    }[case]
    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    cleanup += [name, ref]

    done = apirctl("serve", str(demo_model), "--image", ref, "--transport", "none", "--port", str(free_port()),
                   "--name", name)
    assert done.returncode != 0
    line = _one_line_error(done.stderr)
    assert f"cannot pull {ref}: " in line and expected in line, line
    assert f"Trying to pull {ref}" in done.stderr  # the progress that came before the failure
    assert not _exists("container", name)
    assert not _exists("image", ref)


def test_plain_http_registry_needs_registries_conf_and_our_service_rereads_it(
        registry: OciRegistry, own_service: Path, demo_model: Path, cleanup: list[str]) -> None:
    """Without an `insecure = true` entry the error says how to add one; once the user adds it,
    apirctl's own service (which read registries.conf when it started) is restarted and serve works."""
    from apirctl.podman import engine

    ref = registry.tag(f"conf-{uuid.uuid4().hex[:8]}")
    name, port = f"apirctl-test-{uuid.uuid4().hex[:8]}", free_port()
    cleanup += [name, ref]
    own_service.write_text("")  # the registry is not marked insecure: podman speaks HTTPS to it
    engine.stop_service()
    engine.start_service()
    serve = ("serve", str(demo_model), "--image", ref, "--transport", "none", "--port", str(port), "--name", name)

    refused = apirctl(*serve)
    assert refused.returncode != 0
    line = _one_line_error(refused.stderr)
    assert f"cannot pull {ref}: {registry.url} does not speak verifiable HTTPS" in line, line
    assert f'add `[[registry]] location = "{registry.url}" insecure = true`' in refused.stderr
    assert not _exists("container", name)

    pid = engine.service_record().pid  # type: ignore[union-attr]
    own_service.write_text(insecure_registries_conf(registry.url))  # the user adds the entry
    done = apirctl(*serve)
    assert done.returncode == 0, done.stderr
    assert "  restarted apirctl's Podman service to read registries.conf again" in done.stderr
    assert "  Writing manifest to image destination" in done.stderr
    assert engine.service_record().pid != pid  # type: ignore[union-attr]
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
    assert apirctl("stop", name).returncode == 0
    assert not _exists("container", name)


def test_registry_answers_the_distribution_api(registry: OciRegistry) -> None:
    """The test registry itself: what a pull relies on, checked without podman."""
    import hashlib

    ref = registry.tag("api-check")
    base = f"http://{registry.url}/v2"
    root = httpx.get(f"{base}/")
    assert root.status_code == 200 and root.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    by_tag = httpx.get(f"{base}/{REPOSITORY}/manifests/api-check")
    digest = by_tag.headers["Docker-Content-Digest"]
    assert by_tag.headers["Content-Type"] == "application/vnd.oci.image.manifest.v1+json"
    assert digest == "sha256:" + hashlib.sha256(by_tag.content).hexdigest()
    assert httpx.head(f"{base}/{REPOSITORY}/manifests/{digest}").headers["Content-Length"] == str(len(by_tag.content))
    layer = registry.manifest()["layers"][-1]
    blob = httpx.get(f"{base}/{REPOSITORY}/blobs/{layer['digest']}")
    assert len(blob.content) == layer["size"]
    assert "sha256:" + hashlib.sha256(blob.content).hexdigest() == layer["digest"]
    missing = httpx.get(f"{base}/{REPOSITORY}/manifests/nope")
    assert missing.status_code == 404 and missing.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN"
    assert httpx.get(f"{base}/other/x/manifests/1").json()["errors"][0]["code"] == "NAME_UNKNOWN"
    assert httpx.put(f"{base}/{REPOSITORY}/manifests/x", content=b"{}").status_code == 405
    assert ref == f"{registry.url}/{REPOSITORY}:api-check" and registry.url.startswith("127.0.0.1:")
