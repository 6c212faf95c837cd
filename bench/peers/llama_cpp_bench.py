"""Batch-1 prefill and decode of llama.cpp (through llama-cpp-python) on a GGUF, the peer side
of bench/peer_llamacpp.sh. Prints one JSON object: medians over repeats, and the greedy tokens
of the first repeat (to check that both engines run the same model).

    python bench/peers/llama_cpp_bench.py MODEL.gguf PROMPT_IDS_JSON OUTPUT_LEN THREADS REPEATS
"""

import json
import statistics
import sys
import time

import numpy as np
from llama_cpp import Llama


def next_token(llm):
    """Greedy pick from the last evaluated token's logits (llama-cpp-python keeps no scores
    unless logits_all, so they are read from the context)."""
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def main():
    path, prompt_file, output_len, threads, repeats = sys.argv[1:6]
    prompt = json.loads(open(prompt_file).read())
    output_len, threads, repeats = int(output_len), int(threads), int(repeats)
    llm = Llama(
        model_path=path,
        n_ctx=len(prompt) + output_len + 16,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prefill, decode, first_tokens = [], [], None
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - start))
        tokens = [next_token(llm)]
        start = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([tokens[-1]])
            tokens.append(next_token(llm))
        decode.append((output_len - 1) / (time.perf_counter() - start))
        first_tokens = first_tokens or tokens
    print(json.dumps({
        "prefill_tokens_per_s": statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "token_ids": first_tokens,
    }))


if __name__ == "__main__":
    main()
