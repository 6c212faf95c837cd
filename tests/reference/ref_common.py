"""Shared helpers for the moeserve reference-fixture generator.

Owns: determinism setup, the stable JSON writer, version/sha bookkeeping,
the greedy reference loop (full recompute, float32 logits, top-5 logprobs),
chat-template rendering (mirrors transformers' apply_chat_template) and the
llama.cpp tokenizer wrapper. Follows: transformers 5.24 chat_template_utils
(sandboxed jinja env, trim_blocks, lstrip_blocks) and llama-cpp-python's
`Llama.tokenize(text, add_bos, special)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

REFERENCE_DIR = Path(__file__).resolve().parent
REPO_ROOT = REFERENCE_DIR.parent.parent
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"
TOP_K_LOGPROBS = 5


def set_determinism(seed: int) -> None:
    """Seed every RNG and force single-threaded deterministic CPU kernels."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def versions() -> dict:
    import gguf  # noqa: PLC0415 - imported lazily so --help stays fast
    import transformers  # noqa: PLC0415
    from importlib.metadata import version  # noqa: PLC0415

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "safetensors": version("safetensors"),
        "llama_cpp_python": version("llama_cpp_python"),
    }


def script_sha256() -> dict:
    """sha256 of every generator source file, plus one over all of them."""
    files = sorted(REFERENCE_DIR.glob("*.py"))
    per_file = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    combined = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in per_file.items()).encode())
    return {"combined": combined.hexdigest(), "files": per_file}


# ---------------------------------------------------------------- JSON writer


def _scalar_json(value) -> str:
    if isinstance(value, (bool, np.bool_)) or value is None:
        return json.dumps(bool(value) if value is not None else None)
    if isinstance(value, (np.float32, np.float16)):
        # Shortest decimal that round-trips to the same f32.
        text = str(np.float32(value))
        if not np.isfinite(np.float32(value)):
            raise ValueError(f"non-finite value {value} in fixture")
        return text
    if isinstance(value, (float, np.float64)):
        if not np.isfinite(value):
            raise ValueError(f"non-finite value {value} in fixture")
        return repr(float(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot serialise {type(value)}")


def _is_scalar(value) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _to_json(value, indent: int) -> str:
    pad = "  " * (indent + 1)
    end = "  " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{pad}{json.dumps(str(k), ensure_ascii=False)}: {_to_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(value, (list, tuple)):
        inline = "[" + ", ".join(_to_json(v, 0) for v in value) + "]"
        if all(_is_scalar(v) for v in value) or ("{" not in inline and len(inline) <= 160):
            return inline
        return "[\n" + ",\n".join(pad + _to_json(v, indent + 1) for v in value) + "\n" + end + "]"
    return _scalar_json(value)


def write_json(path: Path, value) -> None:
    """Write JSON with stable layout: dicts one key per line, short lists inline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_to_json(value, 0) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- greedy loop


@dataclass
class GreedyResult:
    prompt_ids: list[int]
    greedy_ids: list[int] = field(default_factory=list)
    greedy_logprobs: list[np.float32] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    stopped_at_eos: bool = False

    def as_reference(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "greedy_ids": self.greedy_ids,
            "greedy_logprobs": self.greedy_logprobs,
            "top_logprobs": self.top_logprobs,
        }

    @property
    def min_margin(self) -> float:
        return min(self.margins)


@dataclass(frozen=True)
class GreedyParams:
    max_new_tokens: int
    stop_token_id: int | None = None


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], params: GreedyParams) -> GreedyResult:
    """Greedy decoding by full recompute; logprobs are log_softmax of the f32 logits."""
    result = GreedyResult(prompt_ids=list(prompt_ids))
    ids = list(prompt_ids)
    for _ in range(params.max_new_tokens):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, TOP_K_LOGPROBS)
        token = int(top.indices[0])
        if token != int(torch.argmax(logits)):
            raise RuntimeError("topk and argmax disagree on the greedy token")
        result.greedy_ids.append(token)
        result.greedy_logprobs.append(np.float32(logprobs[token]))
        result.top_logprobs.append(
            [[int(i), np.float32(v)] for i, v in zip(top.indices.tolist(), top.values.tolist())]
        )
        result.margins.append(float(top.values[0] - top.values[1]))
        ids.append(token)
        if params.stop_token_id is not None and token == params.stop_token_id:
            result.stopped_at_eos = True
            break
    return result


# ---------------------------------------------------------------- chat + tokenizer


def _raise_exception(message):
    from jinja2.exceptions import TemplateError  # noqa: PLC0415

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def render_chat(template: str, messages: list[dict], special_tokens: dict) -> str:
    """Render like transformers' apply_chat_template(add_generation_prompt=True, tokenize=False).

    Cross-checked against transformers' own render_jinja_template so a drift in
    either implementation is caught here rather than in the Rust tests.
    """
    import jinja2.ext  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: PLC0415

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    ours = env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)
    theirs, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=True, **special_tokens
    )
    if ours != theirs[0]:
        raise RuntimeError(f"chat render mismatch with transformers:\n{ours!r}\n{theirs[0]!r}")
    return ours


class LlamaCppTokenizer:
    """llama.cpp tokenizer (vocab only) for a GGUF file."""

    def __init__(self, gguf_path: Path):
        from llama_cpp import Llama  # noqa: PLC0415

        self.llama = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)

    def encode(self, text: str) -> list[int]:
        return list(self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def decode(self, ids: list[int], *, special: bool) -> str:
        return self.llama.detokenize(ids, special=special).decode("utf-8", errors="replace")
