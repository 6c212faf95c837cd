#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets under fuzz/corpus/<target>/ (checked in).

Seeds are small valid inputs plus a few broken ones, so libFuzzer starts from the formats'
structure: OpenAI request bodies, chat messages, a safetensors file and a GGUF file.
Run from anywhere: python3 fuzz/make_seeds.py
"""

import json
import struct
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"


def write(target, name, data):
    path = CORPUS / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def openai_requests():
    user = [{"role": "user", "content": "hi"}]
    bodies = {
        "completion": {"prompt": "Once upon", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9},
        "completion_ids": {"prompt": [[1, 2, 3]], "max_tokens": 2, "logprobs": 2, "stream": True,
                           "stream_options": {"include_usage": True}},
        "completion_stops": {"prompt": "x", "stop": ["a", "b"], "stop_token_ids": [2],
                             "top_k": -1, "min_p": 0.1, "seed": 7, "best_of": 1, "n": 1,
                             "repetition_penalty": 1.1, "presence_penalty": 0.5,
                             "frequency_penalty": -0.5, "ignore_eos": True, "user": "u"},
        "chat": {"messages": user, "max_completion_tokens": 4, "logprobs": True,
                 "top_logprobs": 3},
        "chat_parts": {"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"}]}],
                       "stream": True, "model": "tiny", "extra": {"nested": [1, {"x": None}]}},
        "bad_types": {"prompt": 5, "max_tokens": -1, "temperature": "hot", "stop": 3},
        "bad_ranges": {"prompt": "x", "top_p": 0, "max_tokens": 18446744073709551615,
                       "temperature": 1e39, "n": 2},
    }
    for name, body in bodies.items():
        write("openai_request", name, json.dumps(body))
    write("openai_request", "truncated", '{"prompt": "ab')
    write("openai_request", "bad_utf8", b'{"prompt": "\xff\xfe"}')
    write("openai_request", "surrogate", '{"prompt": "\\ud800"}')


def chat_messages():
    write("chat_template", "one_turn", "user\0hello")
    write("chat_template", "system_first", "system\0be brief\0user\0hi\0assistant\0hello\0user\0more")
    write("chat_template", "bad_order", "assistant\0first\0assistant\0again")
    write("chat_template", "jinja_in_content", "user\0{{ 7 * 7 }} {% for x in y %}\0tool\0<|im_end|>")


def safetensors(tensors):
    """tensors: list of (name, dtype, shape, raw bytes)."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    good = safetensors([
        ("model.embed_tokens.weight", "BF16", [4, 2], bytes(16)),
        ("lm_head.weight", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
        ("model.norm.weight", "F16", [2], bytes(4)),
        ("counts", "I64", [1], bytes(8)),
    ])
    write("safetensors_header", "valid", good)
    write("safetensors_header", "truncated", good[: len(good) - 5])
    write("safetensors_header", "huge_header_len", struct.pack("<Q", 2**63) + good[8:])
    write("safetensors_header", "overlap", safetensors([("a", "F32", [2], bytes(8))])
          .replace(b'"data_offsets": [0, 8]', b'"data_offsets": [4, 8]'))


def gguf_string(s):
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_seed(alignment=32):
    kv = [
        (gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("llama")),
        (gguf_string("llama.block_count") + struct.pack("<II", 4, 2)),
        (gguf_string("llama.rope.freq_base") + struct.pack("<If", 6, 10000.0)),
        (gguf_string("general.alignment") + struct.pack("<II", 4, alignment)),
        (gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2)
         + gguf_string("a") + gguf_string("b")),
        (gguf_string("general.flag") + struct.pack("<I?", 7, True)),
    ]
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    f16 = struct.pack("<4e", 1, -2, 0.5, 0)
    # Q8_0: one block of 32 = f16 scale + 32 int8.
    q8 = struct.pack("<e", 0.25) + bytes(range(32))
    infos, data = [], b""
    for name, dims, ggml_type, raw in [("w.f32", [2, 2], 0, f32), ("w.f16", [4], 1, f16),
                                       ("w.q8", [32], 8, q8)]:
        data += b"\0" * (-len(data) % alignment)
        infos.append(gguf_string(name) + struct.pack("<I", len(dims))
                     + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", ggml_type, len(data)))
        data += raw
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kv)) + b"".join(kv) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + data


def gguf_seeds():
    good = gguf_seed()
    write("gguf_header", "valid", good)
    write("gguf_header", "truncated", good[: len(good) // 2])
    write("gguf_header", "v2_header_only", b"GGUF" + struct.pack("<IQQ", 2, 0, 0))
    write("gguf_header", "huge_counts", b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62))


if __name__ == "__main__":
    openai_requests()
    chat_messages()
    safetensors_seeds()
    gguf_seeds()
    print(f"seeds written under {CORPUS}")
