#!/usr/bin/env bash
# Installs what the tests need beyond cargo and python3, where it is missing: Debian's headless
# Chromium and its WebDriver (tests/e2e/tests/dashboard.rs), Prometheus and promtool
# (tests/e2e/tests/prometheus.rs), and g++ (the CUDA kernels' CPU emulator,
# scripts/emulate-kernels.sh). scripts/test.sh runs it first, so README's one test command is
# the whole set-up on a fresh machine; .ci/run reaches it through scripts/test.sh.
#
# Nothing is pinned tighter than the archive keeps: Debian replaces a package's version with each
# point or security release (prometheus 2.42.0+ds-5+b6 became +deb12u1), and an exact pin then
# fails at install. Instead the installed tools are checked after install: Prometheus must be a
# 2.x release (the configs and the promtool rule tests are written for 2.x), Chromium and
# ChromeDriver must share one major version (a driver speaks only to its own browser).
#
# Needs root or sudo only when something is missing. MOESERVE_SKIP_TOOL_INSTALL=1 skips the
# install and the checks (the tests that need a missing tool then fail naming it).
set -euo pipefail

missing=()
command -v chromium > /dev/null || missing+=(chromium)
command -v chromedriver > /dev/null || missing+=(chromium-driver)
if ! command -v prometheus > /dev/null || ! command -v promtool > /dev/null; then
    missing+=(prometheus)
fi
command -v g++ > /dev/null || missing+=(g++)

if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ "${MOESERVE_SKIP_TOOL_INSTALL:-}" == 1 ]]; then
        echo "warning: ${missing[*]} missing, install skipped (MOESERVE_SKIP_TOOL_INSTALL=1)" >&2
        exit 0
    fi
    if ! command -v apt-get > /dev/null; then
        echo "error: ${missing[*]} missing and no apt-get to install them; install them" \
            "(Chromium, ChromeDriver, Prometheus 2.x with promtool, g++) and put them on PATH" >&2
        exit 1
    fi
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then
        sudo=sudo
    fi
    echo "== installing test tools: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
        "${missing[@]}" > /dev/null
fi

# The versions the tests were written against, checked rather than pinned.
prom_version=$(prometheus --version 2>&1 | sed -n 's/^prometheus, version \([0-9][0-9.]*\).*/\1/p')
if [[ "${prom_version%%.*}" != 2 ]]; then
    echo "error: prometheus ${prom_version:-of unknown version} found; the configs and rule" \
        "tests are written for Prometheus 2.x" >&2
    exit 1
fi
chromium_major=$(chromium --version 2>&1 | sed -n 's/.*Chromium \([0-9]*\)\..*/\1/p')
driver_major=$(chromedriver --version 2>&1 | sed -n 's/.*ChromeDriver \([0-9]*\)\..*/\1/p')
if [[ -z "$chromium_major" || "$chromium_major" != "$driver_major" ]]; then
    echo "error: chromium ${chromium_major:-?} and chromedriver ${driver_major:-?} differ in" \
        "major version; install both from one release (apt-get install chromium chromium-driver)" >&2
    exit 1
fi
echo "test tools: prometheus $prom_version, chromium and chromedriver $chromium_major"
