"""A GPT-OSS checkpoint (MXFP4 experts as released, or bf16) as a GGUF, written by llama.cpp's
own converter, so llama.cpp runs the same weights as moeserve.

    python bench/peers/convert_gpt_oss.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

LLAMA_CPP_DIR is a llama.cpp source tree (the one llama-cpp-python 0.3.36 vendors: its sdist's
vendor/llama.cpp), whose convert_hf_to_gguf.py and gguf-py are used as they are: tensor names,
the MXFP4 repacking (experts stay MXFP4, GGML type 39), hyperparameters. One step is replaced:
the converter names the tokenizer's pre-tokenizer by the hash of a test text's tokens and knows
only the hub's tokenizers (o200k for GPT-OSS); the presets' byte-level tokenizer is not one, so
it is named "default" here, and a tokenizer without merges (the presets' has none) gets one
placeholder merge, since llama.cpp refuses a BPE vocabulary without any. The benchmark feeds
token ids, so neither matters.

Needs torch, transformers and numpy (the converter's imports).
"""

import json
import sys
from pathlib import Path


def main() -> None:
    llama_dir, model_dir, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sys.path[:0] = [str(llama_dir / "gguf-py"), str(llama_dir)]
    import convert_hf_to_gguf  # noqa: PLC0415
    from conversion.base import TextModel  # noqa: PLC0415

    from conversion.gpt_oss import GptOssModel  # noqa: PLC0415

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    set_vocab = GptOssModel.set_vocab

    def set_vocab_with_a_merge(self):
        set_vocab(self)
        tokenizer = json.loads((Path(model_dir) / "tokenizer.json").read_text())
        if not tokenizer["model"].get("merges"):
            self.gguf_writer.add_token_merges(["a b"])

    GptOssModel.set_vocab = set_vocab_with_a_merge
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", "bf16"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
