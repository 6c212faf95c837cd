#!/usr/bin/env bash
# cargo deny over the workspace's dependency graph (config: deny.toml): licenses, bans (wildcard
# versions) and sources always; security advisories when the RustSec advisory database can be
# fetched. That database lives only on GitHub, which CI machines here cannot reach: then the
# advisories check is skipped with a notice saying so (set MOESERVE_REQUIRE_ADVISORIES=1 to
# fail instead). Installs the pinned cargo-deny when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DENY_VERSION="0.20.2"
if ! cargo deny --version 2> /dev/null | grep -qx "cargo-deny $DENY_VERSION"; then
    echo "== installing cargo-deny $DENY_VERSION"
    cargo install cargo-deny --locked --version "$DENY_VERSION"
fi
if cargo deny fetch db > /dev/null 2>&1; then
    cargo deny check
elif [[ "${MOESERVE_REQUIRE_ADVISORIES:-0}" == 1 ]]; then
    echo "error: cannot fetch the RustSec advisory database" >&2
    exit 1
else
    echo "NOTE: security advisories NOT checked: the RustSec advisory database (GitHub) cannot" \
        "be fetched from this machine; checking licenses, bans and sources only"
    cargo deny check licenses bans sources
fi
