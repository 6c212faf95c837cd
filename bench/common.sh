# Sourced by the bench scripts: builds the release binary and makes mixtral-bench-1b if missing.
# Sets `bin`, `model` and a scratch directory `work` that is removed on exit.
cargo build --release --quiet --bin moeserve
bin=target/release/moeserve
model=models/mixtral-bench-1b
[ -f "$model/config.json" ] || "$bin" make-model --preset mixtral-bench-1b --out "$model"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
