# Sourced by the bench scripts: builds the release binary and makes the preset `PRESET`
# (default mixtral-bench-1b) under models/ if missing.
# Sets `bin`, `preset`, `model` and a scratch directory `work` that is removed on exit.
cargo build --release --quiet --bin moeserve
bin=target/release/moeserve
preset=${PRESET:-mixtral-bench-1b}
model=models/$preset
[ -f "$model/config.json" ] || "$bin" make-model --preset "$preset" --out "$model"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
