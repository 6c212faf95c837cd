"""A GPT-OSS checkpoint that answers in the harmony format, for the chat path's tests.

Owns tests/fixtures/gpt-oss-harmony/ (part of section `gpt-oss`): a tiny GptOssForCausalLM, a
byte-level BPE tokenizer holding GPT-OSS's special tokens, moeserve's harmony chat template
(crates/moeserve-text/templates/gpt_oss_harmony.jinja), and
- chat_cases.json: conversations (one with `reasoning_effort: "high"`) rendered by
  transformers' `apply_chat_template` on this very
  directory (the date of the system message as rendered that day), their token ids, and the
  ids transformers' greedy decoding gives after each, up to `<|return|>`;
- manifest.json: the scripted reply, its channels' texts, the weights' design and margins.

A random model never writes channel headers, so the weights are set by hand to follow a script:
    <|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>
The residual holds a one-hot of the current token (for every token of the script), and one flag:
"has the reasoning begun". A head of the full-attention layer sets the flag: its query is a
constant (the q bias), its key marks the reasoning's first token, and the sink takes the softmax
when that token is absent (its value is 0 then). lm_head maps (token, flag) to the next token:
the flag picks `final` over `analysis` after the second `<|channel|>`, and the answer over the
reasoning after the second `<|message|>`. Every other weight is small random noise (biases,
sinks, norms, router and experts included), so the whole forward runs and must be right to
keep the script. The reply comes out of the model's own greedy decoding: the chat path is
tested on tokens a model produced, not on a string.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

from mixtral_cases import styled_config_json
from ref_common import REPO_ROOT, GreedyParams, greedy_generate, render_chat, write_json

NAME = "gpt-oss-harmony"
TEMPLATE = REPO_ROOT / "crates/moeserve-text/templates/gpt_oss_harmony.jinja"
SEED = 24024

# GPT-OSS's special tokens (o200k_harmony names), here at ids 0..8.
SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
VOCAB = 384

REASONING = "Hmm, a greeting. I should reply kindly"
ANSWER = "Hello! How may we help you today?"
SCRIPT = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}{RETURN}"
)

# (messages, the template's extra variables, as apply_chat_template takes them).
CONVERSATIONS = (
    ([{"role": "user", "content": "hi"}], {}),
    ([{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "hi there"}], {}),
    (
        [
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "What is 2+2?"},
        ],
        {},
    ),
    ([{"role": "user", "content": "hi"}], {"reasoning_effort": "high"}),
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
MARKER_DIM, FLAG_DIM = HIDDEN - 2, HIDDEN - 1
# The flag head's query and key live in the rotary pair that turns slowest (dims 7 and 15 of a
# 16-wide head turn by 150000^(-14/16) ≈ 3e-5 rad per position), so RoPE leaves its score alone.
QK_DIM = HEAD_DIM // 2 - 1
NOISE = 0.02
# lm_head: the next token's logit per unit of the current token's one-hot; the alternative the
# flag picks gets FIRST - MARGIN and FLAG_BONUS per unit of flag.
FIRST, MARGIN, FLAG_BONUS = 10.0, 2.0, 4.0


def corpus() -> list[str]:
    """Text the BPE learns its merges from: the script's words and the template's system text."""
    system = (
        "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
        "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included "
        "for every message.# Instructions\n\n"
    )
    words = [REASONING, ANSWER, "assistant", "analysis", "final", "user", "developer", "system"]
    return [system] * 4 + words * 50 + [c["content"] for conv, _ in CONVERSATIONS for c in conv] * 4


def make_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    if tokenizer.get_vocab_size() > VOCAB:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, over {VOCAB}")
    for i, special in enumerate(SPECIALS):
        if tokenizer.token_to_id(special) != i:
            raise RuntimeError(f"{special} is not at id {i}")
    return tokenizer


def tokenizer_config() -> dict:
    added = {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, s in enumerate(SPECIALS)}
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|startoftext|>",
        "eos_token": RETURN,
        "pad_token": ENDOFTEXT,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }


def make_config() -> GptOssConfig:
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 150000.0, "rope_type": "yarn", "factor": 8.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False},
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_bias=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=[2, 8, 1],
        dtype=torch.bfloat16,
        attn_implementation="eager",
    )
    config.architectures = ["GptOssForCausalLM"]
    return config


def transitions(script: list[int], first_reasoning: int) -> dict[tuple[int, bool], int]:
    """(token, reasoning begun) → next token, for every step of the script."""
    table: dict[tuple[int, bool], int] = {}
    begun = False
    for token, successor in zip(script, script[1:]):
        begun = begun or token == first_reasoning
        if table.setdefault((token, begun), successor) != successor:
            raise RuntimeError(f"token {token} (begun {begun}) is followed by two tokens in the script")
    return table


def init_tensors(script: list[int], first_reasoning: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    config = make_config()
    e, inter = config.num_local_experts, config.intermediate_size
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def noise(*shape: int, std: float = NOISE) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    scripted = sorted(set(script[:-1]))
    if len(scripted) > MARKER_DIM:
        raise RuntimeError(f"{len(scripted)} script tokens do not fit {MARKER_DIM} one-hot dims")
    dim = {token: i for i, token in enumerate(scripted)}
    embed = torch.randn((VOCAB, HIDDEN), generator=gen) * 0.5
    embed[:, MARKER_DIM:] = 0.0
    for token, d in dim.items():
        embed[token] = 0.0
        embed[token, d] = 1.0
    embed[first_reasoning, MARKER_DIM] = 1.0
    tensors = {"model.embed_tokens.weight": embed}
    for layer in range(2):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        tensors[f"{p}.input_layernorm.weight"] = 1.0 + noise(HIDDEN)
        tensors[f"{p}.post_attention_layernorm.weight"] = 1.0 + noise(HIDDEN)
        tensors[f"{a}.q_proj.weight"] = noise(q_width, HIDDEN)
        tensors[f"{a}.q_proj.bias"] = noise(q_width)
        tensors[f"{a}.k_proj.weight"] = noise(kv_width, HIDDEN)
        tensors[f"{a}.k_proj.bias"] = noise(kv_width)
        tensors[f"{a}.v_proj.weight"] = noise(kv_width, HIDDEN)
        tensors[f"{a}.v_proj.bias"] = noise(kv_width)
        tensors[f"{a}.o_proj.weight"] = noise(HIDDEN, q_width)
        tensors[f"{a}.o_proj.bias"] = noise(HIDDEN)
        tensors[f"{a}.sinks"] = noise(HEADS, std=1.0)
        m = f"{p}.mlp"
        tensors[f"{m}.router.weight"] = noise(e, HIDDEN, std=1.0)
        tensors[f"{m}.router.bias"] = noise(e, std=0.5)
        tensors[f"{m}.experts.gate_up_proj"] = noise(e, HIDDEN, 2 * inter, std=0.2)
        tensors[f"{m}.experts.gate_up_proj_bias"] = noise(e, 2 * inter, std=0.2)
        # Small enough that the experts' sum over 2 × 32 activations stays well below the one-hot.
        tensors[f"{m}.experts.down_proj"] = noise(e, inter, HIDDEN, std=0.002)
        tensors[f"{m}.experts.down_proj_bias"] = noise(e, HIDDEN, std=0.005)
    # The flag head: head 0 of the full layer (layer 1), on kv head 0.
    a = "model.layers.1.self_attn"
    q_w, q_b = tensors[f"{a}.q_proj.weight"], tensors[f"{a}.q_proj.bias"]
    q_w[:HEAD_DIM] = 0.0
    q_b[:HEAD_DIM] = 0.0
    q_b[QK_DIM] = 4.0
    k_w, k_b = tensors[f"{a}.k_proj.weight"], tensors[f"{a}.k_proj.bias"]
    k_w[QK_DIM] = 0.0
    k_w[QK_DIM, MARKER_DIM] = 3.5
    k_b[QK_DIM] = 0.0
    v_w, v_b = tensors[f"{a}.v_proj.weight"], tensors[f"{a}.v_proj.bias"]
    v_w[QK_DIM] = 0.0
    v_w[QK_DIM, MARKER_DIM] = 0.18
    v_b[QK_DIM] = 0.0
    o_w = tensors[f"{a}.o_proj.weight"]
    o_w[FLAG_DIM] = 0.0
    o_w[FLAG_DIM, QK_DIM] = 1.0
    tensors[f"{a}.sinks"][0] = 6.0
    tensors["model.norm.weight"] = 1.0 + noise(HIDDEN)
    lm_head = noise(VOCAB, HIDDEN)
    lm_head[:, MARKER_DIM] = 0.0
    table = transitions(script, first_reasoning)
    for token in scripted:
        after = {begun: table.get((token, begun)) for begun in (False, True)}
        if after[False] is not None:
            lm_head[after[False], dim[token]] = FIRST
        if after[True] is not None and after[True] != after[False]:
            lm_head[after[True], dim[token]] = FIRST - MARGIN if after[False] is not None else FIRST
            lm_head[after[True], FLAG_DIM] = FLAG_BONUS
    tensors["lm_head.weight"] = lm_head
    return {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}


def generate(fixtures: Path, provenance: dict) -> dict:
    out = fixtures / NAME
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer = make_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config())
    template = TEMPLATE.read_text(encoding="utf-8")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    generation_prompt = encode("<|start|>assistant")
    script = generation_prompt[-1:] + encode(SCRIPT)
    reasoning_ids, answer_ids = encode(REASONING), encode(ANSWER)
    first_reasoning = reasoning_ids[0]
    stored = init_tensors(script, first_reasoning)

    config = make_config()
    model = GptOssForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in stored.items()}, strict=True)
    write_json(out / "config.json", styled_config_json(config, "parameters"))
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [2, 8, 1], "pad_token_id": 1})
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    specials = {"bos_token": "<|startoftext|>", "eos_token": RETURN, "pad_token": ENDOFTEXT}
    cases, margins = [], []
    for messages, variables in CONVERSATIONS:
        rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                    **variables)
        if rendered != render_chat(template, messages, specials | variables):
            raise RuntimeError("apply_chat_template and jinja2 render the harmony template differently")
        ids = encode(rendered)
        if first_reasoning in ids:
            raise RuntimeError("the reasoning's first token is in a prompt: the flag would be set early")
        if ids[-len(generation_prompt):] != generation_prompt:
            raise RuntimeError("the prompt does not end with the generation prompt's tokens")
        result = greedy_generate(model, ids, GreedyParams(max_new_tokens=len(script) + 4,
                                                          stop_token_id=tokenizer.token_to_id(RETURN)))
        if result.greedy_ids != script[1:]:
            raise RuntimeError(f"greedy decoding left the script: {tokenizer.decode(result.greedy_ids)!r}")
        margins.append(result.min_margin)
        cases.append({"messages": messages, "add_generation_prompt": True, **variables, "rendered": rendered,
                      "ids": ids, "greedy_ids": result.greedy_ids})
    write_json(out / "chat_cases.json", cases)
    reloaded = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    check = greedy_generate(reloaded, cases[0]["ids"], GreedyParams(max_new_tokens=len(script) + 4,
                                                                    stop_token_id=tokenizer.token_to_id(RETURN)))
    if check.greedy_ids != script[1:]:
        raise RuntimeError("from_pretrained of the written directory leaves the script")
    # Without the flag head's query the model cannot tell its two `<|channel|>`s apart.
    ablated = GptOssForCausalLM(config).to(torch.float32).eval()
    ablated.load_state_dict({k: v.float() for k, v in stored.items()}, strict=True)
    with torch.no_grad():
        ablated.model.layers[1].self_attn.q_proj.bias[QK_DIM] = 0.0
    flag_off = greedy_generate(ablated, cases[0]["ids"], GreedyParams(max_new_tokens=len(script) + 4,
                                                                      stop_token_id=tokenizer.token_to_id(RETURN)))
    if flag_off.greedy_ids == script[1:]:
        raise RuntimeError("the script survives without the flag head: the attention path is not tested")
    manifest = {
        "case": NAME,
        "family": "gpt_oss",
        "architecture": "GptOssForCausalLM",
        **provenance,
        "seed": SEED,
        "script": SCRIPT,
        "reasoning": REASONING,
        "answer": ANSWER,
        "reasoning_ids": reasoning_ids,
        "answer_ids": answer_ids,
        "min_greedy_margin": min(margins),
        "flag_head_off_reply": tokenizer.decode(flag_off.greedy_ids, skip_special_tokens=False),
        "design": "one-hot residual per script token + a 'reasoning begun' flag set by a sink-gated head "
                  "of the full layer; every other weight small random noise",
    }
    write_json(out / "manifest.json", manifest)
    print(f"  {NAME}: {len(script) - 1} scripted tokens, min margin {min(margins):.3f}")
    return manifest
