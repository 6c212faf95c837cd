#!/usr/bin/env bash
# Runs every test: prepares the demo model if it is missing (the demo-model parity tests need
# it), then the whole cargo workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
models/smolmoe-8x135m.sh
MOESERVE_DEMO_MODEL="$PWD/models/smolmoe-8x135m" cargo test --workspace --release "$@"
