"""apirctl.podman.libpod: the create body matches podman-py's rendering of the same spec, and the calls
work against the real Podman service."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from apirctl.errors import ApirctlError
from apirctl.podman import containers, engine, libpod


def _podman_py_body(spec: containers.ContainerSpec) -> object:
    """What podman-py posts for `containers.create(**spec.create_kwargs())` (its render, then its filter)."""
    from podman import api
    from podman.domain.containers_create import CreateMixin

    return json.loads(api.prepare_body(CreateMixin._render_payload(spec.create_kwargs())))


@pytest.mark.parametrize("extra", [
    {},
    {"entrypoint": ["llama-server"], "devices": ["/dev/dri"], "security_opt": ["label=disable"]},
    {"network_mode": "slirp4netns", "network_options": {"slirp4netns": ["allow_host_loopback=true"]},
     "environment": {"A": "1"}},
    {"healthcheck": containers.HealthCheck(command=["/app/bin/apirctl-health", "8000"], start_period_s=300),
     "restart_policy": "on-failure:2"},
    {"mem_limit": 768 * 1024**2},  # --memory: podman-py's resource limits
])
def test_create_body_is_what_podman_py_sends(tmp_path: Path, extra: dict[str, object]) -> None:
    spec = containers.ContainerSpec(
        image="localhost/apirctl/llama-server:test", name="apirctl-x", command=["--port", "8000"],
        labels={"apirctl.version": "0"}, ports={8000: ("127.0.0.1", 1234)},
        mounts=[containers.BindMount(source=tmp_path, target="/models/m.gguf")], **extra,  # type: ignore[arg-type]
    )
    assert libpod.create_body(spec) == _podman_py_body(spec)


def test_only_socket_urls_are_spoken_directly() -> None:
    assert libpod.supported("unix:///run/podman/podman.sock") and libpod.supported("tcp://127.0.0.1:8080")
    assert not libpod.supported("ssh://me@host/run/podman/podman.sock")


@pytest.mark.integration
def test_exists_create_start_inspect_on_the_real_service(podman: str, llama_image: str, tmp_path: Path) -> None:
    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    assert libpod.exists(podman, "images", llama_image)
    assert not libpod.exists(podman, "images", "localhost/apirctl/no-such-image:0")
    assert not libpod.exists(podman, "containers", name)
    spec = containers.ContainerSpec(image=llama_image, name=name, entrypoint=["/app/bin/llama-server"],
                                command=["--version"], labels={"apirctl.test": "libpod"})
    container_id = libpod.create(podman, spec)
    try:
        assert libpod.exists(podman, "containers", name)
        libpod.start(podman, container_id)
        attrs = libpod.inspect(podman, container_id)
        # started: `--version` ends at once, and Podman 4.3 says "stopped" for a moment before "exited"
        assert attrs["State"]["Status"] in ("running", "stopped", "exited")
        assert attrs["State"]["StartedAt"] and not attrs["State"]["StartedAt"].startswith("0001-")
        assert attrs["Config"]["Labels"]["apirctl.test"] == "libpod"
        with pytest.raises(libpod.LibpodError) as err:
            libpod.create(podman, spec)  # the name is taken
        assert err.value.status >= 400 and "already in use" in err.value.message
    finally:
        engine.client().containers.get(container_id).remove(force=True)
    missing = spec.model_copy(update={"name": f"{name}-2", "entrypoint": ["/no/such/binary"]})
    container_id = libpod.create(podman, missing)
    try:
        with pytest.raises(libpod.LibpodError, match="no such file|not found"):
            libpod.start(podman, container_id)
    finally:
        engine.client().containers.get(container_id).remove(force=True)


@pytest.mark.integration
@pytest.mark.parametrize("direct", [True, False])
def test_the_seam_both_ways(podman: str, llama_image: str, direct: bool) -> None:
    """The Podman seam gives the same answers through libpod and through podman-py (ssh:// URLs)."""
    api = containers.Libpod(engine.discover().url)
    api.direct = direct
    name = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    assert api.exists("images", llama_image) and not api.exists("containers", name)
    spec = containers.ContainerSpec(image=llama_image, name=name, entrypoint=["/app/bin/llama-server"],
                                command=["--version"], labels={"apirctl.test": "api"})
    container_id = api.create(spec)
    try:
        api.start(container_id, name)
        attrs = api.inspect(container_id)
        assert attrs["Id"] == container_id and attrs["Config"]["Labels"]["apirctl.test"] == "api"
        assert api.exists("containers", name)
        listed = [c for c in api.list("apirctl.test=api", all_=True) if c["Id"] == container_id]
        assert [(c["Names"], c["Labels"]["apirctl.test"]) for c in listed] == [([name], "api")]
        assert not [c for c in api.list("apirctl.test=other", all_=True) if c["Id"] == container_id]
        deadline = time.monotonic() + 60
        while api.inspect(container_id)["State"]["Status"] != "exited":
            assert time.monotonic() < deadline, "the container did not exit"
            time.sleep(0.05)
        assert "version" in api.logs(container_id).lower()
    finally:
        api.remove(container_id, timeout=2)
    assert not api.exists("containers", name)
    api.remove(container_id, timeout=2)  # absent is fine
    missing = spec.model_copy(update={"name": f"{name}-2", "image": "localhost/apirctl/no-such-image:0"})
    with pytest.raises(ApirctlError, match="not found") as err:
        api.create(missing)
    assert err.value.hint and "apirctl setup" in err.value.hint


@pytest.mark.integration
def test_a_call_interrupted_mid_request_does_not_spoil_the_next(podman: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a call waits for its answer (serve waiting for the model to load) left the kept-alive
    connection mid-request, and every later call, the removal of the half-started container included,
    failed with "Request-sent" (a container outlived Ctrl-C in CI). The calls after it get through."""
    absent = f"apirctl-test-{uuid.uuid4().hex[:8]}"
    assert not libpod.exists(podman, "containers", absent)  # the connection is open and kept
    conn = libpod._connection(podman)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(conn, "getresponse", interrupted)  # (undo() would also undo the test's home)
        libpod.exists(podman, "containers", absent)  # sent, then interrupted before the answer
    assert not libpod.exists(podman, "containers", absent)
    libpod._connection(podman).putrequest("GET", "/half-sent")  # one left mid-request some other way
    assert not libpod.exists(podman, "containers", absent)


def test_inspect_asks_again_when_the_container_exits_during_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Podman answers an inspect that races the container's exit with "read /proc/N/cgroup: no such
    process" (a perplexity run failed on it in CI); asked again it reports the exit. Any other refusal,
    or the race lasting past its bound, is passed on."""
    answers: list[object] = [libpod.LibpodError(500, "read /proc/26803/cgroup: no such process"),
                             {"State": {"Status": "exited"}}]

    def request(url: str, method: str, path: str, **_: object) -> tuple[int, object]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return 200, answer

    monkeypatch.setattr(libpod, "request", request)
    assert libpod.inspect("unix:///x", "c1") == {"State": {"Status": "exited"}}
    assert not answers

    answers[:] = [libpod.LibpodError(404, "no such container"), {}]
    with pytest.raises(libpod.LibpodError, match="no such container"):
        libpod.inspect("unix:///x", "c1")

    monkeypatch.setattr(libpod, "EXIT_RACE_SECONDS", 0.1)
    answers[:] = [libpod.LibpodError(500, "no such process")] * 1000
    with pytest.raises(libpod.LibpodError, match="no such process"):
        libpod.inspect("unix:///x", "c1")
    assert len(answers) < 1000


class _DyingService:
    """A Podman API on a Unix socket whose first connection closes once it has read a call (the service
    killed mid-call, after the change took effect) and whose next answers with `status` and `message`."""

    def __init__(self, path: Path, status: int, message: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen()
        self.answer = json.dumps({"message": message}).encode()
        self.status = status
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _read_call(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)

    def _serve(self) -> None:
        with self.listener.accept()[0] as first:
            self._read_call(first)
        with self.listener.accept()[0] as second:
            self._read_call(second)
            second.sendall(b"HTTP/1.1 %d Refused\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                           % (self.status, len(self.answer), self.answer))


@pytest.mark.parametrize(("method", "status", "message", "went_away"), [
    ("POST", 500, "creating container storage: the container name \"x\" is already in use by 1107b16f", True),
    ("POST", 409, "conflict", True),
    ("POST", 404, "no such image", False),  # not what the first send could have made: passed on
    ("GET", 409, "already in use", False),  # a question changes nothing: asked again, its answer stands
])
def test_a_change_sent_again_after_the_service_died_mid_call_is_not_blamed_on_the_request(
        tmp_path: Path, method: str, status: int, message: str, went_away: bool) -> None:
    """CI: the own Podman service was killed while it created a serve's container; the client sent the
    create again to the service started after it, which refused the name the first create had taken, and
    serve reported a refusal of its request instead of the service's death (whose clean-up removes it)."""
    url = f"unix://{tmp_path / 'api.sock'}"
    service = _DyingService(tmp_path / "api.sock", status, message)
    try:
        if went_away:
            with pytest.raises(ApirctlError, match="went away during the call") as caught:
                libpod.request(url, method, "/containers/create", body={"name": "x"})
            assert caught.value.hint == libpod.SERVICE_STOPPED
        else:
            with pytest.raises(libpod.LibpodError) as refused:
                libpod.request(url, method, "/containers/create", body={"name": "x"} if method == "POST" else None)
            assert refused.value.status == status
    finally:
        libpod._discard(url)
        service.thread.join(10)
        service.listener.close()
    assert not service.thread.is_alive()
