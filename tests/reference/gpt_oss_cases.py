"""Tiny random GPT-OSS checkpoints with transformers float32 references.

Owns fixture set G: tests/fixtures/gpt-oss/, in the mixtral-* layout (config.json,
generation_config.json, model.safetensors, reference.json, expected.safetensors, manifest.json;
see mixtral_cases.py, whose helpers it reuses). Follows transformers 5.24's modeling_gpt_oss.py:
- attention: q/k/v/o biases, a learned sink logit per head (`self_attn.sinks`) in the softmax's
  denominator, `layer_types` alternating sliding (window `sliding_window`) and full attention,
  RoPE by halves with YaRN;
- MoE block: `mlp.router.{weight,bias}`, top-k of the raw logits then a softmax over the k;
  experts `mlp.experts.gate_up_proj [E, H, 2I]` (input-major, even columns gate, odd up) with
  `gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]` with `down_proj_bias [E, H]`;
  `gate.clamp(max=limit)`, `up.clamp(-limit, limit)`, `(up + 1) · gate · σ(alpha · gate)`.
transformers has no conversion rules for gpt_oss: the module names are the checkpoint's (as in
the hub's bf16 copies of gpt-oss-20b), and save_pretrained writes them back unchanged.

Fixture set G also holds gpt-oss-mxfp4/: the same weights (the same seed) with the experts
packed as the release ships them (`quantization_config: {"quant_method": "mxfp4"}`;
`*_blocks` u8 `[E, rows, cols/32, 16]`, two e2m1 values per byte, low nibble first, and
`*_scales` u8 e8m0 `[E, rows, cols/32]`, rows the output features). Its references are
transformers on the dequantised weights, and from_pretrained with `Mxfp4Config(dequantize=True)`
must give the same logits, so the packing is the one transformers reads. Its
`dequant_probe.safetensors` holds blocks covering every byte value with scales from 0 to 254
and transformers' `convert_moe_packed_tensors` of them in float32.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from mixtral_cases import (
    EOS_TOKEN_ID,
    EXPECTED_PROMPT_INDEX,
    MAX_POSITIONS,
    MAX_SEED_TRIES,
    NEW_TOKENS,
    PROMPT_LENGTHS,
    ROPE_THETA,
    VOCAB,
    read_tensors,
    rejection,
    same_logits,
    save_pretrained_names,
    styled_config_json,
    write_tensors,
)
from moe_family_cases import _attrs, _replaced, _rms_norm
from ref_common import GreedyParams, greedy_generate, write_json


@dataclass(frozen=True)
class GptOssCase:
    name: str
    dtype: torch.dtype
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    experts: int
    top_k: int
    intermediate: int
    swiglu_limit: float
    swiglu_alpha: float
    rope: dict
    base_seed: int
    rms_norm_eps: float = 1e-5
    embed_std: float = 1.0
    bias_std: float = 0.5
    sink_std: float = 1.5
    # The experts as MXFP4 blocks, quantised from the weights of the bf16 case of this name
    # (whose seed they reuse).
    mxfp4_of: str | None = None


CASES = (
    GptOssCase(
        # Sliding, full, sliding; a window of 8 (shorter than two of the prompts and than every
        # continuation); head_dim 32 with q_dim 128 ≠ hidden 64; a SwiGLU limit small enough to
        # clamp a good part of the gate and up values; YaRN over 4× the original context,
        # not truncated, as the release configures it. hidden and intermediate are multiples
        # of MXFP4's 32-element blocks.
        name="gpt-oss", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=2, head_dim=32,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=8,
        experts=8, top_k=2, intermediate=64, swiglu_limit=1.2, swiglu_alpha=1.702, base_seed=14000,
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
              "beta_slow": 1.0, "truncate": False},
    ),
)
CASES = (*CASES, replace(CASES[0], name="gpt-oss-mxfp4", mxfp4_of="gpt-oss"))

# What the release's config.json leaves in bf16.
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def make_config(case: GptOssCase) -> GptOssConfig:
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=case.hidden,
        num_hidden_layers=len(case.layer_types),
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.head_dim,
        num_local_experts=case.experts,
        num_experts_per_tok=case.top_k,
        intermediate_size=case.intermediate,
        layer_types=list(case.layer_types),
        sliding_window=case.sliding_window,
        swiglu_limit=case.swiglu_limit,
        swiglu_alpha=case.swiglu_alpha,
        rms_norm_eps=case.rms_norm_eps,
        rope_parameters={"rope_theta": ROPE_THETA, **case.rope},
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        attention_bias=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        dtype=case.dtype,
        attn_implementation="eager",
    )
    config.architectures = ["GptOssForCausalLM"]
    return config


def init_tensors(case: GptOssCase, seed: int) -> dict[str, torch.Tensor]:
    """Random module-named weights in the case dtype; every bias, norm weight and sink random."""
    gen = torch.Generator().manual_seed(seed)
    h, hd, e, inter = case.hidden, case.head_dim, case.experts, case.intermediate
    q_width, kv_width = case.heads * hd, case.kv_heads * hd

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn((size,), generator=gen, dtype=torch.float32)

    tensors = {"model.embed_tokens.weight": normal((VOCAB, h), case.embed_std)}
    for layer in range(len(case.layer_types)):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight(h)
        for name, rows, std in (("q", q_width, 1.3), ("k", kv_width, 1.3), ("v", kv_width, 1.0)):
            tensors[f"{a}.{name}_proj.weight"] = normal((rows, h), std / h**0.5)
            tensors[f"{a}.{name}_proj.bias"] = normal((rows,), case.bias_std)
        tensors[f"{a}.o_proj.weight"] = normal((h, q_width), 1.0 / q_width**0.5)
        tensors[f"{a}.o_proj.bias"] = normal((h,), case.bias_std)
        tensors[f"{a}.sinks"] = normal((case.heads,), case.sink_std)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight(h)
        m = f"{p}.mlp"
        tensors[f"{m}.router.weight"] = normal((e, h), 2.0 / h**0.5)
        tensors[f"{m}.router.bias"] = normal((e,), case.bias_std)
        tensors[f"{m}.experts.gate_up_proj"] = normal((e, h, 2 * inter), 1.5 / h**0.5)
        tensors[f"{m}.experts.gate_up_proj_bias"] = normal((e, 2 * inter), case.bias_std)
        tensors[f"{m}.experts.down_proj"] = normal((e, inter, h), 1.0 / inter**0.5)
        tensors[f"{m}.experts.down_proj_bias"] = normal((e, h), case.bias_std)
    tensors["model.norm.weight"] = norm_weight(h)
    tensors["lm_head.weight"] = normal((VOCAB, h), 3.0 / h**0.5)
    return {name: t.to(case.dtype).contiguous() for name, t in tensors.items()}


def build_model(case: GptOssCase, stored: dict[str, torch.Tensor]) -> GptOssForCausalLM:
    config = make_config(case)
    config.dtype = torch.float32
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in stored.items()}, strict=True)
    return model


@torch.no_grad()
def capture_forward(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """One forward over `ids`: per-layer residual outputs, the routers' logits (bias included,
    what the top-k reads) and the logits."""
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):

        def on_layer(_module, _inputs, output, idx=idx):
            hidden = output[0] if isinstance(output, tuple) else output
            captured[f"layer_output.{idx}"] = hidden[0].detach().clone()

        def on_router(module, inputs, output, idx=idx):
            logits = output[0]
            recomputed = torch.nn.functional.linear(inputs[0].reshape(-1, module.hidden_dim), module.weight, module.bias)
            if not torch.equal(logits, recomputed):
                raise RuntimeError("router hook output is not the raw router logits")
            captured[f"router_logits.{idx}"] = logits.detach().clone()

        hooks.append(layer.register_forward_hook(on_layer))
        hooks.append(layer.mlp.router.register_forward_hook(on_router))
    try:
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    captured["logits"] = logits.detach().clone()
    return captured


def router_gap(captured: dict[str, torch.Tensor], top_k: int) -> float:
    gaps = []
    for name, logits in captured.items():
        if name.startswith("router_logits."):
            ordered = torch.sort(logits, dim=-1, descending=True).values
            gaps.append(float((ordered[:, top_k - 1] - ordered[:, top_k]).min()))
    return min(gaps)


# ---------------------------------------------------------------- MXFP4

# Magnitudes of the e2m1 codes 0..7; code | 8 is the negative of code.
FP4_MAGNITUDES = torch.tensor(FP4_VALUES[:8])
FP4_BY_CODE = torch.tensor(FP4_VALUES)
MXFP4_PROJS = ("gate_up_proj", "down_proj")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantisation of w [E, rows, cols] along cols: per 32 elements the shared exponent
    floor(log2(amax)) - 2 (e2m1's largest exponent is 2), each element rounded to the nearest
    e2m1 value (ties to the smaller magnitude, saturating at 6) → blocks u8
    [E, rows, cols/32, 16] (element 2j in the low nibble of byte j, 2j+1 in the high one) and
    scales u8 [E, rows, cols/32] (the exponent + 127)."""
    e, rows, cols = w.shape
    groups = w.float().reshape(e, rows, cols // 32, 32)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp)[..., None]
    codes = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(-1)
    codes = codes | ((scaled < 0).to(torch.int64) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def pack_experts(stored: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checkpoint with MXFP4 experts, and the model's tensors with those experts dequantised
    by transformers (`convert_moe_packed_tensors`, to bf16: exact, e2m1 times a power of two)."""
    checkpoint, dequantized = dict(stored), dict(stored)
    for name in [n for n in stored if n.endswith(MXFP4_PROJS)]:
        # The parameter is input-major [E, in, out]; blocks run along `in` per output row.
        blocks, scales = quantize_mxfp4(stored[name].float().transpose(1, 2))
        del checkpoint[name]
        checkpoint[f"{name}_blocks"], checkpoint[f"{name}_scales"] = blocks, scales
        values = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        if values.shape != stored[name].shape:
            raise RuntimeError(f"{name}: dequantised to {tuple(values.shape)}, not {tuple(stored[name].shape)}")
        mine = FP4_BY_CODE[blocks_codes(blocks)] * torch.pow(2.0, scales.float() - 127)[..., None]
        if not torch.equal(mine.flatten(2).transpose(1, 2), values.float()):
            raise RuntimeError(f"{name}: transformers' dequantisation is not e2m1 × 2^(scale - 127)")
        dequantized[name] = values.contiguous()
    return checkpoint, dequantized


def blocks_codes(blocks: torch.Tensor) -> torch.Tensor:
    """u8 blocks [..., 16] → the 32 e2m1 codes of each, in element order."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)
    return codes.reshape(*blocks.shape[:-1], 32).to(torch.int64)


def dequant_probe(seed: int) -> dict[str, torch.Tensor]:
    """Blocks holding every byte value under scales from 0 to 254 (255 is e8m0's NaN), and
    transformers' dequantisation of them in float32 ([E, cols, rows], as it returns them)."""
    gen = torch.Generator().manual_seed(seed)
    experts, rows, groups = 2, 32, 4
    blocks = torch.randint(0, 256, (experts * rows * groups * 16,), generator=gen)
    blocks[:256] = torch.arange(256)
    scales = torch.randint(0, 255, (experts * rows * groups,), generator=gen)
    edges = torch.tensor([0, 1, 2, 63, 100, 126, 127, 128, 200, 253, 254])
    scales[: len(edges)] = edges
    blocks = blocks.reshape(experts, rows, groups, 16).to(torch.uint8)
    scales = scales.reshape(experts, rows, groups).to(torch.uint8)
    values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return {"probe_blocks": blocks, "probe_scales": scales, "probe_dequantized": values.contiguous()}


def attempt(case: GptOssCase, seed: int):
    stored = init_tensors(case, seed)
    checkpoint, weights = pack_experts(stored) if case.mxfp4_of else (stored, stored)
    model = build_model(case, weights)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    results = [greedy_generate(model, p, GreedyParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    gap = min(router_gap(capture_forward(model, r.prompt_ids + r.greedy_ids[:-1]), case.top_k) for r in results)
    margin = min(r.min_margin for r in results)
    return (checkpoint, weights), model, results, margin, gap


def config_json(case: GptOssCase) -> dict:
    config = styled_config_json(make_config(case), "parameters")
    if case.mxfp4_of:
        config["quantization_config"] = {"modules_to_not_convert": MXFP4_NOT_CONVERTED, "quant_method": "mxfp4"}
    return config


def verify_checkpoint(case: GptOssCase, out: Path, stored, model, results) -> None:
    """The written tensors are the computed ones, save_pretrained writes the model's names, and
    from_pretrained on the directory gives identical logits."""
    (checkpoint, weights) = stored
    on_disk = read_tensors(out)
    if set(on_disk) != set(checkpoint) or any(not torch.equal(on_disk[k], checkpoint[k]) for k in checkpoint):
        raise RuntimeError(f"{case.name}: written tensors differ from the computed ones")
    saved = save_pretrained_names(build_model(case, weights), case.dtype)
    if saved != set(weights):
        raise RuntimeError(f"{case.name}: save_pretrained names differ: {sorted(saved ^ set(weights))}")
    # An MXFP4 checkpoint loads through transformers' own MXFP4 reader, dequantising.
    quantized = {"quantization_config": Mxfp4Config(dequantize=True)} if case.mxfp4_of else {}
    reloaded = GptOssForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", **quantized
    ).eval()
    config = reloaded.config
    if list(config.layer_types) != list(case.layer_types) or config.sliding_window != case.sliding_window:
        raise RuntimeError(f"{case.name}: config reload lost layer_types / sliding_window")
    if any(config.rope_parameters.get(k) != v for k, v in case.rope.items()):
        raise RuntimeError(f"{case.name}: config reload lost the rope parameters: {config.rope_parameters}")
    if (config.swiglu_limit, config.swiglu_alpha) != (case.swiglu_limit, case.swiglu_alpha):
        raise RuntimeError(f"{case.name}: config reload lost swiglu_limit / swiglu_alpha")
    if not same_logits(model, reloaded, results):
        raise RuntimeError(f"{case.name}: from_pretrained reload gives different logits")


# ---------------------------------------------------------------- ablations


def ablations(case: GptOssCase, model) -> dict:
    """Named context managers that each drop one GPT-OSS-specific term."""
    attns = [layer.self_attn for layer in model.model.layers]
    mlps = [layer.mlp for layer in model.model.layers]
    rotary = model.model.rotary_emb
    return {
        "sinks_off": lambda: _replaced([a.sinks for a in attns], -1e30),
        "sliding_window_off": lambda: _attrs([model.config], layer_types=["full_attention"] * len(attns)),
        "router_bias_zero": lambda: _replaced([m.router.bias for m in mlps], 0.0),
        "expert_biases_zero": lambda: _replaced(
            [b for m in mlps for b in (m.experts.gate_up_proj_bias, m.experts.down_proj_bias)], 0.0
        ),
        "swiglu_limit_off": lambda: _attrs([m.experts for m in mlps], limit=1e30),
        "attention_bias_zero": lambda: _replaced(
            [getattr(a, f"{x}_proj").bias for a in attns for x in "qkvo"], 0.0
        ),
        "yarn_attention_factor_one": lambda: _attrs([rotary], attention_scaling=1.0),
    }


@torch.no_grad()
def ablation_effects(case: GptOssCase, model, results) -> dict:
    """Per ablation: max |logit change| and how many greedy positions change argmax."""
    effects = {}
    for name, ablation in ablations(case, model).items():
        max_change, changed, positions = 0.0, 0, 0
        for r in results:
            ids = torch.tensor([r.prompt_ids + r.greedy_ids])
            base = model(ids, use_cache=False).logits[0]
            with ablation():
                ablated = model(ids, use_cache=False).logits[0]
            span = slice(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + len(r.greedy_ids))
            max_change = max(max_change, float((base - ablated).abs().max()))
            changed += int((base[span].argmax(-1) != ablated[span].argmax(-1)).sum())
            positions += len(r.greedy_ids)
        if max_change == 0.0:
            raise RuntimeError(f"{case.name}: ablation {name} does not change the logits")
        effects[name] = {"max_abs_logit_change": max_change, "greedy_argmax_changed": f"{changed}/{positions}"}
    return effects


# ---------------------------------------------------------------- independent forward


def _yarn(case: GptOssCase) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (ramp bounds not rounded: truncate false) and its attention
    factor 0.1 ln(factor) + 1, from arXiv 2309.00071."""
    dim = case.head_dim
    pos_freqs = ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factor, original = case.rope["factor"], case.rope["original_max_position_embeddings"]

    def turns_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(ROPE_THETA))

    low, high = max(turns_dim(case.rope["beta_fast"]), 0), min(turns_dim(case.rope["beta_slow"]), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
    return inv_freq, 0.1 * math.log(factor) + 1.0


def _rope(x: torch.Tensor, case: GptOssCase) -> torch.Tensor:
    """RoPE by halves on x [T, heads, head_dim]."""
    inv_freq, scaling = _yarn(case)
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv_freq
    cos, sin = (angles.cos() * scaling)[:, None], (angles.sin() * scaling)[:, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)


@torch.no_grad()
def independent_logits(case: GptOssCase, stored: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The forward written out from the formulas (not transformers' modules): logits [T, V]."""
    w = {k: v.float() for k, v in stored.items()}
    eps, n, hd = case.rms_norm_eps, len(ids), case.head_dim
    x = w["model.embed_tokens.weight"][ids]
    pos = torch.arange(n)
    for layer, kind in enumerate(case.layer_types):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ w[f"{a}{c}_proj.weight"].T + w[f"{a}{c}_proj.bias"] for c in "qkv")
        q, k, v = q.view(n, case.heads, hd), k.view(n, case.kv_heads, hd), v.view(n, case.kv_heads, hd)
        q, k = _rope(q, case), _rope(k, case)
        group = case.heads // case.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        visible = pos[None, :] <= pos[:, None]
        if kind == "sliding_attention":
            visible &= pos[:, None] - pos[None, :] < case.sliding_window
        scores = torch.einsum("thd,shd->hts", q, k) * hd**-0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = w[a + "sinks"][:, None, None].expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
        attn = torch.einsum("hts,shd->thd", probs, v).reshape(n, case.heads * hd)
        x = x + attn @ w[a + "o_proj.weight"].T + w[a + "o_proj.bias"]
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        logits = h @ w[m + "router.weight"].T + w[m + "router.bias"]
        top_v, top_i = torch.topk(logits, case.top_k, dim=-1)
        top_w = torch.softmax(top_v, dim=-1)
        out = torch.zeros_like(x)
        for e in range(case.experts):
            weight = (top_w * (top_i == e)).sum(-1, keepdim=True)
            gate_up = h @ w[m + "experts.gate_up_proj"][e] + w[m + "experts.gate_up_proj_bias"][e]
            gate = gate_up[:, 0::2].clamp(max=case.swiglu_limit)
            up = gate_up[:, 1::2].clamp(-case.swiglu_limit, case.swiglu_limit)
            act = (up + 1) * gate * torch.sigmoid(case.swiglu_alpha * gate)
            out = out + weight * (act @ w[m + "experts.down_proj"][e] + w[m + "experts.down_proj_bias"][e])
        x = x + out
    return _rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


@torch.no_grad()
def clamp_fraction(case: GptOssCase, model, ids: list[int]) -> dict:
    """The share of the experts' gate and up values the SwiGLU limit clamps, over one prompt."""
    seen = {"gate": [], "up": []}
    hooks = []
    for layer in model.model.layers:
        experts = layer.mlp.experts

        def on_experts(module, inputs, _output):
            hidden, indices = inputs[0], inputs[1]
            for e in indices.unique().tolist():
                rows = (indices == e).any(-1)
                gate_up = hidden[rows] @ module.gate_up_proj[e] + module.gate_up_proj_bias[e]
                seen["gate"].append((gate_up[:, 0::2] > module.limit).flatten())
                seen["up"].append((gate_up[:, 1::2].abs() > module.limit).flatten())

        hooks.append(experts.register_forward_hook(on_experts))
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {k: float(torch.cat(v).float().mean()) for k, v in seen.items()}


# ---------------------------------------------------------------- driver


def generate_case(case: GptOssCase, fixtures: Path, provenance: dict) -> dict:
    out = fixtures / case.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # The MXFP4 case packs the weights of its bf16 case: that case's seed, and no other.
    seeds = range(case.base_seed, case.base_seed + MAX_SEED_TRIES)
    if case.mxfp4_of:
        seeds = [json.loads((fixtures / case.mxfp4_of / "manifest.json").read_text())["seed"]]
    for seed in seeds:
        stored, model, results, margin, gap = attempt(case, seed)
        why = rejection(results, margin, gap)
        if why is None:
            break
        print(f"  {case.name}: seed {seed} rejected ({why})")
    else:
        raise RuntimeError(f"{case.name}: no seed gave decisive margins")
    write_json(out / "config.json", config_json(case))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID})
    write_tensors(out, stored[0], 1)
    verify_checkpoint(case, out, stored, model, results)
    stored = stored[1]
    write_json(out / "reference.json", {"case": case.name, "prompts": [r.as_reference() for r in results]})
    expected_ids = results[EXPECTED_PROMPT_INDEX].prompt_ids
    expected = {k: v.contiguous() for k, v in capture_forward(model, expected_ids).items()}
    save_file(expected, str(out / "expected.safetensors"), metadata={"format": "pt"})
    independent_diff = float((independent_logits(case, stored, expected_ids) - expected["logits"]).abs().max())
    if independent_diff > 1e-3:
        raise RuntimeError(f"{case.name}: the written-out forward differs from transformers by {independent_diff}")
    manifest = {
        "case": case.name,
        "family": "gpt_oss",
        "architecture": "GptOssForCausalLM",
        **provenance,
        "seed": seed,
        "dtype": str(case.dtype).removeprefix("torch."),
        "compute_dtype": "float32 (stored values upcast), attn_implementation eager, full recompute per step",
        "experts_implementation": model.config._experts_implementation,  # noqa: SLF001 - transformers' default
        "layer_types": list(case.layer_types),
        "sliding_window": case.sliding_window,
        "min_greedy_margin": margin,
        "min_router_topk_gap": gap,
        "independent_forward_max_abs_logit_diff": independent_diff,
        "ablations": ablation_effects(case, model, results),
        "swiglu_limit_fraction_clamped": clamp_fraction(case, model, expected_ids),
        "expected_prompt_index": EXPECTED_PROMPT_INDEX,
        "greedy_ids_contain_eos": False,
        "distinct_greedy_ids_per_prompt": [len(set(r.greedy_ids)) for r in results],
        "new_tokens": NEW_TOKENS,
    }
    if case.mxfp4_of:
        probe = dequant_probe(seed)
        save_file(probe, str(out / "dequant_probe.safetensors"), metadata={"format": "pt"})
        bf16 = init_tensors(case, seed)
        manifest["mxfp4"] = {
            "packed_from": case.mxfp4_of,
            "quantization": "OCP MX: shared exponent floor(log2(amax)) - 2 per 32, nearest e2m1 (ties down)",
            "reference_weights": "transformers' convert_moe_packed_tensors of the blocks (bf16, exact)",
            "reload": "from_pretrained with Mxfp4Config(dequantize=True) gives identical logits",
            "max_abs_expert_weight_change": max(
                float((stored[n].float() - bf16[n].float()).abs().max()) for n in stored if n.endswith(MXFP4_PROJS)
            ),
            "probe": "dequant_probe.safetensors: every byte value, scales 0..254, float32 dequantisation",
        }
    write_json(out / "manifest.json", manifest)
    print(f"  {case.name}: seed {seed}, min margin {margin:.4f}, router gap {gap:.4f}")
    return manifest
