"""Tiny random Qwen3-MoE, Qwen2-MoE, OLMoE, GLM-4.5 and DeepSeek-V2/V3 checkpoints with transformers
float32 references.

Owns fixture set F: tests/fixtures/{qwen3-moe,qwen3-moe-fused,qwen2-moe,olmoe,qwen3-moe-yarn,glm4-moe,
deepseek-v2-lite,deepseek-v2,deepseek-v3,deepseek-v3-fp8,qwen3-moe-gptq,qwen2-moe-awq}/, each in
the mixtral-* layout (config.json, generation_config.json, model.safetensors,
reference.json, expected.safetensors, manifest.json; see mixtral_cases.py, whose
helpers it reuses). Follows transformers 5.24's
modeling_{qwen3_moe,qwen2_moe,olmoe,glm4_moe,deepseek_v2,deepseek_v3}.py and the "qwen2_moe" rules
of conversion_mapping.py (qwen3_moe, olmoe, glm4_moe and deepseek_v2/v3 map to them):
hub per-expert `mlp.experts.N.{gate,up,down}_proj.weight` are merged on load into
`mlp.experts.gate_up_proj` [E, 2*I, H] (MergeModulelist(dim=0) then Concatenate(dim=1):
gate rows first, then up) and `mlp.experts.down_proj` [E, H, I]; save_pretrained splits
them back into the hub names. qwen3-moe-fused stores the merged module names instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from int4_formats import Int4Scheme, int4_checkpoint, int4_config, int4_dequantized, int4_worst_error
from mixtral_cases import (
    capture_forward,
    EOS_TOKEN_ID,
    EXPECTED_PROMPT_INDEX,
    MAX_POSITIONS,
    MAX_SEED_TRIES,
    NEW_TOKENS,
    ROPE_THETA,
    VOCAB,
    is_sparse_layer,
    read_tensors,
    rejection,
    run_references,
    same_logits,
    save_pretrained_names,
    styled_config_json,
    write_expected,
    write_tensors,
)
from ref_common import write_json

FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
# Families whose router and MoE block follow DeepSeek (first_k_dense_replace, n_routed_experts,
# shared_experts without a gate, routed_scaling_factor, groups).
DEEPSEEK_MOE = ("glm4_moe", "deepseek_v2", "deepseek_v3")
# DeepSeek-V3's sigmoid router with e_score_correction_bias (noaux_tc).
SIGMOID_ROUTER = ("glm4_moe", "deepseek_v3")
# Multi-head latent attention.
MLA = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class FamilyCase:
    name: str
    family: str  # a FAMILIES key (the config's model_type)
    dtype: torch.dtype
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int | None  # written to the config when set; None: hidden // heads
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int  # Qwen moe_intermediate_size, OLMoE intermediate_size
    norm_topk_prob: bool
    tied: bool
    config_style: str  # as MixtralCase.config_style
    rms_norm_eps: float
    base_seed: int
    dense_intermediate: int | None = None  # Qwen intermediate_size: the dense layers' MLP
    shared_intermediate: int | None = None  # Qwen2-MoE shared_expert_intermediate_size
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    clip_qkv: float | None = None
    fused_experts: bool = False  # store mlp.experts.{gate_up_proj,down_proj} (module names)
    embed_std: float = 1.0
    residual_gain: float = 1.0
    bias_std: float = 0.5
    shared_gate_std: float = 2.0
    # GLM-4.5: the first `first_k_dense` layers dense, DeepSeek-V3's sigmoid router with
    # `e_score_correction_bias`, groups and scaling, shared experts without a gate, partial
    # rotary, optional q/k norm per head and q/k/v bias.
    first_k_dense: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    partial_rotary: float = 1.0
    qk_norm: bool = False
    attention_bias: bool = False
    n_shared: int = 0
    correction_bias_std: float = 0.15
    rope: dict | None = None  # rope_parameters beyond rope_theta (e.g. YaRN's); None: default
    # DeepSeek-V2/V3 multi-head latent attention: q through q_proj (q_lora_rank None) or
    # q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> [kv_lora_rank | qk_rope];
    # kv_b_proj -> per head [qk_nope | v_head].
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    topk_method: str = "greedy"  # DeepSeek-V2: greedy or group_limited_greedy
    rope_interleave: bool = True  # DeepSeek-V3 (V2's complex RoPE is always interleaved)
    mtp_layers: int = 0  # DeepSeek-V3 MTP layers written after the last layer (ignored)
    # FP8 block checkpoints (DeepSeek-V3's release format): every linear weight but the
    # embeddings, lm_head and the routers stored as float8_e4m3fn with a float32
    # `weight_scale_inv` per (rows, cols) block; the reference runs on the dequantised weights.
    fp8_block: tuple[int, int] | None = None
    # GPTQ / AWQ int4 checkpoints (int4_formats.py): the decoder layers' linear weights stored as
    # packed 4-bit words with per-group scales and zero points; the reference runs on the
    # dequantised weights.
    int4: Int4Scheme | None = None

    @property
    def mla(self) -> bool:
        return self.family in MLA

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def rotary_dim(self) -> int:
        """The dimensions RoPE turns: MLA's rope slice, else the rotated part of a head."""
        return self.qk_rope if self.mla else int(self.attn_head_dim * self.partial_rotary)

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def dense_layers(self) -> list[int]:
        """Layers with a dense MLP, by the modeling code's rule (OLMoE has none)."""
        if self.family == "olmoe":
            return []
        if self.family in DEEPSEEK_MOE:
            return list(range(self.first_k_dense))
        return [
            layer
            for layer in range(self.layers)
            if layer in self.mlp_only_layers or (layer + 1) % self.decoder_sparse_step != 0
        ]


CASES = (
    FamilyCase(
        name="qwen3-moe", family="qwen3_moe", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=2, head_dim=24,
        layers=3, experts=8, top_k=2, expert_intermediate=48, dense_intermediate=128, mlp_only_layers=(1,),
        norm_topk_prob=True, tied=False, config_style="parameters", rms_norm_eps=1e-6, base_seed=5000,
    ),
    FamilyCase(
        name="qwen3-moe-fused", family="qwen3_moe", dtype=torch.float32, hidden=48, heads=6, kv_heads=2, head_dim=16,
        layers=4, experts=6, top_k=3, expert_intermediate=40, dense_intermediate=96, decoder_sparse_step=2,
        norm_topk_prob=False, tied=False, config_style="legacy", rms_norm_eps=1e-6, base_seed=6000,
        fused_experts=True,
    ),
    FamilyCase(
        # Untied: with tied embeddings (and the q/k/v biases) greedy output falls into short loops.
        name="qwen2-moe", family="qwen2_moe", dtype=torch.float16, hidden=64, heads=4, kv_heads=2, head_dim=24,
        layers=3, experts=12, top_k=3, expert_intermediate=32, dense_intermediate=128, shared_intermediate=96,
        mlp_only_layers=(0,), norm_topk_prob=False, tied=False, config_style="legacy", rms_norm_eps=1e-6,
        base_seed=7000,
    ),
    FamilyCase(
        name="olmoe", family="olmoe", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=2, head_dim=None,
        layers=3, experts=8, top_k=2, expert_intermediate=48, clip_qkv=2.0, norm_topk_prob=False, tied=False,
        config_style="top_level", rms_norm_eps=1e-5, base_seed=8000,
    ),
    FamilyCase(
        # YaRN over a context 4x the original: interpolated slow frequencies, cos/sin scaled.
        name="qwen3-moe-yarn", family="qwen3_moe", dtype=torch.float32, hidden=64, heads=4, kv_heads=2,
        head_dim=24, layers=2, experts=8, top_k=2, expert_intermediate=48, dense_intermediate=128,
        norm_topk_prob=True, tied=False, config_style="parameters", rms_norm_eps=1e-6, base_seed=9500,
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    FamilyCase(
        # 16 experts in 4 groups of which 2 are kept, top-4, scaled by 2.5; a quarter of each
        # head rotated; the hub's config style (top-level rope_theta, partial_rotary_factor).
        name="glm4-moe", family="glm4_moe", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=2, head_dim=32,
        layers=3, experts=16, top_k=4, expert_intermediate=32, dense_intermediate=128, norm_topk_prob=True,
        tied=False, config_style="legacy", rms_norm_eps=1e-5, base_seed=9000, first_k_dense=1, n_group=4,
        topk_group=2, routed_scaling=2.5, partial_rotary=0.25, qk_norm=True, attention_bias=True, n_shared=2,
    ),
    FamilyCase(
        # DeepSeek-V2-Lite's shape in small: q through q_proj (no q LoRA), greedy top-k of the
        # softmax, not renormalised, 2 shared experts, first layer dense, YaRN with V2-Lite's
        # mscale = mscale_all_dim = 0.707 (cos/sin unscaled, softmax scale times mscale^2); the
        # hub's config style (rope_scaling with "type").
        name="deepseek-v2-lite", family="deepseek_v2", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=4,
        head_dim=None, layers=3, experts=16, top_k=4, expert_intermediate=32, dense_intermediate=128,
        norm_topk_prob=False, tied=False, config_style="legacy", rms_norm_eps=1e-6, base_seed=10000,
        first_k_dense=1, n_shared=2, kv_lora_rank=32, qk_nope=16, qk_rope=16, v_head=24, topk_method="greedy",
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
              "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    ),
    FamilyCase(
        # DeepSeek-V2's: q LoRA, group-limited greedy (groups scored by their best expert),
        # routed scaling, biases on q_a/kv_a/o; YaRN whose mscale differs from mscale_all_dim
        # (cos/sin scaled too).
        name="deepseek-v2", family="deepseek_v2", dtype=torch.float32, hidden=64, heads=4, kv_heads=4,
        head_dim=None, layers=3, experts=16, top_k=4, expert_intermediate=32, dense_intermediate=128,
        norm_topk_prob=False, tied=False, config_style="parameters", rms_norm_eps=1e-6, base_seed=11000,
        first_k_dense=1, n_shared=1, n_group=4, topk_group=2, routed_scaling=2.0, attention_bias=True,
        q_lora_rank=48, kv_lora_rank=32, qk_nope=16, qk_rope=16, v_head=24, topk_method="group_limited_greedy",
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
              "mscale_all_dim": 0.5},
    ),
    FamilyCase(
        # DeepSeek-V3's: q LoRA, noaux_tc (sigmoid, correction bias, 4 groups keep 2 by their two
        # best biased scores, renormalised, scaled 2.5), interleaved RoPE, one MTP layer on disk.
        name="deepseek-v3", family="deepseek_v3", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=4,
        head_dim=None, layers=3, experts=16, top_k=4, expert_intermediate=32, dense_intermediate=128,
        norm_topk_prob=True, tied=False, config_style="legacy", rms_norm_eps=1e-6, base_seed=12000,
        first_k_dense=1, n_shared=1, n_group=4, topk_group=2, routed_scaling=2.5, q_lora_rank=48,
        kv_lora_rank=32, qk_nope=16, qk_rope=16, v_head=24, rope_interleave=True, mtp_layers=1,
    ),
    FamilyCase(
        # The V3 case stored as DeepSeek-V3 ships: FP8 e4m3 blocks with per-block scales (32 x 32
        # here, so the small matrices have several blocks each way, some partial).
        name="deepseek-v3-fp8", family="deepseek_v3", dtype=torch.bfloat16, hidden=64, heads=4, kv_heads=4,
        head_dim=None, layers=3, experts=16, top_k=4, expert_intermediate=32, dense_intermediate=128,
        norm_topk_prob=True, tied=False, config_style="legacy", rms_norm_eps=1e-6, base_seed=13000,
        first_k_dense=1, n_shared=1, n_group=4, topk_group=2, routed_scaling=2.5, q_lora_rank=48,
        kv_lora_rank=32, qk_nope=16, qk_rope=16, v_head=24, rope_interleave=True, fp8_block=(32, 32),
    ),
    FamilyCase(
        # Qwen3-MoE as its GPTQ-Int4 releases ship: attention and experts in int4, asymmetric,
        # groups of 32 (down_proj's 48 inputs end in a partial group) over act-order's permuted
        # inputs (g_idx), v1 zero points; routers, embeddings and lm_head in f16.
        name="qwen3-moe-gptq", family="qwen3_moe", dtype=torch.float16, hidden=64, heads=4, kv_heads=2,
        head_dim=24, layers=3, experts=8, top_k=2, expert_intermediate=48, dense_intermediate=128,
        mlp_only_layers=(1,), norm_topk_prob=True, tied=False, config_style="legacy", rms_norm_eps=1e-6,
        base_seed=14000, int4=Int4Scheme("gptq", 32, desc_act=True, sym=False),
    ),
    FamilyCase(
        # Qwen2-MoE in AWQ's GEMM packing, groups of 32: the shared expert too; its one-output
        # gate, the routers, embeddings and lm_head stay f16.
        name="qwen2-moe-awq", family="qwen2_moe", dtype=torch.float16, hidden=64, heads=4, kv_heads=2,
        head_dim=24, layers=3, experts=12, top_k=3, expert_intermediate=32, dense_intermediate=128,
        shared_intermediate=96, mlp_only_layers=(0,), norm_topk_prob=False, tied=False, config_style="legacy",
        rms_norm_eps=1e-6, base_seed=15000, int4=Int4Scheme("awq", 32),
    ),
)


def make_config(case: FamilyCase):
    config_cls, model_cls = FAMILIES[case.family]
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": case.hidden,
        "num_hidden_layers": case.layers,
        "num_attention_heads": case.heads,
        "num_key_value_heads": case.kv_heads,
        "num_experts": case.experts,
        "num_experts_per_tok": case.top_k,
        "norm_topk_prob": case.norm_topk_prob,
        "rms_norm_eps": case.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "tie_word_embeddings": case.tied,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "dtype": case.dtype,
        "attn_implementation": "eager",
    }
    if case.head_dim is not None:
        kwargs["head_dim"] = case.head_dim
    if case.rope is not None:
        kwargs["rope_parameters"] = {"rope_theta": ROPE_THETA, **case.rope}
    if case.family == "olmoe":
        kwargs.update(intermediate_size=case.expert_intermediate, clip_qkv=case.clip_qkv)
    else:
        kwargs.update(
            intermediate_size=case.dense_intermediate,
            moe_intermediate_size=case.expert_intermediate,
            mlp_only_layers=list(case.mlp_only_layers),
            decoder_sparse_step=case.decoder_sparse_step,
            use_sliding_window=False,
        )
    if case.family == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=case.shared_intermediate, qkv_bias=True)
    if case.family in DEEPSEEK_MOE:  # DeepSeek's MoE block, in its config names
        for key in ("num_experts", "mlp_only_layers", "decoder_sparse_step", "use_sliding_window"):
            del kwargs[key]
        kwargs.update(
            n_routed_experts=case.experts,
            n_shared_experts=case.n_shared,
            first_k_dense_replace=case.first_k_dense,
            n_group=case.n_group,
            topk_group=case.topk_group,
            routed_scaling_factor=case.routed_scaling,
            attention_bias=case.attention_bias,
        )
    if case.family == "glm4_moe":
        kwargs["use_qk_norm"] = case.qk_norm
        kwargs["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": case.partial_rotary,
        }
    if case.mla:
        kwargs.pop("head_dim", None)
        kwargs.update(
            q_lora_rank=case.q_lora_rank,
            kv_lora_rank=case.kv_lora_rank,
            qk_nope_head_dim=case.qk_nope,
            qk_rope_head_dim=case.qk_rope,
            v_head_dim=case.v_head,
        )
        if case.family == "deepseek_v2":
            kwargs["topk_method"] = case.topk_method
        else:
            kwargs.update(rope_interleave=case.rope_interleave, num_nextn_predict_layers=case.mtp_layers)
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    return config


def init_hub_tensors(case: FamilyCase, seed: int) -> dict[str, torch.Tensor]:
    """Random hub-named weights (per-expert experts), stored in the case dtype.

    Scales follow mixtral_cases.init_hub_tensors; every norm weight, bias and gate is
    random so that a skipped or misplaced term changes the outputs.
    """
    gen = torch.Generator().manual_seed(seed)
    hd = case.attn_head_dim

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn((size,), generator=gen, dtype=torch.float32)

    def mlp(prefix: str, inter: int) -> None:
        tensors[f"{prefix}.gate_proj.weight"] = normal((inter, h), 1.0 / h**0.5)
        tensors[f"{prefix}.up_proj.weight"] = normal((inter, h), 1.0 / h**0.5)
        tensors[f"{prefix}.down_proj.weight"] = normal((h, inter), case.residual_gain / inter**0.5)

    def plain_attention(p: str) -> None:
        tensors[f"{p}.self_attn.q_proj.weight"] = normal((q_width, h), 1.3 / h**0.5)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal((kv_width, h), 1.3 / h**0.5)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal((kv_width, h), 1.0 / h**0.5)
        if case.family == "qwen2_moe" or case.attention_bias:
            tensors[f"{p}.self_attn.q_proj.bias"] = normal((q_width,), case.bias_std)
            tensors[f"{p}.self_attn.k_proj.bias"] = normal((kv_width,), case.bias_std)
            tensors[f"{p}.self_attn.v_proj.bias"] = normal((kv_width,), case.bias_std)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal((h, q_width), case.residual_gain / q_width**0.5)
        if case.family == "qwen3_moe" or case.qk_norm:  # per head, over head_dim
            tensors[f"{p}.self_attn.q_norm.weight"] = norm_weight(hd)
            tensors[f"{p}.self_attn.k_norm.weight"] = norm_weight(hd)
        elif case.family == "olmoe":  # over the whole q / k projection
            tensors[f"{p}.self_attn.q_norm.weight"] = norm_weight(q_width)
            tensors[f"{p}.self_attn.k_norm.weight"] = norm_weight(kv_width)

    def mla_attention(a: str) -> None:
        q_out, kv_a = case.heads * case.qk_head, case.kv_lora_rank + case.qk_rope
        if case.q_lora_rank is None:
            tensors[f"{a}.q_proj.weight"] = normal((q_out, h), 1.3 / h**0.5)
        else:
            tensors[f"{a}.q_a_proj.weight"] = normal((case.q_lora_rank, h), 1.0 / h**0.5)
            tensors[f"{a}.q_a_layernorm.weight"] = norm_weight(case.q_lora_rank)
            tensors[f"{a}.q_b_proj.weight"] = normal((q_out, case.q_lora_rank), 1.3 / case.q_lora_rank**0.5)
        tensors[f"{a}.kv_a_proj_with_mqa.weight"] = normal((kv_a, h), 1.3 / h**0.5)
        tensors[f"{a}.kv_a_layernorm.weight"] = norm_weight(case.kv_lora_rank)
        kv_b_out = case.heads * (case.qk_nope + case.v_head)
        tensors[f"{a}.kv_b_proj.weight"] = normal((kv_b_out, case.kv_lora_rank), 1.0 / case.kv_lora_rank**0.5)
        o_in = case.heads * case.v_head
        tensors[f"{a}.o_proj.weight"] = normal((h, o_in), case.residual_gain / o_in**0.5)
        if case.attention_bias:  # DeepSeek puts it on q_a, kv_a and o (never q_proj, q_b, kv_b)
            if case.q_lora_rank is not None:
                tensors[f"{a}.q_a_proj.bias"] = normal((case.q_lora_rank,), case.bias_std)
            tensors[f"{a}.kv_a_proj_with_mqa.bias"] = normal((kv_a,), case.bias_std)
            tensors[f"{a}.o_proj.bias"] = normal((h,), case.bias_std)

    h = case.hidden
    q_width, kv_width = case.heads * hd, case.kv_heads * hd
    tensors = {"model.embed_tokens.weight": normal((VOCAB, h), case.embed_std)}
    for layer in range(case.layers):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight(h)
        if case.mla:
            mla_attention(f"{p}.self_attn")
        else:
            plain_attention(p)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight(h)
        if layer in case.dense_layers:
            mlp(f"{p}.mlp", case.dense_intermediate)
            continue
        tensors[f"{p}.mlp.gate.weight"] = normal((case.experts, h), 2.0 / h**0.5)
        for e in range(case.experts):
            mlp(f"{p}.mlp.experts.{e}", case.expert_intermediate)
        if case.family == "qwen2_moe":
            mlp(f"{p}.mlp.shared_expert", case.shared_intermediate)
            tensors[f"{p}.mlp.shared_expert_gate.weight"] = normal((1, h), case.shared_gate_std / h**0.5)
        if case.family in SIGMOID_ROUTER:
            # Sigmoid scores live in (0, 1): a bias of this size moves some choices.
            tensors[f"{p}.mlp.gate.e_score_correction_bias"] = normal((case.experts,), case.correction_bias_std)
        if case.family in DEEPSEEK_MOE:
            mlp(f"{p}.mlp.shared_experts", case.expert_intermediate * case.n_shared)
    tensors["model.norm.weight"] = norm_weight(h)
    if not case.tied:
        tensors["lm_head.weight"] = normal((VOCAB, h), 3.0 / h**0.5)
    return {name: t.to(stored_dtype(case, name)).contiguous() for name, t in tensors.items()}


def stored_dtype(case: FamilyCase, name: str) -> torch.dtype:
    """The case dtype, but GLM-4.5's and DeepSeek's router weight and correction bias stay
    float32 on disk (their `_keep_in_fp32_modules_strict`, as save_pretrained writes them)."""
    if case.family in DEEPSEEK_MOE and name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
        return torch.float32
    return case.dtype


def fuse_experts(case: FamilyCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert hub names -> transformers 5.24's fused module names (same dtype, exact)."""
    fused = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    for layer in range(case.layers):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in tensors:
            if f"{p}.gate_up_proj" in tensors:  # already fused
                fused[f"{p}.gate_up_proj"] = tensors[f"{p}.gate_up_proj"]
                fused[f"{p}.down_proj"] = tensors[f"{p}.down_proj"]
            continue
        experts = range(case.experts)
        gate_up = [torch.cat([tensors[f"{p}.{e}.{proj}.weight"] for proj in ("gate_proj", "up_proj")]) for e in experts]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in experts]).contiguous()
    return fused


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def is_fp8_quantized(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's FP8 release: every linear weight but embed_tokens, lm_head and the routers."""
    keep = ("model.embed_tokens.weight", "lm_head.weight")
    return t.dim() == 2 and name.endswith(".weight") and name not in keep and not name.endswith("mlp.gate.weight")


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scales [ceil(n/br), ceil(k/bc)]): each block scaled so its
    largest magnitude is 448, as DeepSeek's and transformers' FP8 quantizers do."""
    (n, k), (br, bc) = w.shape, block
    rows, cols = -(-n // br), -(-k // bc)
    padded = torch.zeros(rows * br, cols * bc)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, br, cols, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(rows * br, cols * bc)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    (n, k), (br, bc) = q.shape, block
    return q.float() * scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]


def fp8_checkpoint(case: FamilyCase, hub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub tensors with the FP8 ones replaced by `weight` + `weight_scale_inv`."""
    out = {}
    for name, t in hub.items():
        if is_fp8_quantized(name, t):
            out[name], out[name + "_scale_inv"] = fp8_quantize(t, case.fp8_block)
        else:
            out[name] = t
    return out


def dequantized(case: FamilyCase, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float weights an FP8 or int4 checkpoint stands for (the stored tensors otherwise)."""
    if case.int4 is not None:
        return int4_dequantized(case.int4, stored)
    if case.fp8_block is None:
        return stored
    return {
        name: fp8_dequantize(t, stored[name + "_scale_inv"], case.fp8_block) if t.dtype == torch.float8_e4m3fn else t
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }


def module_state_dict(case: FamilyCase, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stored = dequantized(case, stored)
    state = {name: t.to(torch.float32) for name, t in fuse_experts(case, stored).items()}
    if case.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def build_model(case: FamilyCase, stored: dict[str, torch.Tensor]):
    config = make_config(case)
    config.dtype = torch.float32
    model = FAMILIES[case.family][1](config).to(torch.float32).eval()
    model.load_state_dict(module_state_dict(case, stored), strict=True)
    if case.tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{case.name}: lm_head is not tied to embed_tokens")
    dense = [i for i, layer in enumerate(model.model.layers) if not is_sparse_layer(layer)]
    if dense != case.dense_layers:
        raise RuntimeError(f"{case.name}: dense layers {dense}, expected {case.dense_layers}")
    return model


def attempt(case: FamilyCase, seed: int):
    hub = init_hub_tensors(case, seed)
    stored = fuse_experts(case, hub) if case.fused_experts else hub
    if case.fp8_block is not None:
        stored = fp8_checkpoint(case, stored)
    if case.int4 is not None:
        stored = int4_checkpoint(case.int4, stored, seed)
    model = build_model(case, stored)
    results, greedy_margin, router_gap = run_references(model, seed, case.top_k)
    if case.family in SIGMOID_ROUTER or case.topk_method == "group_limited_greedy":
        # These routers decide on biased scores and groups, not on the top-k of the logits.
        router_gap = min(
            choice_gap(case, model, capture_forward(model, r.prompt_ids + r.greedy_ids[:-1])) for r in results
        )
    return hub, stored, model, results, greedy_margin, router_gap


def config_json(case: FamilyCase) -> dict:
    config = styled_config_json(make_config(case), case.config_style)
    if case.family == "qwen3_moe" and case.config_style == "legacy":
        # transformers 5.24 writes Qwen3-MoE's expert count as num_local_experts (its
        # attribute_map); the hub's Qwen3-MoE configs, like this style, say num_experts.
        config["num_experts"] = config.pop("num_local_experts")
    if case.family == "glm4_moe" and case.config_style != "parameters":
        # The hub's GLM-4.5 configs give it beside rope_theta, at the top level.
        config["partial_rotary_factor"] = case.partial_rotary
    if case.fp8_block is not None:  # as DeepSeek-V3's release says it
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(case.fp8_block),
        }
    if case.int4 is not None:  # as GPTQModel / optimum and AutoAWQ write it
        config["quantization_config"] = int4_config(case.int4)
    if case.mla and case.config_style != "parameters" and case.rope is not None:
        # The hub's DeepSeek configs say YaRN as `rope_scaling` with "type".
        scaling = {k: v for k, v in case.rope.items() if k != "rope_type"}
        config["rope_scaling"] = {"type": case.rope["rope_type"], **scaling}
    return dict(sorted(config.items()))


def mtp_tensors(case: FamilyCase) -> dict[str, torch.Tensor]:
    """Some of a DeepSeek-V3 MTP layer's tensors (`model.layers.{num_hidden_layers}.*`): on
    disk as V3 ships them, not part of the model (transformers and moeserve ignore them)."""
    gen = torch.Generator().manual_seed(case.base_seed + 777)
    h = case.hidden
    shapes = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "self_attn.kv_a_proj_with_mqa.weight": (case.kv_lora_rank + case.qk_rope, h),
        "mlp.gate.weight": (case.experts, h),
    }
    return {
        f"model.layers.{case.layers + i}.{name}": torch.randn(shape, generator=gen).to(case.dtype).contiguous()
        for i in range(case.mtp_layers)
        for name, shape in shapes.items()
    }


def write_checkpoint(case: FamilyCase, out: Path, stored: dict[str, torch.Tensor]) -> None:
    write_json(out / "config.json", config_json(case))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID})
    write_tensors(out, {**stored, **mtp_tensors(case)}, 1)


def verify_checkpoint(case: FamilyCase, out: Path, stored, model, results, *, hub) -> bool:
    """Reload the written directory with from_pretrained and demand identical weights and outputs.

    Returns whether save_pretrained writes exactly the checkpoint's tensor names
    (required for the per-expert cases; a fused checkpoint is saved back per expert).
    """
    mtp = mtp_tensors(case)
    on_disk = {k: v for k, v in read_tensors(out).items() if k not in mtp}
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # float8 has no CPU equality: compare bits
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
            if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)

    if set(on_disk) != set(stored) or any(not same(on_disk[k], stored[k]) for k in stored):
        raise RuntimeError(f"{case.name}: written tensors differ from the computed ones")
    saved = save_pretrained_names(build_model(case, stored), case.dtype)
    if saved != set(hub):  # transformers writes the hub (per-expert) names in every case
        raise RuntimeError(f"{case.name}: save_pretrained names differ: {sorted(saved ^ set(hub))}")
    if case.fp8_block is not None:
        # transformers' FP8 loader needs an accelerator; the reference model was built from the
        # dequantised weights above, and the dequantisation is checked against the bf16 ones.
        worst = max(
            float((w.float() - hub_w.float()).abs().max() / hub_w.float().abs().max())
            for name, w in dequantized(case, stored).items()
            for hub_w in [hub[name]]
            if stored[name].dtype == torch.float8_e4m3fn
        )
        if worst > 1 / 16:  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a value
            raise RuntimeError(f"{case.name}: FP8 dequantisation is off by {worst} of a block's range")
        return False
    if case.int4 is not None:
        # transformers loads GPTQ / AWQ through gptqmodel / autoawq, which need an accelerator
        # or a kernel build; the reference model was built from the dequantised weights above,
        # checked here to be within a step of the float ones.
        worst = int4_worst_error(case.int4, stored, hub)
        if worst > 1.0:
            raise RuntimeError(f"{case.name}: int4 dequantisation is off by {worst} steps")
        return False
    model_cls = FAMILIES[case.family][1]
    reloaded, info = model_cls.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    reloaded.eval()
    info["unexpected_keys"] = set(info.get("unexpected_keys") or ()) - set(mtp)  # the MTP layer's
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
        raise RuntimeError(f"{case.name}: from_pretrained loading info {info}")
    config = reloaded.config
    if case.rope is not None and any(config.rope_parameters.get(k) != v for k, v in case.rope.items()):
        raise RuntimeError(f"{case.name}: config reload lost the rope parameters: {config.rope_parameters}")
    if config.rope_parameters["rope_theta"] != ROPE_THETA or config.norm_topk_prob != case.norm_topk_prob:
        raise RuntimeError(f"{case.name}: config reload lost rope_theta/norm_topk_prob")
    mla_fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    mla_values = (case.q_lora_rank, case.kv_lora_rank, case.qk_nope, case.qk_rope, case.v_head)
    if case.mla and tuple(getattr(config, k) for k in mla_fields) != mla_values:
        raise RuntimeError(f"{case.name}: config reload lost the MLA shape")
    if case.family == "deepseek_v2" and config.topk_method != case.topk_method:
        raise RuntimeError(f"{case.name}: config reload lost topk_method")
    if case.family == "deepseek_v3" and config.rope_interleave != case.rope_interleave:
        raise RuntimeError(f"{case.name}: config reload lost rope_interleave")
    if not case.mla and reloaded.model.layers[0].self_attn.head_dim != case.attn_head_dim:
        raise RuntimeError(f"{case.name}: reloaded head_dim {reloaded.model.layers[0].self_attn.head_dim}")
    if getattr(config, "clip_qkv", None) != case.clip_qkv or getattr(config, "sliding_window", None):
        raise RuntimeError(f"{case.name}: config reload lost clip_qkv or enabled a sliding window")
    if case.family == "glm4_moe" and config.rope_parameters.get("partial_rotary_factor") != case.partial_rotary:
        raise RuntimeError(f"{case.name}: config reload lost partial_rotary_factor: {config.rope_parameters}")
    expected_state = module_state_dict(case, stored)
    reloaded_state = reloaded.state_dict()
    if set(reloaded_state) != set(expected_state):
        raise RuntimeError(f"{case.name}: module names differ: {sorted(set(reloaded_state) ^ set(expected_state))}")
    for name, tensor in expected_state.items():  # transformers' fusion convention equals ours
        if not torch.equal(reloaded_state[name], tensor):
            raise RuntimeError(f"{case.name}: reloaded {name} differs from the fused stored tensors")
    if not same_logits(model, reloaded, results):
        raise RuntimeError(f"{case.name}: from_pretrained reload gives different logits")
    return saved == set(stored)


# ---------------------------------------------------------------- ablations


@contextlib.contextmanager
def _hooked(modules, hook):
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _replaced(params, fill: float):
    saved = [p.data.clone() for p in params]
    try:
        for p in params:
            p.data.fill_(fill)
        yield
    finally:
        for p, data in zip(params, saved):
            p.data.copy_(data)


@contextlib.contextmanager
def _config_value(config, key: str, value):
    saved = getattr(config, key)
    setattr(config, key, value)
    try:
        yield
    finally:
        setattr(config, key, saved)


@contextlib.contextmanager
def _plain_rope(rotary, inv_freq: torch.Tensor):
    saved = rotary.inv_freq.clone(), rotary.attention_scaling
    try:
        rotary.inv_freq.copy_(inv_freq)
        rotary.attention_scaling = 1.0
        yield
    finally:
        rotary.inv_freq.copy_(saved[0])
        rotary.attention_scaling = saved[1]


@contextlib.contextmanager
def _attrs(objects, **values):
    saved = [{k: getattr(o, k) for k in values} for o in objects]
    try:
        for o in objects:
            for k, v in values.items():
                setattr(o, k, v)
        yield
    finally:
        for o, old in zip(objects, saved):
            for k, v in old.items():
                setattr(o, k, v)


@contextlib.contextmanager
def _flipped_norm_topk(routers):
    try:
        for router in routers:
            router.norm_topk_prob = not router.norm_topk_prob
        yield
    finally:
        for router in routers:
            router.norm_topk_prob = not router.norm_topk_prob


def ablations(case: FamilyCase, model) -> dict:
    """Named context managers that each drop one family-specific term from the model."""
    layers = model.model.layers
    attns = [layer.self_attn for layer in layers]
    sparse = [layer.mlp for layer in layers if is_sparse_layer(layer)]
    out = {}
    if case.family != "deepseek_v2":  # V2's router has no norm_topk_prob
        out["norm_topk_prob_flipped"] = lambda: _flipped_norm_topk([m.gate for m in sparse])
    if case.family in ("qwen3_moe", "olmoe"):
        norms = [a.q_norm for a in attns] + [a.k_norm for a in attns]
        out["qk_norm_skipped"] = lambda: _hooked(norms, lambda _m, inputs, _o: inputs[0])
        out["qk_norm_weight_ones"] = lambda: _replaced([n.weight for n in norms], 1.0)
    if case.family == "olmoe":
        out["clip_qkv_off"] = lambda: _config_value(model.config, "clip_qkv", None)
    if case.rope is not None:
        rotary = model.model.rotary_emb
        plain, _ = _inv_freq(dataclasses.replace(case, rope=None), case.rotary_dim)
        out["rope_scaling_off"] = lambda: _plain_rope(rotary, plain)
    if case.family in DEEPSEEK_MOE:
        routers = [m.gate for m in sparse]
        if case.family in SIGMOID_ROUTER:
            out["correction_bias_zero"] = lambda: _replaced([r.e_score_correction_bias for r in routers], 0.0)
        if case.routed_scaling != 1.0:
            out["routed_scaling_one"] = lambda: _attrs(routers, routed_scaling_factor=1.0)
        if case.family in SIGMOID_ROUTER:
            out["group_limit_off"] = lambda: _attrs(routers, num_group=1, topk_group=1)
        if case.topk_method == "group_limited_greedy":
            out["group_limit_off"] = lambda: _attrs(routers, topk_method="greedy")
        out["shared_experts_skipped"] = lambda: _hooked([m.shared_experts for m in sparse], lambda _m, _i, o: o * 0)
    if case.mla:
        latent_norms = [a.kv_a_layernorm for a in attns]
        out["kv_a_layernorm_skipped"] = lambda: _hooked(latent_norms, lambda _m, inputs, _o: inputs[0])
        if case.q_lora_rank is not None:
            q_norms = [a.q_a_layernorm for a in attns]
            out["q_a_layernorm_skipped"] = lambda: _hooked(q_norms, lambda _m, inputs, _o: inputs[0])
        if case.family == "deepseek_v3":
            interleave = model.config.rope_interleave
            out["rope_interleave_flipped"] = lambda: _config_value(model.config, "rope_interleave", not interleave)
        if case.rope is not None and case.rope.get("mscale_all_dim"):
            out["softmax_mscale_off"] = lambda: _attrs(attns, scaling=case.qk_head**-0.5)
        if case.attention_bias:
            biases = [a.kv_a_proj_with_mqa.bias for a in attns] + [a.o_proj.bias for a in attns]
            biases += [a.q_a_proj.bias for a in attns if a.q_a_proj is not None]
            out["attention_bias_zero"] = lambda: _replaced(biases, 0.0)
    if case.family == "glm4_moe":
        if case.qk_norm:
            norms = [a.q_norm for a in attns] + [a.k_norm for a in attns]
            out["qk_norm_skipped"] = lambda: _hooked(norms, lambda _m, inputs, _o: inputs[0])
        if case.attention_bias:
            biases = [getattr(a, f"{x}_proj").bias for a in attns for x in "qkv"]
            out["qkv_bias_zero"] = lambda: _replaced(biases, 0.0)
    if case.family == "qwen2_moe":
        biases = [getattr(a, f"{x}_proj").bias for a in attns for x in "qkv"]
        out["qkv_bias_zero"] = lambda: _replaced(biases, 0.0)
        gates = [m.shared_expert_gate for m in sparse]
        out["shared_expert_gate_one"] = lambda: _hooked(gates, lambda _m, _i, o: torch.full_like(o, 100.0))
        out["shared_expert_gate_half"] = lambda: _hooked(gates, lambda _m, _i, o: torch.zeros_like(o))
        out["shared_expert_skipped"] = lambda: _hooked([m.shared_expert for m in sparse], lambda _m, _i, o: o * 0)
    return out


@torch.no_grad()
def ablation_effects(case: FamilyCase, model, results) -> dict:
    """Per ablation: max |logit change| and how many of the greedy positions change argmax."""
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


@torch.no_grad()
def family_stats(case: FamilyCase, model, ids: list[int]) -> dict:
    """Statistics of the family-specific terms over one prompt (the expected.safetensors one)."""
    layers = model.model.layers
    values: dict[str, list[torch.Tensor]] = {}

    def record(key):
        return lambda _m, _i, output: values.setdefault(key, []).append(output.detach().flatten().clone())

    hooks = []
    if case.family == "qwen2_moe":
        for layer in layers:
            if is_sparse_layer(layer):
                hooks.append(layer.mlp.shared_expert_gate.register_forward_hook(record("gate")))
    if case.family == "olmoe":
        for layer in layers:
            hooks.append(layer.self_attn.q_norm.register_forward_hook(record("q")))
            hooks.append(layer.self_attn.k_norm.register_forward_hook(record("k")))
            hooks.append(layer.self_attn.v_proj.register_forward_hook(record("v")))
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    stats = {}
    if case.family == "qwen2_moe":
        sig = torch.sigmoid(torch.cat(values["gate"]))
        stats["shared_expert_gate_sigmoid"] = {k: float(getattr(sig, k)()) for k in ("min", "mean", "max")}
    if case.family == "olmoe":  # q/k after their norm, v raw: the tensors clip_qkv clamps
        clipped = {k: float((torch.cat(v).abs() > case.clip_qkv).float().mean()) for k, v in values.items()}
        stats["clip_qkv_fraction_clipped"] = clipped
    return stats


# ---------------------------------------------------------------- independent forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _inv_freq(case: FamilyCase, dim: int) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies over `dim` and the cos/sin scaling, from the formulas: plain,
    or YaRN (arXiv 2309.00071: a linear ramp between the dimensions that make beta_fast and
    beta_slow turns over the original context blends extrapolation and 1/factor interpolation;
    attention factor 0.1 ln(factor) + 1)."""
    pos_freqs = ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if case.rope is None or case.rope["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor, original = case.rope["factor"], case.rope["original_max_position_embeddings"]
    beta_fast, beta_slow = case.rope.get("beta_fast", 32), case.rope.get("beta_slow", 1)

    def turns_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(ROPE_THETA))

    low, high = max(math.floor(turns_dim(beta_fast)), 0), min(math.ceil(turns_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0

    if case.rope.get("mscale") and case.rope.get("mscale_all_dim"):  # DeepSeek's ratio
        return inv_freq, mscale(case.rope["mscale"]) / mscale(case.rope["mscale_all_dim"])
    return inv_freq, mscale()


def _rope(x: torch.Tensor, case: FamilyCase, rotary: int | None = None) -> torch.Tensor:
    """Non-interleaved (rotate-half) RoPE over the first `rotary` (default: all) of head_dim of
    x [T, heads, head_dim]; the rest passes through."""
    dim = rotary or x.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    inv_freq, scaling = _inv_freq(case, dim)
    freqs = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * scaling)[:, None], (emb.sin() * scaling)[:, None]
    rotated = rot * cos + torch.cat([-rot[..., dim // 2 :], rot[..., : dim // 2]], -1) * sin
    return torch.cat([rotated, rest], -1)


def _rope_pairs(x: torch.Tensor, case: FamilyCase) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [T, heads, dim], each pair turned
    by one frequency: DeepSeek's layout (V2's complex product, V3's rope_interleave)."""
    inv_freq, scaling = _inv_freq(case, x.shape[-1])
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv_freq
    cos, sin = (angles.cos() * scaling)[:, None], (angles.sin() * scaling)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def _mla_softmax_scale(case: FamilyCase) -> float:
    """qk_head^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the config sets it."""
    scale = case.qk_head**-0.5
    rope = case.rope or {}
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim") and rope["factor"] > 1:
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0) ** 2
    return scale


def _mla_attention(case: FamilyCase, w: dict, p: str, h: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """DeepSeek's multi-head latent attention, keys and values expanded from the latent."""
    n_tokens, eps = h.shape[0], 1e-6  # q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps
    a = f"{p}self_attn."

    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ w[f"{a}{name}.weight"].T + w.get(f"{a}{name}.bias", 0.0)

    if case.q_lora_rank is None:
        q = proj("q_proj", h)
    else:
        q = proj("q_b_proj", _rms_norm(proj("q_a_proj", h), w[a + "q_a_layernorm.weight"], eps))
    q = q.view(n_tokens, case.heads, case.qk_head)
    q_nope, q_rope = q.split([case.qk_nope, case.qk_rope], -1)
    latent, k_rope = proj("kv_a_proj_with_mqa", h).split([case.kv_lora_rank, case.qk_rope], -1)
    latent = _rms_norm(latent, w[a + "kv_a_layernorm.weight"], eps)
    k_rope = k_rope.view(n_tokens, 1, case.qk_rope)
    interleaved = case.family == "deepseek_v2" or case.rope_interleave
    turn = _rope_pairs if interleaved else (lambda x, c: _rope(x, c))
    q_rope, k_rope = turn(q_rope, case), turn(k_rope, case)
    kv = (latent @ w[a + "kv_b_proj.weight"].T).view(n_tokens, case.heads, case.qk_nope + case.v_head)
    k_nope, v = kv.split([case.qk_nope, case.v_head], -1)
    k = torch.cat([k_nope, k_rope.expand(-1, case.heads, -1)], -1)
    q = torch.cat([q_nope, q_rope], -1)
    probs = torch.softmax(torch.einsum("thd,shd->hts", q, k) * _mla_softmax_scale(case) + causal, dim=-1)
    attn = torch.einsum("hts,shd->thd", probs, v).reshape(n_tokens, case.heads * case.v_head)
    return proj("o_proj", attn)


def _v2_route(case: FamilyCase, logits: torch.Tensor):
    """DeepSeek-V2's routers from their description: softmax over all experts; greedy takes the
    top_k, group_limited_greedy first keeps the topk_group groups with the best single score;
    the weights (not renormalised) scaled by routed_scaling_factor."""
    scores = torch.softmax(logits, dim=-1)
    if case.topk_method == "group_limited_greedy":
        size = case.experts // case.n_group
        best = scores.view(-1, case.n_group, size).max(-1).values
        kept = best.argsort(-1, descending=True)[:, : case.topk_group]
        allowed = torch.zeros_like(best, dtype=torch.bool).scatter(1, kept, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(size, dim=1), 0.0)
    weights, indices = torch.topk(scores, case.top_k, dim=-1)
    return weights * case.routed_scaling, indices


def _sigmoid_route(case: FamilyCase, logits: torch.Tensor, bias: torch.Tensor):
    """DeepSeek-V3's noaux_tc from its description: sigmoid scores; choice on scores + bias
    within the `topk_group` groups whose two best biased scores sum highest; weights from the
    unbiased scores, renormalised, scaled. Returns (weights, indices) [T, top_k]."""
    scores = torch.sigmoid(logits)
    choice = scores + bias
    size = case.experts // case.n_group
    grouped = choice.view(-1, case.n_group, size)
    group_score = grouped.sort(-1, descending=True).values[..., :2].sum(-1)
    kept = group_score.argsort(-1, descending=True)[:, : case.topk_group]
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(size, dim=1), float("-inf"))
    indices = choice.argsort(-1, descending=True)[:, : case.top_k]
    weights = scores.gather(1, indices)
    if case.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * case.routed_scaling, indices


def choice_gap(case: FamilyCase, model, captured: dict[str, torch.Tensor]) -> float:
    """A grouped router's smallest decision margin over the captured router logits: between
    the kept and the first dropped group, and between the top_k-th and the next allowed expert.
    The sigmoid router (noaux_tc) chooses on biased scores, groups by their two best; DeepSeek-V2's
    group_limited_greedy on the softmax, groups by their best."""
    gaps = []
    for idx, layer in enumerate(model.model.layers):
        if not is_sparse_layer(layer):
            continue
        logits = captured[f"router_logits.{idx}"]
        size = case.experts // case.n_group
        if case.family in SIGMOID_ROUTER:
            choice = torch.sigmoid(logits) + layer.mlp.gate.e_score_correction_bias
            group_score = choice.view(-1, case.n_group, size).sort(-1, descending=True).values[..., :2].sum(-1)
        else:  # the softmax keeps the logits' order within a token: the same choices, in logit units
            choice = logits
            group_score = choice.view(-1, case.n_group, size).max(-1).values
        ordered = group_score.sort(-1, descending=True).values
        if case.topk_group < case.n_group:
            gaps.append(float((ordered[:, case.topk_group - 1] - ordered[:, case.topk_group]).min()))
        kept = group_score.argsort(-1, descending=True)[:, : case.topk_group]
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept, True)
        masked = choice.masked_fill(~allowed.repeat_interleave(size, dim=1), float("-inf"))
        top = masked.sort(-1, descending=True).values
        gaps.append(float((top[:, case.top_k - 1] - top[:, case.top_k]).min()))
    return min(gaps)


def _gqa_attention(case: FamilyCase, w: dict, p: str, h: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with the family's biases, q/k norms, clipping and partial rotary."""
    eps, hd, n_tokens = case.rms_norm_eps, case.attn_head_dim, h.shape[0]
    q, k, v = (h @ w[f"{p}self_attn.{n}_proj.weight"].T + w.get(f"{p}self_attn.{n}_proj.bias", 0.0) for n in "qkv")
    if case.family == "olmoe":  # norm over the flat projection, then clip q, k and v
        q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps).clamp(-case.clip_qkv, case.clip_qkv)
        k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps).clamp(-case.clip_qkv, case.clip_qkv)
        v = v.clamp(-case.clip_qkv, case.clip_qkv)
    q, k, v = q.view(n_tokens, case.heads, hd), k.view(n_tokens, case.kv_heads, hd), v.view(n_tokens, -1, hd)
    if case.family == "qwen3_moe" or case.qk_norm:  # norm per head over head_dim
        q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = _rope(q, case, case.rotary_dim), _rope(k, case, case.rotary_dim)
    group = case.heads // case.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("thd,shd->hts", q, k) * hd**-0.5 + causal, dim=-1)
    attn = torch.einsum("hts,shd->thd", probs, v).reshape(n_tokens, case.heads * hd)
    return attn @ w[p + "self_attn.o_proj.weight"].T


@torch.no_grad()
def independent_logits(case: FamilyCase, stored: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The forward written out from the formulas (not transformers' modules): logits [T, V]."""
    w = module_state_dict(case, stored)
    eps, n_tokens = case.rms_norm_eps, len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.full((n_tokens, n_tokens), float("-inf")).triu(1)
    for layer in range(case.layers):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        attention = _mla_attention if case.mla else _gqa_attention
        x = x + attention(case, w, p, h, causal)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)

        def swiglu(prefix: str, h=h, p=p) -> torch.Tensor:
            gate, up = (h @ w[f"{p}{prefix}{proj}.weight"].T for proj in ("gate_proj", "up_proj"))
            return (torch.nn.functional.silu(gate) * up) @ w[f"{p}{prefix}down_proj.weight"].T

        if layer in case.dense_layers:
            x = x + swiglu("mlp.")
            continue
        logits = h @ w[p + "mlp.gate.weight"].T
        if case.family in SIGMOID_ROUTER:
            top_w, top_i = _sigmoid_route(case, logits, w[p + "mlp.gate.e_score_correction_bias"])
        elif case.family == "deepseek_v2":
            top_w, top_i = _v2_route(case, logits)
        else:
            router_probs = torch.softmax(logits, dim=-1)  # over all experts
            top_w, top_i = torch.topk(router_probs, case.top_k, dim=-1)
            if case.norm_topk_prob:
                top_w = top_w / top_w.sum(-1, keepdim=True)
        gate_up, down = w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"]
        out = torch.zeros_like(x)
        for e in range(case.experts):
            weight = (top_w * (top_i == e)).sum(-1, keepdim=True)  # 0 where e is not selected
            gate, up = (h @ gate_up[e].T).split(case.expert_intermediate, dim=-1)  # gate rows first
            out = out + weight * ((torch.nn.functional.silu(gate) * up) @ down[e].T)
        if case.family == "qwen2_moe":
            out = out + torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].T) * swiglu("mlp.shared_expert.")
        if case.family in DEEPSEEK_MOE:
            out = out + swiglu("mlp.shared_experts.")
        x = x + out
    return _rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


# ---------------------------------------------------------------- driver


def generate_case(case: FamilyCase, fixtures: Path, provenance: dict) -> dict:
    out = fixtures / case.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for seed in range(case.base_seed, case.base_seed + MAX_SEED_TRIES):
        hub, stored, model, results, margin, router_gap = attempt(case, seed)
        why = rejection(results, margin, router_gap)
        if why is None:
            break
        print(f"  {case.name}: seed {seed} rejected ({why})")
    else:
        raise RuntimeError(f"{case.name}: no seed gave decisive margins")
    write_checkpoint(case, out, stored)
    names_match = verify_checkpoint(case, out, stored, model, results, hub=hub)
    if not names_match and not case.fused_experts and case.fp8_block is None and case.int4 is None:
        raise RuntimeError(f"{case.name}: save_pretrained does not write the checkpoint's names")
    write_json(out / "reference.json", {"case": case.name, "prompts": [r.as_reference() for r in results]})
    expected_ids = results[EXPECTED_PROMPT_INDEX].prompt_ids
    write_expected(out, model, expected_ids)
    with torch.no_grad():
        hf_logits = model(torch.tensor([expected_ids]), use_cache=False).logits[0]
    independent_diff = float((independent_logits(case, stored, expected_ids) - hf_logits).abs().max())
    if independent_diff > 1e-3:
        raise RuntimeError(f"{case.name}: the written-out forward differs from transformers by {independent_diff}")
    manifest = {
        "case": case.name,
        "family": case.family,
        "architecture": FAMILIES[case.family][1].__name__,
        **provenance,
        "seed": seed,
        "dtype": str(case.dtype).removeprefix("torch."),
        "compute_dtype": "float32 (stored values upcast), attn_implementation eager, full recompute per step",
        "experts_implementation": model.config._experts_implementation,  # noqa: SLF001 - transformers' default
        "expert_layout": "fused module names" if case.fused_experts else "per-expert hub names",
        "save_pretrained_names_equal_checkpoint": names_match,
        # FP8, GPTQ and AWQ: not reloadable through transformers on a CPU without their kernels
        "from_pretrained_logits_identical": case.fp8_block is None and case.int4 is None,
        **({} if case.fp8_block is None else {
            "fp8_weight_block_size": list(case.fp8_block),
            "fp8_matrices": sum(t.dtype == torch.float8_e4m3fn for t in stored.values()),
            "reference_weights": "the FP8 values times their block scales, in float32",
        }),
        **({} if case.int4 is None else {
            "int4": dataclasses.asdict(case.int4),
            "int4_matrices": sum(name.endswith(".qweight") for name in stored),
            "reference_weights": "(q - zero) * scale of the unpacked words, in float32",
        }),
        "dense_layers": case.dense_layers,
        "sparse_layers": [i for i in range(case.layers) if i not in case.dense_layers],
        "min_greedy_margin": margin,
        "min_router_topk_gap": router_gap,
        "independent_forward_max_abs_logit_diff": independent_diff,
        "ablations": ablation_effects(case, model, results),
        **family_stats(case, model, expected_ids),
        "expected_prompt_index": EXPECTED_PROMPT_INDEX,
        "greedy_ids_contain_eos": False,
        "distinct_greedy_ids_per_prompt": [len(set(r.greedy_ids)) for r in results],
        "new_tokens": NEW_TOKENS,
    }
    if case.family == "olmoe":
        manifest["clip_qkv_changes_logits"] = manifest["ablations"]["clip_qkv_off"]["max_abs_logit_change"] > 0
    write_json(out / "manifest.json", manifest)
    print(f"  {case.name}: seed {seed}, min margin {margin:.4f}, router gap {router_gap:.4f}")
    return manifest
