"""Tiny random Mixtral checkpoints with transformers float32 references.

Owns fixture set A: tests/fixtures/mixtral-{swa,tied,gqa,sharded}/ with
config.json, generation_config.json, hub-named safetensors (single file or
3 shards + model.safetensors.index.json), reference.json, expected.safetensors
and manifest.json. Follows the HF hub Mixtral layout
(`block_sparse_moe.experts.E.w{1,2,3}`), which transformers 5.24 fuses on load
into `mlp.experts.gate_up_proj` [E, 2*inter, hidden] (w1 rows first, then w3)
and `mlp.experts.down_proj` [E, hidden, inter]; its router is `mlp.gate`
(MixtralTopKRouter), whose forward returns (raw logits, top-k weights, indices).
Also owns the helpers moe_family_cases.py reuses: seed acceptance, reference
runs, forward capture, config styling, tensor writing and reload checks.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

from ref_common import GreedyParams, greedy_generate, write_json

VOCAB = 512
MAX_POSITIONS = 256
ROPE_THETA = 1_000_000.0
PROMPT_LENGTHS = (1, 7, 40)
EXPECTED_PROMPT_INDEX = 2
NEW_TOKENS = 24
MIN_GREEDY_MARGIN = 1e-3
MIN_ROUTER_GAP = 1e-3
MAX_SEED_TRIES = 64
EOS_TOKEN_ID = 2
MIN_DISTINCT_GREEDY = 8


@dataclass(frozen=True)
class MixtralCase:
    name: str
    dtype: torch.dtype
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None
    experts: int
    top_k: int
    sliding_window: int | None
    tied: bool
    shards: int
    # "legacy": top-level rope_theta + torch_dtype (like the hub's Mixtral-8x7B config);
    # "top_level": top-level rope_theta + dtype; "parameters": as transformers 5 writes it.
    config_style: str
    rms_norm_eps: float
    base_seed: int
    # Tied embeddings make the model echo tokens; a smaller embedding and a
    # stronger residual branch (o_proj, w2) keep its greedy output varied.
    embed_std: float = 1.0
    residual_gain: float = 1.0


def _case(**overrides) -> MixtralCase:
    common = {"hidden": 64, "intermediate": 128, "layers": 2, "head_dim": None, "rms_norm_eps": 1e-5, "shards": 1}
    return MixtralCase(**{**common, **overrides})


CASES = (
    _case(
        name="mixtral-swa", dtype=torch.bfloat16, heads=4, kv_heads=2, experts=8, top_k=2,
        sliding_window=16, tied=False, config_style="legacy", base_seed=1000,
    ),
    _case(
        name="mixtral-tied", dtype=torch.float16, heads=4, kv_heads=4, experts=4, top_k=2,
        sliding_window=None, tied=True, config_style="top_level", base_seed=2000, embed_std=0.4, residual_gain=3.0,
    ),
    _case(
        name="mixtral-gqa", dtype=torch.float32, heads=8, kv_heads=2, head_dim=16, intermediate=64, layers=3,
        rms_norm_eps=1e-6, experts=6, top_k=3, sliding_window=None, tied=False, config_style="parameters",
        base_seed=3000,
    ),
    _case(
        name="mixtral-sharded", dtype=torch.bfloat16, hidden=96, heads=6, kv_heads=2, experts=8, top_k=2,
        sliding_window=4096, tied=False, shards=3, config_style="parameters", base_seed=4000,
    ),
)


def make_config(case: MixtralCase) -> MixtralConfig:
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=case.hidden,
        intermediate_size=case.intermediate,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.head_dim,
        num_local_experts=case.experts,
        num_experts_per_tok=case.top_k,
        rms_norm_eps=case.rms_norm_eps,
        rope_theta=ROPE_THETA,
        sliding_window=case.sliding_window,
        tie_word_embeddings=case.tied,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        dtype=case.dtype,
        attn_implementation="eager",
    )
    config.architectures = ["MixtralForCausalLM"]
    return config


def init_hub_tensors(case: MixtralCase, seed: int) -> dict[str, torch.Tensor]:
    """Random hub-named weights, stored in the case dtype.

    Scales are larger than HF's 0.02 so attention, routing and the output
    distribution are all decisive (large greedy margins, clear top-k experts).
    """
    gen = torch.Generator().manual_seed(seed)
    head_dim = case.head_dim or case.hidden // case.heads

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn((case.hidden,), generator=gen, dtype=torch.float32)

    h, inter = case.hidden, case.intermediate
    tensors = {"model.embed_tokens.weight": normal((VOCAB, h), case.embed_std)}
    for layer in range(case.layers):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight()
        tensors[f"{p}.self_attn.q_proj.weight"] = normal((case.heads * head_dim, h), 1.3 / h**0.5)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal((case.kv_heads * head_dim, h), 1.3 / h**0.5)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal((case.kv_heads * head_dim, h), 1.0 / h**0.5)
        attn_width = case.heads * head_dim
        tensors[f"{p}.self_attn.o_proj.weight"] = normal((h, attn_width), case.residual_gain / attn_width**0.5)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        tensors[f"{p}.block_sparse_moe.gate.weight"] = normal((case.experts, h), 2.0 / h**0.5)
        for e in range(case.experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            tensors[f"{q}.w1.weight"] = normal((inter, h), 1.0 / h**0.5)
            tensors[f"{q}.w2.weight"] = normal((h, inter), case.residual_gain / inter**0.5)
            tensors[f"{q}.w3.weight"] = normal((inter, h), 1.0 / h**0.5)
    tensors["model.norm.weight"] = norm_weight()
    if not case.tied:
        tensors["lm_head.weight"] = normal((VOCAB, h), 3.0 / h**0.5)
    return {name: t.to(case.dtype).contiguous() for name, t in tensors.items()}


def fused_state_dict(case: MixtralCase, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map hub names onto transformers 5.24's fused module layout, upcast to f32."""
    f32 = {name: t.to(torch.float32) for name, t in stored.items()}
    state = {}
    for name, tensor in f32.items():
        if ".block_sparse_moe.experts." in name:
            continue
        state[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer in range(case.layers):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        experts = range(case.experts)
        gate_up = [torch.cat([f32[f"{p}.{e}.w1.weight"], f32[f"{p}.{e}.w3.weight"]], dim=0) for e in experts]
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([f32[f"{p}.{e}.w2.weight"] for e in experts])
    if case.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def build_model(case: MixtralCase, stored: dict[str, torch.Tensor]) -> MixtralForCausalLM:
    config = make_config(case)
    config.dtype = torch.float32
    model = MixtralForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(fused_state_dict(case, stored), strict=True)
    if case.tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("tied case: lm_head is not tied to embed_tokens")
    return model


@torch.no_grad()
def capture_forward(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """One forward over `ids`, capturing per-layer residual outputs and raw router logits.

    Works for every transformers 5.24 MoE decoder whose sparse layers have a
    `mlp.gate` top-k router returning (raw logits, weights, indices); layers
    without one (dense MLP layers) get no `router_logits.{l}`.
    """
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for layer_idx, layer in enumerate(model.model.layers):

        def on_layer(_module, _inputs, output, idx=layer_idx):
            hidden = output[0] if isinstance(output, tuple) else output
            captured[f"layer_output.{idx}"] = hidden[0].detach().clone()

        def on_router(module, inputs, output, idx=layer_idx):
            logits = output[0]
            recomputed = torch.nn.functional.linear(inputs[0].reshape(-1, module.hidden_dim), module.weight)
            if not torch.equal(logits, recomputed):
                raise RuntimeError("router hook output is not the raw gate logits")
            captured[f"router_logits.{idx}"] = logits.detach().clone()

        hooks.append(layer.register_forward_hook(on_layer))
        if is_sparse_layer(layer):
            hooks.append(layer.mlp.gate.register_forward_hook(on_router))
    try:
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    last = captured[f"layer_output.{len(model.model.layers) - 1}"]
    relogits = model.lm_head(model.model.norm(last[None]))[0]
    if not torch.allclose(relogits, logits, atol=1e-5, rtol=0):
        raise RuntimeError("last layer_output does not reproduce the logits")
    captured["logits"] = logits.detach().clone()
    return captured


def is_sparse_layer(layer) -> bool:
    """True for a decoder layer whose MLP is a routed MoE block (not a dense MLP)."""
    return hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")


def min_router_gap(captured: dict[str, torch.Tensor], top_k: int) -> float:
    gaps = []
    for name, logits in captured.items():
        if name.startswith("router_logits."):
            ordered = torch.sort(logits, dim=-1, descending=True).values
            gaps.append(float((ordered[:, top_k - 1] - ordered[:, top_k]).min()))
    return min(gaps)


def run_references(model, seed: int, top_k: int):
    """Greedy references for the seed's prompts, their min greedy margin and router top-k gap."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    results = [greedy_generate(model, p, GreedyParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    router_gap = min(
        min_router_gap(capture_forward(model, r.prompt_ids + r.greedy_ids[:-1]), top_k) for r in results
    )
    greedy_margin = min(r.min_margin for r in results)
    return results, greedy_margin, router_gap


def rejection(results, margin: float, router_gap: float) -> str | None:
    """Why a seed's references are not decisive enough, or None when they are."""
    # eos-free outputs keep the references valid for Rust tests that stop at eos;
    # varied outputs exercise more positions than a single echoed token.
    eos_free = all(EOS_TOKEN_ID not in r.greedy_ids for r in results)
    varied = all(len(set(r.greedy_ids)) >= MIN_DISTINCT_GREEDY for r in results)
    if margin >= MIN_GREEDY_MARGIN and router_gap >= MIN_ROUTER_GAP and eos_free and varied:
        return None
    return f"margin {margin:.2e}, router gap {router_gap:.2e}, eos-free {eos_free}, varied {varied}"


def attempt(case: MixtralCase, seed: int):
    stored = init_hub_tensors(case, seed)
    model = build_model(case, stored)
    results, greedy_margin, router_gap = run_references(model, seed, case.top_k)
    return stored, model, results, greedy_margin, router_gap


def config_json(case: MixtralCase) -> dict:
    return styled_config_json(make_config(case), case.config_style)


def styled_config_json(config, style: str) -> dict:
    """What save_pretrained writes for `config`, restyled as `style` (see MixtralCase.config_style)."""
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        config = json.loads(Path(tmp, "config.json").read_text())
    if style in ("legacy", "top_level"):
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    if style == "legacy":
        config["torch_dtype"] = config.pop("dtype")
        if config.get("head_dim") is None:
            config.pop("head_dim", None)
    return dict(sorted(config.items()))


def shard_groups(names: list[str], stored: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """Split names (in order) into `shards` contiguous groups of roughly equal bytes."""
    sizes = [stored[n].numel() * stored[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = 0
    for name, size in zip(names, sizes):
        idx = min(shards - 1, running * shards // total)
        groups[idx].append(name)
        running += size
    if any(not g for g in groups):
        raise RuntimeError("empty shard")
    return groups


def write_checkpoint(case: MixtralCase, out: Path, stored: dict[str, torch.Tensor]) -> None:
    write_json(out / "config.json", config_json(case))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID})
    write_tensors(out, stored, case.shards)


def write_tensors(out: Path, stored: dict[str, torch.Tensor], shards: int) -> None:
    """model.safetensors, or `shards` files + model.safetensors.index.json."""
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(stored, str(out / "model.safetensors"), metadata=metadata)
        return
    names = sorted(stored, key=_natural_key)
    weight_map = {}
    for idx, group in enumerate(shard_groups(names, stored, shards)):
        file = f"model-{idx + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: stored[n] for n in group}, str(out / file), metadata=metadata)
        weight_map.update({n: file for n in group})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


def read_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor written under `out` (expected.safetensors excluded)."""
    on_disk = {}
    for file in sorted(out.glob("*.safetensors")):
        if file.name == "expected.safetensors":
            continue
        with safe_open(str(file), "pt") as handle:
            on_disk.update({k: handle.get_tensor(k) for k in handle.keys()})
    return on_disk


def save_pretrained_names(model, dtype: torch.dtype) -> set[str]:
    """The tensor names transformers' save_pretrained writes for `model` (converted to `dtype`).

    Pass a model that is not used afterwards: .to(dtype) also rounds the rotary inv_freq buffer.
    """
    with tempfile.TemporaryDirectory() as tmp:
        model.to(dtype).save_pretrained(tmp)
        saved = set()
        for file in Path(tmp).glob("*.safetensors"):
            with safe_open(str(file), "pt") as handle:
                saved.update(handle.keys())
    return saved


def same_logits(model, reloaded, results) -> bool:
    """True when both models give bit-identical logits on every prompt + greedy continuation."""
    for result in results:
        ids = torch.tensor([result.prompt_ids + result.greedy_ids])
        with torch.no_grad():
            if not torch.equal(model(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits):
                return False
    return True


def write_expected(out: Path, model, ids: list[int]) -> None:
    expected = capture_forward(model, ids)
    expected = {k: v.contiguous() for k, v in expected.items()}
    save_file(expected, str(out / "expected.safetensors"), metadata={"format": "pt"})


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def verify_checkpoint(case: MixtralCase, out: Path, stored, model, results) -> None:
    """Reload the written directory with from_pretrained and demand identical outputs."""
    on_disk = read_tensors(out)
    if set(on_disk) != set(stored) or any(not torch.equal(on_disk[k], stored[k]) for k in stored):
        raise RuntimeError(f"{case.name}: written tensors differ from the computed ones")
    saved = save_pretrained_names(build_model(case, stored), case.dtype)  # transformers' own hub names
    if saved != set(stored):
        raise RuntimeError(f"{case.name}: save_pretrained names differ: {sorted(saved ^ set(stored))}")
    reloaded = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    theta = reloaded.config.rope_parameters["rope_theta"]
    if theta != ROPE_THETA or reloaded.config.sliding_window != case.sliding_window:
        raise RuntimeError(f"{case.name}: config reload lost rope_theta/sliding_window")
    if not same_logits(model, reloaded, results):
        raise RuntimeError(f"{case.name}: from_pretrained reload gives different logits")


def window_is_active(case: MixtralCase, model, result) -> bool:
    """True when disabling the sliding window changes the logits (window < sequence)."""
    ids = torch.tensor([result.prompt_ids + result.greedy_ids])
    with torch.no_grad():
        with_window = model(ids, use_cache=False).logits
        saved = model.config.sliding_window
        model.config.sliding_window = None
        try:
            without = model(ids, use_cache=False).logits
        finally:
            model.config.sliding_window = saved
    return not torch.equal(with_window, without)


def generate_case(case: MixtralCase, fixtures: Path, provenance: dict) -> dict:
    out = fixtures / case.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for seed in range(case.base_seed, case.base_seed + MAX_SEED_TRIES):
        stored, model, results, margin, router_gap = attempt(case, seed)
        why = rejection(results, margin, router_gap)
        if why is None:
            break
        print(f"  {case.name}: seed {seed} rejected ({why})")
    else:
        raise RuntimeError(f"{case.name}: no seed gave decisive margins")
    write_checkpoint(case, out, stored)
    verify_checkpoint(case, out, stored, model, results)
    write_json(out / "reference.json", {"case": case.name, "prompts": [r.as_reference() for r in results]})
    write_expected(out, model, results[EXPECTED_PROMPT_INDEX].prompt_ids)
    window_active = window_is_active(case, model, results[EXPECTED_PROMPT_INDEX]) if case.sliding_window else False
    manifest = {
        "case": case.name,
        **provenance,
        "seed": seed,
        "dtype": str(case.dtype).removeprefix("torch."),
        "compute_dtype": "float32 (stored values upcast), attn_implementation eager, full recompute per step",
        "min_greedy_margin": margin,
        "min_router_topk_gap": router_gap,
        "sliding_window_changes_logits": window_active,
        "expected_prompt_index": EXPECTED_PROMPT_INDEX,
        "greedy_ids_contain_eos": False,
        "distinct_greedy_ids_per_prompt": [len(set(r.greedy_ids)) for r in results],
        "new_tokens": NEW_TOKENS,
    }
    write_json(out / "manifest.json", manifest)
    print(f"  {case.name}: seed {seed}, min margin {margin:.4f}, router gap {router_gap:.4f}")
    return manifest
