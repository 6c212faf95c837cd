#!/usr/bin/env bash
# Checks deploy/ offline: yamllint over every manifest, kubernetes-validate --strict (the
# Kubernetes API's own schemas, shipped in the package) over every resource, and the couplings
# no schema sees: the pod's grace period covers the preStop sleep and serve.toml's
# shutdown_timeout and serve.toml's port is the pod's, and the series the autoscaler reads are
# ones moeserve exports (that serve.toml loads as a `--config` file is a cargo test:
# crates/moeserve-server/tests/configs.rs). Pinned tools in a venv under target/deploy-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBERNETES_VALIDATE_VERSION="1.37.0"
YAMLLINT_VERSION="1.38.0"
VENV=target/deploy-venv
if ! "$VENV/bin/python" -c "import sys; from importlib.metadata import version; \
sys.exit(version('kubernetes-validate') != '$KUBERNETES_VALIDATE_VERSION' \
or version('yamllint') != '$YAMLLINT_VERSION')" 2> /dev/null; then
    echo "== preparing $VENV (kubernetes-validate==$KUBERNETES_VALIDATE_VERSION, yamllint==$YAMLLINT_VERSION)"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "yamllint==$YAMLLINT_VERSION"
fi
echo "== yamllint deploy/"
"$VENV/bin/yamllint" --strict -c .yamllint.yaml deploy
echo "== kubernetes-validate --strict deploy/kubernetes"
resources=()
for f in deploy/kubernetes/*.yaml; do
    [[ $(basename "$f") == kustomization.yaml ]] || resources+=("$f")
done
out=$("$VENV/bin/kubernetes-validate" --strict "${resources[@]}" 2>&1) || { echo "$out"; exit 1; }
echo "$out"
# The only resource without a schema in the package is the Prometheus operator's CRD.
if echo "$out" | grep -v "Couldn't find schema for kind ServiceMonitor" | grep -q "^WARN"; then
    echo "error: kubernetes-validate warned about more than the ServiceMonitor CRD" >&2
    exit 1
fi
echo "== couplings"
"$VENV/bin/python" - << 'PY'
import re, sys, tomllib, yaml
from pathlib import Path

k8s = Path("deploy/kubernetes")
serve = tomllib.loads((k8s / "serve.toml").read_text())
deployment = yaml.safe_load((k8s / "deployment.yaml").read_text())
pod = deployment["spec"]["template"]["spec"]
(container,) = pod["containers"]
pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
grace = pod["terminationGracePeriodSeconds"]
needed = pre_stop + serve["shutdown_timeout"]
assert grace > needed, f"terminationGracePeriodSeconds {grace} must exceed preStop {pre_stop} + shutdown_timeout {serve['shutdown_timeout']}"
assert container["args"][-1] == "/etc/moeserve/serve.toml"
port = container["ports"][0]["containerPort"]
assert serve["port"] == port and serve["host"] == "0.0.0.0", "serve.toml listens where the pod's port is"
hpa = yaml.safe_load((k8s / "hpa.yaml").read_text())
rules = yaml.safe_load(yaml.safe_load((k8s / "prometheus-adapter-rules.yaml").read_text())["data"]["config.yaml"])["rules"]
served = {}
for rule in rules:
    series = re.match(r"'?([\w:]+)\{", rule["seriesQuery"]).group(1)
    served[re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)] = series
metrics_src = Path("crates/moeserve-engine/src/metrics.rs").read_text()
for metric in hpa["spec"]["metrics"]:
    name = metric["pods"]["metric"]["name"]
    assert name in served, f"the HPA reads {name}, which no adapter rule serves"
    assert f'"{served[name]}"' in metrics_src, f"moeserve exports no {served[name]}"
print(f"grace {grace} s > preStop {pre_stop} s + shutdown_timeout {serve['shutdown_timeout']} s; "
      f"HPA metrics {sorted(served)} served by the adapter from moeserve's series")
PY
