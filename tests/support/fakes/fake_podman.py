"""Fake `podman` for the macOS machine path: `machine ...` and `--version` (see README.md)."""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fakestate

DEFAULT_NAME = "podman-machine-default"
VERSION = "5.6.1"
HELPER = {"libkrun": "krunkit", "applehv": "vfkit"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _provider(state: dict[str, Any]) -> str:
    return os.environ.get("CONTAINERS_MACHINE_PROVIDER") or state.get("default_provider", "applehv")


def _err(message: str, code: int = 125) -> int:
    print(f"Error: {message}", file=sys.stderr)
    return code


def _find(state: dict[str, Any], name: str | None, provider: str) -> dict[str, Any] | None:
    name = name or DEFAULT_NAME
    machine = state.get("machines", {}).get(name)
    if machine is None or machine["provider"] != provider:
        return None
    return machine


# --- dyld, as far as the launch of krunkit needs it -----------------------------------------------


def _deps(path: Path) -> list[str]:
    from macholib.MachO import MachO

    return [name for _i, _k, name in MachO(str(path)).headers[0].walkRelocatables()]


def _dyld_resolve(ref: str, loader: Path, exe: Path) -> Path | None:
    leaf = ref.rsplit("/", 1)[-1]
    for d in filter(None, os.environ.get("DYLD_LIBRARY_PATH", "").split(":")):
        if (Path(d) / leaf).is_file():
            return (Path(d) / leaf).resolve()
    if ref.startswith("@executable_path/"):
        cand = exe.parent / ref.removeprefix("@executable_path/")
    elif ref.startswith("@loader_path/"):
        cand = loader.parent / ref.removeprefix("@loader_path/")
    else:
        cand = Path(ref)
    return cand.resolve() if cand.is_file() else None


def _launch(exe: Path) -> tuple[list[str], str | None]:
    """The files dyld maps for `exe`, or the error dyld would print."""
    exe = exe.resolve()
    mapped = [str(exe)]
    todo = [exe]
    while todo:
        current = todo.pop(0)
        for ref in _deps(current):
            if ref.startswith(("/usr/lib/", "/System/")):
                continue  # the dyld shared cache, not files
            found = _dyld_resolve(ref, current, exe)
            if found is None:
                return mapped, f"dyld: Library not loaded: {ref}\n  Referenced from: {current}"
            if str(found) not in mapped:
                mapped.append(str(found))
                todo.append(found)
    return mapped, None


def _signature_ok(state: dict[str, Any], path: str) -> bool:
    import hashlib

    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    # signed by (fake) codesign, or as shipped (Homebrew's and the release's own signatures)
    return digest in state.get("signatures", {}) or digest in state.get("trusted_sha256", [])


# --- commands -------------------------------------------------------------------------------------


def _api_socket(name: str, provider: str) -> str:
    """Where gvproxy forwards the machine's API: $TMPDIR/podman on macOS, $XDG_RUNTIME_DIR/podman on
    Linux (the qemu provider), named NAME-api.sock."""
    if provider == "qemu":
        runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
        return f"{runtime}/podman/{name}-api.sock"
    return f"/var/folders/xx/T/podman/{name}-api.sock"


def _inspect_json(m: dict[str, Any]) -> dict[str, Any]:
    name = m["name"]
    home = "/home/user" if m["provider"] == "qemu" else "/Users/user"
    return {
        "ConfigDir": {"Path": f"{home}/.config/containers/podman/machine/{m['provider']}"},
        "ConnectionInfo": {"PodmanSocket": {"Path": _api_socket(name, m["provider"])}, "PodmanPipe": None},
        "Created": m.get("created", _now()),
        "LastUp": m.get("last_up", "0001-01-01T00:00:00Z"),
        "Name": name,
        "Resources": {"CPUs": m.get("cpus", 4), "DiskSize": m.get("disk", 100), "Memory": m.get("memory", 2048),
                      "USBs": []},
        "SSHConfig": {"IdentityPath": f"{home}/.local/share/containers/podman/machine/machine",
                      "Port": 53111, "RemoteUsername": "core"},
        "State": m["state"],
        "UserModeNetworking": True,
        "Rootful": False,
        "Rosetta": False,
    }


def machine(state: dict[str, Any], args: list[str]) -> int:
    if not args:
        return _err("missing command 'podman machine COMMAND'")
    sub, rest = args[0], args[1:]
    failure = fakestate.injected_failure(state, f"machine {sub}")
    if failure:
        print(failure[1], file=sys.stderr)
        return failure[0]
    positional = [a for a in rest if not a.startswith("-") and a not in ("json",)]
    provider = _provider(state)
    if sub == "inspect":
        names = positional or [DEFAULT_NAME]
        out = []
        for name in names:
            m = _find(state, name, provider)
            if m is None:
                print(json.dumps(out, indent=4))
                return _err(f"{name}: VM does not exist")
            out.append(_inspect_json(m))
        print(json.dumps(out, indent=4))
        return 0
    if sub in ("list", "ls"):
        every = "--all-providers" in rest
        rows = []
        for m in state.get("machines", {}).values():
            if every or m["provider"] == provider:
                rows.append({"Name": m["name"], "Default": m.get("default", False), "Created": m.get("created", ""),
                             "Running": m["state"] == "running", "Starting": False,
                             "LastUp": m.get("last_up", ""), "Stream": "", "VMType": m["provider"],
                             "CPUs": m.get("cpus", 4), "Memory": "2GiB", "Swap": "0B", "DiskSize": "100GiB",
                             "Port": 53111, "RemoteUsername": "core", "IdentityPath": "",
                             "UserModeNetworking": True})
        print(json.dumps(rows, indent=4))
        return 0
    if sub == "init":
        name = positional[0] if positional else DEFAULT_NAME
        if name in state.get("machines", {}):
            return _err(f"{name}: VM already exists")
        state.setdefault("machines", {})[name] = {"name": name, "provider": provider, "state": "stopped",
                                                  "default": name == DEFAULT_NAME, "created": _now()}
        fakestate.save(state)
        print(f"Machine init complete\nTo start your machine run:\n\n\tpodman machine start {name}\n")
        return 0
    if sub == "start":
        name = positional[0] if positional else DEFAULT_NAME
        m = _find(state, name, provider)
        if m is None:
            return _err(f"{name}: VM does not exist")
        if m["state"] == "running" or any(p["machine"] == name for p in state.get("processes", {}).values()):
            return _err(f"unable to start \"{name}\": machine {name}: VM already running or starting")
        print(f"Starting machine \"{name}\"")
        helper = HELPER[provider]
        # Failure modes seen on real Macs: a podman that does not honour CONTAINERS_HELPER_BINARY_DIR,
        # and DYLD_* variables stripped by SIP when a protected program sits between podman and krunkit.
        helper_dir = None if state.get("ignore_helper_dir") else os.environ.get("CONTAINERS_HELPER_BINARY_DIR")
        if state.get("strip_dyld"):
            for var in [v for v in os.environ if v.startswith("DYLD_")]:
                del os.environ[var]
        exe = Path(helper_dir) / helper if helper_dir and (Path(helper_dir) / helper).is_file() else None
        if exe is None:
            default = state.get("helpers", {}).get(helper)
            exe = Path(default) if default else None
        if exe is None or not exe.is_file():
            return _err(f"unable to start \"{name}\": could not find \"{helper}\" in one of "
                        f"[{helper_dir or ''} /opt/homebrew/bin /opt/podman/bin]")
        files: list[list[str]] = [["cwd", "/"]]
        if helper == "krunkit":
            mapped, dyld_error = _launch(exe)
            if dyld_error:
                print(dyld_error, file=sys.stderr)
                return _err("krunkit exited unexpectedly with exit code 6")
            for path in mapped:
                if not _signature_ok(state, path):
                    return _err(f"krunkit exited unexpectedly with exit code 137 (Killed: 9, "
                                f"code signature invalid for {path})")
            import hashlib

            exe_sha = hashlib.sha256(Path(mapped[0]).read_bytes()).hexdigest()
            ents = (state.get("signatures", {}).get(exe_sha) or {}).get("entitlements") or ""
            if exe_sha not in state.get("trusted_sha256", []) and "com.apple.security.hypervisor" not in ents:
                return _err("krunkit exited unexpectedly with exit code 1 (HV_DENIED: "
                            "missing com.apple.security.hypervisor entitlement)")
            files += [["txt", p] for p in mapped]
        else:
            files += [["txt", str(exe.resolve())]]
        files += [["0", "/dev/null"], ["1", "/dev/null"], ["2", "/dev/null"]]
        pid = 4000 + len(state.get("processes", {})) + int(state.get("pid_counter", 0))
        state["pid_counter"] = int(state.get("pid_counter", 0)) + 1
        env = {k: v for k, v in os.environ.items() if k.startswith(fakestate.RECORDED_PREFIXES)}
        state.setdefault("processes", {})[str(pid)] = {"pid": pid, "command": helper, "machine": name,
                                                       "files": files, "env": env}
        m["state"] = "running"
        m["last_up"] = _now()
        fakestate.save(state)
        if "--no-info" not in rest and "-q" not in rest and "--quiet" not in rest:
            print(f"API forwarding listening on: {_api_socket(name, provider)}")
        print(f"Machine \"{name}\" started successfully")
        return 0
    if sub == "stop":
        name = positional[0] if positional else DEFAULT_NAME
        m = _find(state, name, provider)
        if m is None:
            return _err(f"{name}: VM does not exist")
        state["processes"] = {k: p for k, p in state.get("processes", {}).items() if p["machine"] != name}
        was_running = m["state"] == "running"
        m["state"] = "stopped"
        if was_running:
            state["containers"] = [dict(c, State="exited") for c in state.get("containers", [])]
        fakestate.save(state)
        print(f"Machine \"{name}\" stopped successfully")
        return 0
    return _err(f"unrecognized command `podman machine {sub}`")


def main(argv: list[str]) -> int:
    fakestate.record("podman", argv)
    state = fakestate.load()
    args = list(argv)
    if args in (["--version"], ["-v"]):
        print(f"podman version {VERSION}")
        return 0
    if not args:
        return _err("missing command")
    if args[0] == "machine":
        return machine(state, args[1:])
    return _err(f"unrecognized command `podman {args[0]}`")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
