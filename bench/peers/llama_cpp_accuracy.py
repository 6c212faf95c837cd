"""Teacher-forced accuracy of llama.cpp (through llama-cpp-python) on a GGUF against the
transformers references of a fixture: the peer side of the int8 accuracy figures in
bench/RESULTS.md (moeserve's are `cargo test --release -p moeserve-model --test int8`).

For every reference prompt the prompt and the reference's greedy tokens are evaluated in one
pass; at each generated position the GGUF's logprob of the reference token is compared with the
reference's (mean |Δlogprob|) and its argmax with the reference token (greedy agreement).

    python bench/peers/llama_cpp_accuracy.py MODEL.gguf FIXTURE_DIR [FIXTURE_DIR ...] [--threads N]
"""

import argparse
import json
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("fixtures", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = Llama(args.gguf, n_ctx=1024, n_batch=1024, n_threads=args.threads, logits_all=True,
                verbose=False)
    for fixture in args.fixtures:
        prompts = json.loads((Path(fixture) / "reference.json").read_text())["prompts"]
        delta = agree = n = 0
        for p in prompts:
            ids, start = p["prompt_ids"] + p["greedy_ids"], len(p["prompt_ids"])
            llm.reset()
            llm.eval(ids)
            logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
            m = logits.max(-1, keepdims=True)
            lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
            for i, (t, want) in enumerate(zip(p["greedy_ids"], p["greedy_logprobs"])):
                row = lp[start - 1 + i]
                delta += abs(row[t] - want)
                agree += int(np.argmax(row) == t)
                n += 1
        print(json.dumps({"gguf": Path(args.gguf).name, "fixture": Path(fixture).name,
                          "mean_abs_delta_logprob": round(delta / n, 4),
                          "greedy_agreement": round(agree / n, 4), "positions": n}), flush=True)


if __name__ == "__main__":
    main()
