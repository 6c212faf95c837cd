#!/usr/bin/env bash
# Quick start: builds moeserve, prepares the demo model if missing, and chats with it.
#   scripts/demo.sh "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
prompt=${1:-"What is the capital of France?"}
models/smolmoe-8x135m.sh
cargo run --release --quiet --bin moeserve -- generate --model models/smolmoe-8x135m --chat --prompt "$prompt"
