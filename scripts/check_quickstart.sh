#!/usr/bin/env bash
# CI: run the README's quickstart VERBATIM in a fresh virtual environment, then check what it gives a new user.
#
#   bash scripts/check_quickstart.sh            (.ci/run calls it before the test suite; needs PyPI and port 30000)
#
# 1. Extracts the code block after the `<!-- ci:quickstart ... -->` marker in README.md at run time (so the README
#    cannot drift from what is tested) and runs it, unchanged, from the repo root in a new venv (`python3 -m venv`,
#    activated: `pip` and `python` are the venv's). The line installs and then starts the server, which blocks, so
#    it runs in its own session; we wait until http://127.0.0.1:30000/health answers (or the line exits: failure).
# 2. In that venv: `sglang` and `sgl_kernel` import, from this checkout (editable).
# 3. Runs the README's `ci:quickstart-curl` block (bash) and `ci:quickstart-python` block (the venv's python)
#    verbatim; each must print an English continuation (ASCII words), and both the same text.
# 4. Stops the server (its whole process group) and removes the venv, whatever happened.
# Exit 0 when all checks pass; 1 with the failing step named (and the server log's tail) otherwise.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
port=30000
ready_timeout_s="${QUICKSTART_TIMEOUT_S:-900}"
base="$(mktemp -d "${TMPDIR:-/tmp}/sglang-tw-quickstart.XXXXXX")"
log="$base/quickstart.log"
pid=""

cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null
  fi
  rm -rf "$base"
}
trap cleanup EXIT

fail() {
  echo "check_quickstart: FAILED: $*" >&2
  if [ -f "$log" ]; then echo "---- last 40 lines of the quickstart line's output ----" >&2; tail -n 40 "$log" >&2; fi
  exit 1
}

# the code block (lines between the fences) after the first line that starts with the given marker
block() {
  awk -v m="<!-- $1" 'found == 0 && index($0, m) == 1 { found = 1; next }
       found == 1 && /^```/ { found = 2; next }
       found == 2 && /^```/ { exit }
       found == 2 { print }' README.md
}

line="$(block "ci:quickstart ")"
curl_block="$(block "ci:quickstart-curl")"
py_block="$(block "ci:quickstart-python")"
[ -n "$line" ] || fail "README.md has no code block after a '<!-- ci:quickstart ' marker"
[ -n "$curl_block" ] && [ -n "$py_block" ] || fail "README.md lacks the ci:quickstart-curl / ci:quickstart-python blocks"
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then fail "port $port is already in use; stop that server first"; fi

echo "check_quickstart: fresh venv in $base/venv"
python3 -m venv "$base/venv" || fail "python3 -m venv (install python3-venv)"
# shellcheck disable=SC1091
. "$base/venv/bin/activate"
unset PYTHONPATH
echo "check_quickstart: running the README's quickstart line verbatim:"
echo "  $line"
t0=$(date +%s)
setsid bash -c "$line" >"$log" 2>&1 </dev/null &
pid=$!
until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
  kill -0 "$pid" 2>/dev/null || fail "the quickstart line exited before the server answered /health"
  [ $(( $(date +%s) - t0 )) -lt "$ready_timeout_s" ] || fail "no /health answer within ${ready_timeout_s} s"
  sleep 2
done
echo "check_quickstart: installed and serving after $(( $(date +%s) - t0 )) s"

python -c "import sglang, sgl_kernel, os, sys
want = os.path.realpath(sys.argv[1])
for m in (sglang, sgl_kernel):
    assert os.path.realpath(m.__file__).startswith(want), (m.__name__, m.__file__, 'is not from', want)
    print(m.__name__, 'from', m.__file__)" "$root" || fail "import sglang, sgl_kernel in the venv"

out_curl="$(bash -c "$curl_block")" || fail "the README's curl request"
text_curl="$(printf '%s' "$out_curl" | python -c "import json, sys; print(json.load(sys.stdin)['text'])")" \
  || fail "the curl request's answer has no text: $out_curl"
text_py="$(python -c "$py_block")" || fail "the README's Python (openai) request"
for t in "$text_curl" "$text_py"; do
  python - "$t" <<'EOF' || fail "the answer is not an English continuation: $t"
import re, sys
t = sys.argv[1]
words = re.findall(r"[A-Za-z]+", t)
ok = t.isascii() and len(words) >= 8 and re.fullmatch(r"[A-Za-z0-9 ,.'!?\"\n-]*", t) is not None
sys.exit(0 if ok else 1)
EOF
done
[ "$text_curl" = "$text_py" ] || fail "curl and openai answers differ: '$text_curl' vs '$text_py'"
echo "check_quickstart: /generate answered: $text_curl"
echo "check_quickstart: OK ($(( $(date +%s) - t0 )) s)"
