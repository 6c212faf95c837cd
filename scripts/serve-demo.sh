#!/usr/bin/env bash
# Serves the demo model over the OpenAI-compatible API on http://127.0.0.1:8000, making the model
# first if it is missing. Extra arguments go to `moeserve serve`, e.g.:
#   scripts/serve-demo.sh --port 9000 --api-key "$MY_KEY"
set -euo pipefail
cd "$(dirname "$0")/.."
models/smolmoe-8x135m.sh
exec cargo run --release --bin moeserve -- serve --model models/smolmoe-8x135m "$@"
