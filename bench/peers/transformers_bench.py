"""transformers (PyTorch, CPU, bf16 weights) on a Hugging Face checkpoint, the peer side of
bench/peer_transformers.sh. Prints one JSON object:

- batch 1: prefill tokens/s (one forward over the prompt) and decode tokens/s (greedy steps
  with the KV cache, the tokens after the first), medians over REPEATS, and the greedy tokens;
- batched: for each B in BATCHES, B copies of the prompt set (B random prompts of the same
  length, so no padding) through `generate` (greedy, exactly OUTPUT_LEN new tokens): output
  tokens/s over the whole call, prefill included, as moeserve `generate` reports it.

    python bench/peers/transformers_bench.py MODEL_DIR PROMPTS_JSON OUTPUT_LEN THREADS REPEATS BATCHES

PROMPTS_JSON holds a list of prompts (token id lists, all the same length); batch 1 uses the
first; BATCHES is a comma-separated list (e.g. 8,32).
"""

import json
import statistics
import sys
import time
import warnings

import torch
from transformers import AutoModelForCausalLM


def batch1(model, prompt, output_len, repeats):
    prefill, decode, first_tokens = [], [], None
    for _ in range(repeats):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            prefill.append(len(prompt) / (time.perf_counter() - start))
            past = out.past_key_values
            tokens = [int(out.logits[0, -1].argmax())]
            start = time.perf_counter()
            for _ in range(output_len - 1):
                out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past,
                            use_cache=True)
                past = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
            decode.append((output_len - 1) / (time.perf_counter() - start))
        first_tokens = first_tokens or tokens
    return statistics.median(prefill), statistics.median(decode), first_tokens


def batched(model, prompts, output_len):
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False)
        elapsed = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    assert new == output_len, f"generated {new} tokens, wanted {output_len}"
    return len(prompts) * output_len / elapsed


def main():
    # transformers 5.24 warns that `past_key_values` will be renamed; the name still works.
    warnings.filterwarnings("ignore", category=FutureWarning)
    path, prompts_file, output_len, threads, repeats, batches = sys.argv[1:7]
    prompts = json.loads(open(prompts_file).read())
    output_len, threads, repeats = int(output_len), int(threads), int(repeats)
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    # No end-of-sequence stop: every sequence generates exactly output_len tokens.
    model.generation_config.eos_token_id = None
    prefill, decode, tokens = batch1(model, prompts[0], output_len, repeats)
    result = {
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": decode,
        "token_ids": tokens,
        "batched_output_tokens_per_s": {},
    }
    for b in [int(b) for b in batches.split(",") if b]:
        result["batched_output_tokens_per_s"][str(b)] = batched(model, prompts[:b], output_len)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
