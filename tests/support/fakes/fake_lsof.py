"""Fake `lsof -c NAME -Fn`: the files of the fake krunkit process (see README.md)."""

from __future__ import annotations

import sys

import fakestate


def main(argv: list[str]) -> int:
    fakestate.record("lsof", argv)
    state = fakestate.load()
    failure = fakestate.injected_failure(state, "lsof")
    if failure:
        print(failure[1], file=sys.stderr)
        return failure[0]
    commands: list[str] = []
    fields = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "-c":
            commands.append(args.pop(0))
        elif arg.startswith("-F"):
            fields = arg[2:] or "pfn"
        elif arg in ("-n", "-P", "-w", "-a"):
            continue
        else:
            print(f"lsof: unsupported option in fake: {arg}", file=sys.stderr)
            return 1
    matches = [p for p in state.get("processes", {}).values()
               if not commands or any(p["command"].startswith(c) for c in commands)]
    if not matches:
        return 1  # like lsof: no output, exit 1 when nothing matches
    out = []
    for proc in matches:
        if fields is None:
            print("COMMAND   PID USER   FD   TYPE DEVICE SIZE/OFF NODE NAME")
            for fd, name in proc["files"]:
                print(f"{proc['command'][:9]:<9} {proc['pid']} user  {fd:<4} REG  1,4  0 0 {name}")
            continue
        out.append(f"p{proc['pid']}")
        for fd, name in proc["files"]:
            out.append(f"f{fd}")  # lsof 4.91 (macOS) always adds the fd field to -F output
            if "n" in fields:
                out.append(f"n{name}")
    if out:
        sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
