"""TPOT of unconstrained requests with and without constrained neighbours (issue 25).

Against a running `moeserve serve` (URL in argv[1], model name in argv[2]): per round, three
batches run one after another, each a set of requests sent at once and streamed:
  alone       N unconstrained requests
  +free       the same N, and N more unconstrained ones
  +json       the same N, and N constrained by a JSON schema (response_format)
Every request makes exactly OUTPUT_LEN tokens (the free ones `ignore_eos`, the constrained ones a
schema that never closes before max_tokens), so +free and +json run the same batch sizes and
differ only in the token masks. TPOT per request = (last token - first token) / (tokens - 1),
measured from the stream; reported: the median over the N measured requests, then the median
over ROUNDS rounds, with the server's mask counters (/metrics) for the +json batches.
Standard library only.
"""

import json
import os
import statistics
import sys
import threading
import time
import urllib.request

URL, MODEL = sys.argv[1], sys.argv[2]
N = int(os.environ.get("N", "4"))
OUTPUT_LEN = int(os.environ.get("OUTPUT_LEN", "64"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
PROMPT = "Write a long list of the animals you know, one per line:"
# A list of short strings: open-ended, so it lasts the whole max_tokens.
SCHEMA = {"type": "object", "properties": {"animals": {"type": "array", "items": {
    "type": "string", "maxLength": 12}}}, "required": ["animals"]}


def stream(body):
    """Streams one completion; returns (TPOT seconds, completion tokens)."""
    body = dict(body, model=MODEL, prompt=PROMPT, max_tokens=OUTPUT_LEN, temperature=0,
                stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(URL + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    first = last = None
    tokens = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                now = time.perf_counter()
                first = first or now
                last = now
    return (last - first) / max(tokens - 1, 1), tokens


FREE = {"ignore_eos": True}
JSON = {"response_format": {"type": "json_schema",
                            "json_schema": {"name": "animals", "schema": SCHEMA}}}


def batch(bodies):
    results = [None] * len(bodies)

    def run(i):
        results[i] = stream(bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def mask_counters():
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("masks_total", "mask_seconds", "wait_seconds"):
            if line.startswith(f"moeserve:structured_output_{name}{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def main():
    medians = {"alone": [], "+free": [], "+json": []}
    masks = {"masks_total": 0.0, "mask_seconds": 0.0, "wait_seconds": 0.0}
    steps = []
    for _ in range(ROUNDS):
        for name, neighbours in (("alone", []), ("+free", [FREE] * N), ("+json", [JSON] * N)):
            before = mask_counters()
            results = batch([FREE] * N + neighbours)
            after = mask_counters()
            assert all(t == OUTPUT_LEN for _, t in results), results
            medians[name].append(statistics.median(tpot for tpot, _ in results[:N]))
            if name == "+json":
                for key in masks:
                    masks[key] += after.get(key, 0) - before.get(key, 0)
                steps.append(statistics.median(tpot for tpot, _ in results[N:]))
    print(f"N = {N} unconstrained requests, {OUTPUT_LEN} tokens each, {ROUNDS} rounds")
    print("| batch | requests at once | unconstrained TPOT, median (ms) | per round (ms) |")
    print("|---|---|---|---|")
    for name, values in medians.items():
        at_once = N if name == "alone" else 2 * N
        rounds = ", ".join(f"{v * 1e3:.1f}" for v in values)
        print(f"| {name} | {at_once} | {statistics.median(values) * 1e3:.1f} | {rounds} |")
    ratio = statistics.median(medians["+json"]) / statistics.median(medians["+free"])
    print(f"+json / +free TPOT: {ratio:.3f}")
    print(f"constrained requests' own TPOT, median: {statistics.median(steps) * 1e3:.1f} ms")
    if masks["masks_total"]:
        per_mask = masks["mask_seconds"] / masks["masks_total"] * 1e6
        print(f"masks: {masks['masks_total']:.0f}, {per_mask:.0f} µs each on the mask thread; "
              f"steps waited {masks['wait_seconds'] * 1e3:.1f} ms for them in all")


main()
