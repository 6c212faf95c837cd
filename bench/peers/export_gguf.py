"""Writes a Mixtral checkpoint in Hugging Face layout (bf16 safetensors) as a bf16 GGUF that
llama.cpp loads ("llama" architecture with stacked experts, as llama.cpp's own
convert_hf_to_gguf.py writes Mixtral), so both engines run the same weights.

    python bench/peers/export_gguf.py MODEL_DIR OUT.gguf [q8_0]

With `q8_0` every matrix but the routers is stored as llama.cpp's Q8_0 (int8 with one scale
per 32 values), the peer of moeserve's `--quantization int8`.

Needs numpy and gguf (pip). The tokenizer is carried over as a gpt2-style token list padded to
the model's vocab_size (the peer benchmark feeds token ids, not text).
"""

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np


def safetensors(path):
    """name -> (dtype, shape, raw memmap view) of one .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = (meta["dtype"], meta["shape"], data[start:end])
    return out


def main():
    model_dir, out_path = Path(sys.argv[1]), sys.argv[2]
    q8 = sys.argv[3:] == ["q8_0"]
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(safetensors(f))

    def bf16(name):
        dtype, shape, raw = tensors[name]
        if dtype != "BF16":
            sys.exit(f"{name}: {dtype}, this exporter takes bf16 checkpoints")
        return raw.view(np.uint16).reshape(shape)

    def f32(name):
        return (bf16(name).astype(np.uint32) << 16).view(np.float32)

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    def permute(w, heads):
        # llama.cpp rotates interleaved pairs; HF rotates halves (convert_hf_to_gguf's permute).
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name(model_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.MOSTLY_BF16)

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    tokens = [f"<unused_{i}>" for i in range(cfg["vocab_size"])]
    types = [gguf.TokenType.UNUSED] * cfg["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # tokenizers writes merges as "a b" strings or, since 0.20, as ["a", "b"] pairs.
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges or ["a b"])
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id(cfg.get("eos_token_id") or 2)

    BF16 = gguf.GGMLQuantizationType.BF16

    def matrix(name, data):
        """A bf16 matrix as stored (bf16, or Q8_0 from its f32 values)."""
        if not q8:
            w.add_tensor(name, data, raw_dtype=BF16)
            return
        values = (data.astype(np.uint32) << 16).view(np.float32)
        q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    matrix("token_embd.weight", bf16("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", f32("model.norm.weight"))
    lm_head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    matrix("output.weight", bf16(lm_head))
    for l in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{l}", f"blk.{l}"
        w.add_tensor(f"{b}.attn_norm.weight", f32(f"{p}.input_layernorm.weight"))
        w.add_tensor(f"{b}.ffn_norm.weight", f32(f"{p}.post_attention_layernorm.weight"))
        matrix(f"{b}.attn_q.weight", permute(bf16(f"{p}.self_attn.q_proj.weight"), n_head))
        matrix(f"{b}.attn_k.weight", permute(bf16(f"{p}.self_attn.k_proj.weight"), n_kv))
        matrix(f"{b}.attn_v.weight", bf16(f"{p}.self_attn.v_proj.weight"))
        matrix(f"{b}.attn_output.weight", bf16(f"{p}.self_attn.o_proj.weight"))
        w.add_tensor(f"{b}.ffn_gate_inp.weight", f32(f"{p}.block_sparse_moe.gate.weight"))
        experts = range(cfg["num_local_experts"])
        for gguf_name, hf in [("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")]:
            stacked = np.stack([bf16(f"{p}.block_sparse_moe.experts.{e}.{hf}.weight") for e in experts])
            matrix(f"{b}.{gguf_name}.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
