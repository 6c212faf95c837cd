"""Generate moeserve's committed reference fixtures under tests/fixtures/.

What it makes (the file formats are a contract with the Rust tests):
  A. mixtral-{swa,tied,gqa,sharded}/  tiny random HF Mixtral checkpoints (hub tensor
     names, bf16/f16/f32, one file or 3 shards) + reference.json (24 greedy tokens,
     logprobs, top-5 per step for 3 prompts), expected.safetensors (per-layer residual
     outputs, raw router logits, logits for the 40-token prompt), manifest.json.
     See mixtral_cases.py.
  B. llama-tiny-gguf/  a tiny dense Llama GGUF (Q8_0 embeddings, Q4_1 matrices, F32
     norms, q/k permuted like llama.cpp's convert_hf_to_gguf.py) carrying the real
     SmolLM2 tokenizer metadata, with reference.json, expected.safetensors (logits of
     prompt 0), tokenizer_cases.json and chat_cases.json. See llama_gguf.py.
  C. gguf-blocks/  raw Q4_1 / Q8_0 blocks from the real SmolLM2 GGUF and their
     gguf.quants dequantization. See llama_gguf.py.
  D. smolmoe-demo/reference.json  greedy chat references of the dense SmolLM2-135M
     (GGUF dequantized, rounded to bf16) that the upcycled demo MoE must reproduce.
     See smollm_demo.py.
  E. smolmoe-eval/reference.json  the same kind of reference for 16 more chat turns of up
     to 64 tokens: the positions the int8 accuracy figures are measured on.
  F. qwen3-moe/, qwen3-moe-fused/, qwen2-moe/, olmoe/  tiny random Qwen3-MoE (q/k norm,
     explicit head_dim, dense + sparse layers; qwen3-moe-fused stores the experts as the
     fused 3-D module tensors), Qwen2-MoE (q/k/v biases, gated shared expert, dense layer)
     and OLMoE (q/k norm over the flat projections, clip_qkv) checkpoints, in set A's layout
     with the dense layers and term ablations in manifest.json; GLM-4.5, DeepSeek-V2/V3 (and
     V3 as FP8 blocks), Qwen3-MoE as a GPTQ int4 checkpoint (act-order, asymmetric, groups of
     32) and Qwen2-MoE as an AWQ one (int4_formats.py). See moe_family_cases.py.
  G. gpt-oss/  a tiny random GPT-OSS (attention sinks, alternating sliding and full layers,
     YaRN, biased router and experts with the clamped SwiGLU), and gpt-oss-mxfp4/, the same
     weights with MXFP4 experts as released. See gpt_oss_cases.py. And gpt-oss-harmony/, a
     GPT-OSS whose weights are set to answer in the harmony format (reasoning, then the final
     answer), with a tokenizer holding GPT-OSS's special tokens, moeserve's harmony template
     and chat_cases.json rendered by transformers. See gpt_oss_harmony.py.

How to run (from the repository root, CPU only, ~5 minutes):
    python -m venv .venv-ref && .venv-ref/bin/pip install -r tests/reference/requirements.txt
    .venv-ref/bin/python tests/reference/generate.py            # everything
    .venv-ref/bin/python tests/reference/generate.py --only mixtral gguf-blocks moe-families
    .venv-ref/bin/python tests/reference/generate.py --only moe-families --cases qwen3-moe-gptq

Determinism: every RNG is seeded, torch runs single-threaded with
torch.use_deterministic_algorithms(True), JSON is written with a stable layout
and no timestamps, so rerunning with the pinned versions reproduces the files.
Every float reference is computed in float32 from exactly the stored weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ref_common import FIXTURES_DIR, script_sha256, set_determinism, versions  # noqa: E402

GLOBAL_SEED = 1234
SECTIONS = ("mixtral", "llama-tiny-gguf", "gguf-blocks", "smolmoe-demo", "smolmoe-eval", "moe-families", "gpt-oss")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to regenerate")
    parser.add_argument(
        "--cases", nargs="+", metavar="NAME", help="within moe-families, only these fixtures (the others stay as made)"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    set_determinism(GLOBAL_SEED)
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    provenance = {"versions": versions(), "script_sha256": script_sha256()}
    for section in SECTIONS:
        if section not in args.only:
            continue
        started = time.time()
        print(f"[{section}]")
        set_determinism(GLOBAL_SEED)
        if section == "mixtral":
            import mixtral_cases  # noqa: PLC0415

            for case in mixtral_cases.CASES:
                mixtral_cases.generate_case(case, FIXTURES_DIR, provenance)
        elif section == "llama-tiny-gguf":
            import llama_gguf  # noqa: PLC0415

            llama_gguf.generate_llama_tiny(FIXTURES_DIR / "llama-tiny-gguf", provenance)
        elif section == "gguf-blocks":
            import llama_gguf  # noqa: PLC0415

            llama_gguf.generate_gguf_blocks(FIXTURES_DIR / "gguf-blocks", provenance)
        elif section == "smolmoe-demo":
            import smollm_demo  # noqa: PLC0415

            smollm_demo.generate_smolmoe_reference(FIXTURES_DIR / "smolmoe-demo", provenance)
        elif section == "smolmoe-eval":
            import smollm_demo  # noqa: PLC0415

            smollm_demo.generate_smolmoe_eval(FIXTURES_DIR / "smolmoe-eval", provenance)
        elif section == "moe-families":
            import moe_family_cases  # noqa: PLC0415

            for case in moe_family_cases.CASES:
                if args.cases is None or case.name in args.cases:
                    moe_family_cases.generate_case(case, FIXTURES_DIR, provenance)
        elif section == "gpt-oss":
            import gpt_oss_cases  # noqa: PLC0415

            for case in gpt_oss_cases.CASES:
                gpt_oss_cases.generate_case(case, FIXTURES_DIR, provenance)
            import gpt_oss_harmony  # noqa: PLC0415

            gpt_oss_harmony.generate(FIXTURES_DIR, provenance)
        print(f"[{section}] done in {time.time() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
