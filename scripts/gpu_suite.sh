#!/usr/bin/env bash
# The GPU suite, run on the GPU machine from the repo root with .gpu/ carried (see README "GPU suite").
#
#   COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_suite.sh [PART ...]
#   PART: tests (default: every gpu-marked test) | tests:shard=I/N (every N-th gpu-marked test from the I-th:
#         the whole suite does not fit one call) | tests:FILE[::NAME] (every test there, on the GPU)
#         | bench-compact (extra arguments in $BENCH_COMPACT_ARGS) | bench-replay ($BENCH_REPLAY_ARGS)
#         | bench-commit (the eager commit after a verify, per mode, scripts/bench_commit.py; $BENCH_COMMIT_ARGS)
#         | drift (replay's bf16 state over 10 000 decode tokens, scripts/replay_drift.py; $DRIFT_ARGS)
#         | e2e (real SGLang servers, scripts/e2e_servers.py; configurations etc. in $E2E_ARGS)
#
# Unpacks the SGLang 0.5.14 site archive (.gpu/site312.tar.xz, built by ../shared/gpu/build_site.sh),
# runs the selected parts and writes their logs and results under $OUT (default ./out). Folders under
# $OUT (server logs, GSM8K answers) come back packed as $OUT/folders.tar.xz (the device returns 8 files).
# Triton's cache: unpacked from .gpu/triton-cache.tar.xz when carried, and with SAVE_TRITON_CACHE=1 packed
# to $OUT/triton-cache.tar.xz at the end (copy it into .gpu/ for the next run: cold servers start faster).
set -euo pipefail
OUT=${OUT:-$PWD/out}
PARTS=("${@:-tests}")
for part in "${PARTS[@]}"; do
    case "$part" in
        tests:shard=*)
            shard=${part#tests:shard=}
            if ! [[ "$shard" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] || (( BASH_REMATCH[1] > BASH_REMATCH[2] )); then
                echo "part '$part': a shard is I/N with 1 <= I <= N, e.g. tests:shard=2/3" >&2; exit 2
            fi ;;
        tests|tests:*|bench-compact|bench-replay|bench-commit|drift|e2e) ;;
        *) echo "unknown part '$part'; parts: tests, tests:shard=I/N, tests:FILE[::NAME], bench-compact, bench-replay, bench-commit, drift, e2e" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
[ -f .gpu/site312.tar.xz ] || { echo "missing .gpu/site312.tar.xz: build it with ../shared/gpu/build_site.sh and carry .gpu" >&2; exit 2; }
export TRITON_CACHE_DIR=/tmp/sglang-ssm-modes-triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .gpu/triton-cache.tar.xz ] && tar -xJf .gpu/triton-cache.tar.xz -C "$TRITON_CACHE_DIR"
SITE=$(mktemp -d)
tar -xJf .gpu/site312.tar.xz -C "$SITE"
export PYTHONPATH="$PWD:$SITE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# Our entry points (the sglang.srt.plugins one above all) as installed metadata beside the site, read
# from pyproject.toml: SGLang discovers the plugin the way it does after `pip install` (no index here).
python3 - "$SITE" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
(info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                               for g, eps in groups.items()))
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
export GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
export COMMIT=${COMMIT:-unknown}
echo "commit $COMMIT date $(date -u +%F)" | tee -a "$OUT/gpu.txt"

run_tests() {  # $1: pytest target, all its tests; without it every gpu-marked test; $2: extra pytest arguments
    local args=(-m gpu tests)
    [ -n "${1:-}" ] && args=("$1")
    [ -n "${2:-}" ] && args+=("$2")
    set +e
    python3 -m pytest -q -rA -p no:cacheprovider "${args[@]}" 2>&1 | tee -a "$OUT/gpu_tests.log"
    local rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || { echo "gpu tests failed (rc=$rc)" >&2; return "$rc"; }
}

status=0
for part in "${PARTS[@]}"; do
    case "$part" in
        tests) run_tests "" || status=1 ;;
        tests:shard=*) run_tests "" "--gpu-shard=${part#tests:shard=}" || status=1 ;;
        tests:*) run_tests "${part#tests:}" || status=1 ;;
        bench-compact) python3 scripts/bench_compact.py --out "$OUT" ${BENCH_COMPACT_ARGS:-} || status=1 ;;
        bench-replay) python3 scripts/bench_replay.py --out "$OUT" ${BENCH_REPLAY_ARGS:-} || status=1 ;;
        bench-commit) python3 scripts/bench_commit.py --out "$OUT" ${BENCH_COMMIT_ARGS:-} || status=1 ;;
        drift) python3 scripts/replay_drift.py --out "$OUT" ${DRIFT_ARGS:-} || status=1 ;;
        e2e) python3 scripts/e2e_servers.py --out "$OUT" ${E2E_ARGS:-} || status=1 ;;
    esac
done
folders=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d -printf '%P\n')
if [ -n "$folders" ]; then
    (cd "$OUT" && tar -cJf folders.tar.xz $folders && rm -rf $folders)
fi
if [ "${SAVE_TRITON_CACHE:-0}" = 1 ]; then
    tar -cJf "$OUT/triton-cache.tar.xz" -C "$TRITON_CACHE_DIR" .
    ls -l "$OUT/triton-cache.tar.xz"
fi
exit "$status"
