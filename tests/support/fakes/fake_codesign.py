"""Fake `codesign` (ad-hoc signing, --verify, -d --entitlements): see README.md."""

from __future__ import annotations

import hashlib
import plistlib
import sys
from pathlib import Path

import fakestate

MH_MAGICS = {b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"\xca\xfe\xba\xbf"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _has_signature_command(path: Path) -> bool:
    """A Mach-O that carries LC_CODE_SIGNATURE but matches no known signature was modified."""
    from macholib import mach_o
    from macholib.MachO import MachO

    return any(lc.cmd == mach_o.LC_CODE_SIGNATURE for h in MachO(str(path)).headers for lc, _c, _d in h.commands)


def main(argv: list[str]) -> int:
    fakestate.record("codesign", argv)
    state = fakestate.load()
    sigs = state.setdefault("signatures", {})  # content sha256 -> signature (it travels with the file)
    signed_paths = state.setdefault("signed_paths", [])
    args = list(argv)
    force = sign = verify = display = False
    identity = entitlements = None
    paths: list[str] = []
    while args:
        arg = args.pop(0)
        if arg in ("-f", "--force"):
            force = True
        elif arg in ("-s", "--sign"):
            sign = True
            identity = args.pop(0) if args else None
        elif arg in ("-v", "--verify"):
            verify = True
        elif arg in ("-d", "--display"):
            display = True
        elif arg == "--entitlements":
            entitlements = args.pop(0) if args else None
        elif arg.startswith("--verbose") or arg == "--deep" or arg.startswith("--options"):
            continue
        elif arg.startswith("-"):
            print(f"codesign: unrecognized option `{arg}'", file=sys.stderr)
            return 2
        else:
            paths.append(arg)
    if not paths:
        print("Usage: codesign -s identity [-fv*] [-o flags] [-r reqs] [-i ident] path ...", file=sys.stderr)
        return 2
    mode = "sign" if sign else "verify" if verify else "display" if display else None
    failure = fakestate.injected_failure(state, f"codesign --{mode}")
    if failure:
        print(failure[1], file=sys.stderr)
        return failure[0]
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            print(f"{raw}: No such file or directory", file=sys.stderr)
            return 1
        if path.read_bytes()[:4] not in MH_MAGICS:
            print(f"{raw}: code object is not signed at all" if not sign
                  else f"{raw}: unsupported format for signature", file=sys.stderr)
            return 1
        if sign:
            if identity != "-":
                print(f"{identity}: no identity found", file=sys.stderr)
                return 1
            key = _sha(path)
            if (key in sigs or key in state.get("trusted_sha256", [])) and not force:
                print(f"{raw}: is already signed", file=sys.stderr)
                return 1
            ents = None
            if entitlements is not None:
                try:
                    text = Path(entitlements).read_bytes()
                    plistlib.loads(text)
                except (OSError, plistlib.InvalidFileException, ValueError):
                    print("Failed to parse entitlements: AMFIUnserializeXML: syntax error", file=sys.stderr)
                    return 1
                ents = text.decode()
            sigs[key] = {"identity": "adhoc", "entitlements": ents}
            signed_paths.append(str(path.resolve()))
            print(f"{raw}: replacing existing signature", file=sys.stderr)
        elif verify:
            key = _sha(path)
            if key in sigs or key in state.get("trusted_sha256", []):
                continue
            if str(path.resolve()) in signed_paths or _has_signature_command(path):
                print(f"{raw}: invalid signature (code or signature have been modified)", file=sys.stderr)
                print("In architecture: arm64", file=sys.stderr)
            else:
                print(f"{raw}: code object is not signed at all", file=sys.stderr)
            return 1
        elif display:
            sig = sigs.get(_sha(path))
            if sig is None:
                print(f"{raw}: code object is not signed at all", file=sys.stderr)
                return 1
            print(f"Executable={path.resolve()}", file=sys.stderr)
            if sig.get("entitlements"):
                sys.stdout.write(sig["entitlements"])
    fakestate.save(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
