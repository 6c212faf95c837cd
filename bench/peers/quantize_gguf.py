"""Quantizes a GGUF with llama.cpp's own quantizer (llama_model_quantize, as the llama-quantize
tool does), e.g. the bf16 export of a preset to Q4_K_M, the 4-bit type llama.cpp users take.

    python bench/peers/quantize_gguf.py IN.gguf OUT.gguf q4_k_m|q4_0|q4_1|q8_0 [THREADS]

Needs llama-cpp-python.
"""

import sys

import llama_cpp

TYPES = {
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}


def main():
    src, dst, kind = sys.argv[1:4]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = TYPES[kind]
    params.nthread = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed on {src}")


if __name__ == "__main__":
    main()
