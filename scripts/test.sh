#!/usr/bin/env bash
# Runs every test: installs the test tools that are missing (scripts/install-test-tools.sh:
# Chromium, ChromeDriver, Prometheus), prepares the demo model if it is missing (the demo-model
# parity tests need it), builds the `moeserve` binary (the end-to-end tests in tests/e2e start
# it), runs the whole cargo workspace, then the official `openai` Python client against the real server
# (tests/e2e/test_openai_client.py, structured outputs checked with jsonschema) and the hub-id
# tests against huggingface_hub's cache scanner (tests/e2e/test_hf_hub.py), from a venv it keeps
# under target/e2e-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-tools.sh
models/smolmoe-8x135m.sh
cargo build --release --bin moeserve
MOESERVE_DEMO_MODEL="$PWD/models/smolmoe-8x135m" cargo test --workspace --release "$@"
# The AVX2 kernels on the same fixtures (the CPU picks AVX-512 when it has it; they must agree).
# Without AVX-512 the pass above already ran the AVX2 kernels: no second pass.
if grep -qw avx2 /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo; then
    echo "== kernels and model fixtures on the AVX2 path"
    MOESERVE_ISA=avx2 MOESERVE_DEMO_MODEL="$PWD/models/smolmoe-8x135m" \
        cargo test --release -p moeserve-backend -p moeserve-model "$@"
fi

OPENAI_VERSION="3.57.0"
PYTEST_VERSION="9.2.0"
JSONSCHEMA_VERSION="4.26.0"
HF_HUB_VERSION="2.4.0"
VENV=target/e2e-venv
if ! "$VENV/bin/python" -c "import openai, pytest, sys; from importlib.metadata import version; \
sys.exit(openai.__version__ != '$OPENAI_VERSION' or pytest.__version__ != '$PYTEST_VERSION' \
or version('jsonschema') != '$JSONSCHEMA_VERSION' or version('huggingface_hub') != '$HF_HUB_VERSION')" \
    2> /dev/null; then
    echo "== preparing $VENV (openai==$OPENAI_VERSION, pytest==$PYTEST_VERSION, jsonschema==$JSONSCHEMA_VERSION, huggingface_hub==$HF_HUB_VERSION)"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "openai==$OPENAI_VERSION" "pytest==$PYTEST_VERSION" "jsonschema==$JSONSCHEMA_VERSION" \
        "huggingface_hub==$HF_HUB_VERSION"
fi
echo "== openai client and Hugging Face cache tests"
status=0
MOESERVE_BIN="$PWD/target/release/moeserve" "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider tests/e2e/test_openai_client.py tests/e2e/test_hf_hub.py || status=$?
# Any non-zero exit fails the run, 5 ("no tests collected") included.
if [[ $status -ne 0 ]]; then
    echo "error: the Python end-to-end tests failed (pytest exit status $status)" >&2
    exit "$status"
fi

# The API fuzzed from its own OpenAPI document: schemathesis (pinned) against the real server.
MOESERVE_BIN="$PWD/target/release/moeserve" scripts/schemathesis.sh

# The CUDA backend without a GPU: NVRTC 13.0 from PyPI compiles every kernel for sm_80 / sm_90,
# the `--features cuda` build and its `--device` selection (scripts/test-cuda.sh).
scripts/test-cuda.sh
