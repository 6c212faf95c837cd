#!/usr/bin/env bash
# Fuzzes the real server against its own OpenAPI document (GET /openapi.json) with schemathesis
# (pinned, from PyPI, in a venv under target/schemathesis-venv): a mixtral-tiny checkpoint is
# made, `moeserve serve` starts on 127.0.0.1:0, and every route gets up to $EXAMPLES generated
# requests (schemathesis' coverage and fuzzing phases, valid and invalid data). Checks: no 5xx,
# every status code documented, the content type and the body valid against the document (so
# every 4xx is in OpenAI's error shape). Environment: EXAMPLES (default 100), SCHEMATHESIS_SEED
# (default 1, so CI runs are reproducible), MOESERVE_BIN (default target/release/moeserve).
set -euo pipefail
cd "$(dirname "$0")/.."
SCHEMATHESIS_VERSION="4.32.5"
EXAMPLES="${EXAMPLES:-100}"
SEED="${SCHEMATHESIS_SEED:-1}"
BIN="${MOESERVE_BIN:-target/release/moeserve}"
VENV=target/schemathesis-venv
if ! "$VENV/bin/python" -c "import sys; from importlib.metadata import version; \
sys.exit(version('schemathesis') != '$SCHEMATHESIS_VERSION')" 2> /dev/null; then
    echo "== preparing $VENV (schemathesis==$SCHEMATHESIS_VERSION)"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "schemathesis==$SCHEMATHESIS_VERSION"
fi
[[ -x "$BIN" ]] || cargo build --release --bin moeserve
work=$(mktemp -d)
server=""
cleanup() {
    [[ -n "$server" ]] && kill "$server" 2> /dev/null && wait "$server" 2> /dev/null
    rm -rf "$work"
}
trap cleanup EXIT
"$BIN" make-model --preset mixtral-tiny --out "$work/tiny" 2> /dev/null
"$BIN" serve --model "$work/tiny" --host 127.0.0.1 --port 0 --max-model-len 128 \
    2> "$work/server.log" &
server=$!
base=""
for _ in $(seq 300); do
    base=$(sed -n 's/.*listening on \(http:\/\/[^ "]*\).*/\1/p' "$work/server.log" | head -n 1)
    [[ -n "$base" ]] && grep -q "ready: serving" "$work/server.log" && break
    kill -0 "$server" 2> /dev/null || { cat "$work/server.log"; exit 1; }
    sleep 0.1
done
echo "== schemathesis $SCHEMATHESIS_VERSION against $base/openapi.json ($EXAMPLES examples per route, seed $SEED)"
start=$(date +%s)
"$VENV/bin/schemathesis" run "$base/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --max-examples "$EXAMPLES" --seed "$SEED" --request-timeout 60 --no-color
echo "== schemathesis passed in $(( $(date +%s) - start )) s"
