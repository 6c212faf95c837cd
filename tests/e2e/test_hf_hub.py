"""`moeserve serve --model org/name`: a hub id through the Hugging Face cache.

No machine here reaches the hub, so a stand-in serves the hub's file API (`/api/models/<id>/
revision/<rev>` and `/<id>/resolve/<rev>/<file>` with the headers `huggingface_hub` and hf-hub
read) for a tiny model made by `moeserve make-model`. moeserve downloads only the files the
engine needs into the cache, serves them; `huggingface_hub`'s own `scan_cache_dir` then reads
that cache (so its layout is the one the Python library writes and reads); with
`HF_HUB_OFFLINE=1` and the stand-in gone, the model loads from the cache; a missing id offline
gets a message naming the id and the cache.

scripts/test.sh runs this with pytest from target/e2e-venv (pinned huggingface_hub).
Environment: MOESERVE_BIN (default target/release/moeserve).
"""

import hashlib
import http.server
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MOESERVE_BIN", ROOT / "target" / "release" / "moeserve"))
COMMIT = "5f0c8b7e9d1a2c3b4e5f60718293a4b5c6d7e8f9"
REPO_ID = "org/tiny"
START_TIMEOUT_S = 120

os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"


class StandInHub:
    """The hub's file API for one repository at one commit, over the files of `model_dir`."""

    def __init__(self, model_dir: Path):
        self.files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
        self.requested: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requested.append(self.path)
                if self.path == f"/api/models/{REPO_ID}/revision/main":
                    body = json.dumps({
                        "id": REPO_ID, "sha": COMMIT,
                        "siblings": [{"rfilename": name} for name in sorted(hub.files)],
                    }).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                prefix = f"/{REPO_ID}/resolve/main/"
                name = self.path[len(prefix):] if self.path.startswith(prefix) else None
                if name not in hub.files:
                    self.send_error(404)
                    return
                data = hub.files[name]
                start, end = 0, len(data) - 1
                ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if ranged:
                    start = int(ranged.group(1))
                    end = min(int(ranged.group(2) or end), end)
                part = data[start:end + 1]
                self.send_response(206 if ranged else 200)
                self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest())
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                self.wfile.write(part)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class Serve:
    """`moeserve serve ARGS` on 127.0.0.1:0 with `env` added; stderr drained into `lines`."""

    def __init__(self, args: list, env: dict):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [BIN, "serve", "--host", "127.0.0.1", "--port", "0", *args],
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )
        self.base = None
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            found = re.search(r"listening on (http://[^\s\"]+)", line)
            if found and self.base is None:
                self.base = found.group(1)

    def wait_healthy(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "exited:\n" + "\n".join(self.lines)
            if self.base:
                try:
                    with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError("not healthy:\n" + "\n".join(self.lines))

    def get_json(self, path: str):
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.load(r)

    def complete(self) -> dict:
        body = json.dumps({"model": REPO_ID, "prompt": "hi", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            self.base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def exit_log(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=60)
        time.sleep(0.1)
        return code, "\n".join(self.lines)


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    assert BIN.exists(), f"{BIN} is missing: cargo build --release --bin moeserve"
    model = tmp_path / "src"
    subprocess.run([BIN, "make-model", "--preset", "mixtral-tiny", "--out", model],
                   check=True, capture_output=True, timeout=120)
    # Files a hub repository has and the engine does not read: never fetched.
    (model / "README.md").write_text("# tiny\n")
    (model / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    return model


def test_a_hub_id_downloads_only_what_the_engine_reads_then_serves_offline(tmp_path, tiny_model):
    hub = StandInHub(tiny_model)
    cache = tmp_path / "hub-cache"
    offline_env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}
    server = Serve(["--model", REPO_ID, "--download-dir", cache], offline_env)
    try:
        server.wait_healthy()
        models = server.get_json("/v1/models")
        assert models["data"][0]["id"] == REPO_ID  # --served-model-name defaults to the id
        assert server.complete()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
        hub.stop()
    log = "\n".join(server.lines)
    assert "fetching model.safetensors" in log, log
    fetched = {p.rsplit("/", 1)[1] for p in hub.requested if "/resolve/" in p}
    assert "config.json" in fetched and "model.safetensors" in fetched, hub.requested
    assert not fetched & {"README.md", "pytorch_model.bin"}, hub.requested

    # The cache is the one huggingface_hub reads: one model repo, the commit, refs/main.
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT
    assert set(revision.refs) == {"main"}
    assert {f.file_name for f in revision.files} == fetched
    for f in revision.files:
        assert f.blob_path.is_file() and f.file_path.is_symlink()
        assert f.file_path.read_bytes() == (tiny_model / f.file_name).read_bytes()

    # Offline, the stand-in gone: served from the cache (found through HF_HUB_CACHE).
    server = Serve(["--model", REPO_ID],
                   {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url})
    try:
        server.wait_healthy()
        assert server.get_json("/v1/models")["data"][0]["id"] == REPO_ID
        assert server.complete()["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
    assert any("from the Hugging Face cache" in line for line in server.lines), server.lines
    # `generate` takes the id too.
    out = subprocess.run(
        [BIN, "generate", "--model", REPO_ID, "--prompt-ids", "1,2,3", "--max-tokens", "2",
         "--ignore-eos", "--json"],
        env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 2, out.stdout

    # A model the cache lacks, offline: the message names the id and the cache searched.
    code, log = Serve(["--model", "org/missing"],
                      {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                       "HF_HUB_CACHE": ""}).exit_log()
    assert code != 0, log
    assert "org/missing" in log and str(tmp_path / "hub") in log, log
