"""int8 weight grids compared in simulation on the demo model's dense twin (issue 6).

The Rust figure is `cargo test --release -p moeserve-model --test int8 -- --nocapture`; this
script asks "what if" questions cheaply: it quantizes and dequantizes the dense SmolLM2-135M
(the demo MoE's every expert is this MLP) in float32 with transformers and reports the mean
|Δlogprob| of the reference tokens and greedy agreement, teacher-forced on fixtures
smolmoe-demo (79 positions) and smolmoe-eval (883). Symmetric 64-position groups reproduce
the Rust figures of the old scheme (0.0277 / 0.0304 vs 0.0276 / —), asymmetric ones the new
(0.0202 / 0.0230 vs 0.0196 / 0.0231).

The demo's weights come from a Q4_1 GGUF: every 32-block holds 16 levels spaced evenly above a
minimum, which flatters grids that span a group's range (an asymmetric grid on 32-position
groups lands on those levels almost exactly). `--jitter` therefore also runs every grid on
"generic" weights: each weight moved by uniform noise of one Q4_1 step (seeded), rounded to
bf16, then compares against that jittered model in float32 on the same token sequences.
`--gptq` adds GPTQ (Frantar et al. 2022; lazy batches of 128, 1 % damping) with 32 × 256
calibration tokens sampled from the model itself, twice: in column order with each group's grid
set when GPTQ reaches it (from the error-updated weights), and in act-order (columns by
decreasing Hessian diagonal) with every group's grid fixed beforehand from the original weights
("static groups") — the same stored format as round-to-nearest, only the integers differ.
The act-order variant is what `moeserve quantize` builds (smolmoe-eval 0.0179 in Rust, per-expert
Hessians; 0.0183 here with one dense Hessian).

Run from the repository root with the reference venv (tests/reference/README.md):
    .venv-ref/bin/python bench/int8_accuracy.py [--jitter] [--gptq]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reference"))

from gguf_common import llama_hparams, llama_model, llama_state_dict, smollm2_gguf_path  # noqa: E402
from smollm_demo import round_to_bf16  # noqa: E402

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


def symmetric(w: torch.Tensor, group: int) -> torch.Tensor:
    """The old scheme: max |w| / 127 per group."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    s = g.abs().amax(-1, keepdim=True) / 127
    s[s == 0] = 1
    return ((g / s).round().clamp(-127, 127) * s).reshape(n, k)


def grid(g: torch.Tensor, store: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset spanning each group's [min, max] (as crates/moeserve-backend quant.rs)."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 255
    s[s == 0] = 1
    o = lo + 128 * s
    if store is not None:
        s, o = s.to(store).to(g.dtype), o.to(store).to(g.dtype)
    return s, o


def on_grid(w: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return ((w - o) / s).round().clamp(-128, 127) * s + o


def asymmetric(w: torch.Tensor, group: int, store: torch.dtype | None = None) -> torch.Tensor:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    return on_grid(g, *grid(g, store)).reshape(n, k)


def gptq(
    w: torch.Tensor, h: torch.Tensor, act_order: bool, group: int = 64, block: int = 128, damp: float = 0.01
) -> torch.Tensor:
    """GPTQ onto the asymmetric grid. Without act-order each group's grid is set from its
    error-updated weights when GPTQ reaches it; with act-order the grids are fixed from the
    original weights and the columns run by decreasing diag(H)."""
    w, h = w.clone().double(), h.clone().double()
    n, k = w.shape
    static = grid(w.reshape(n, k // group, group), None)
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hb = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = int(perm[i1 + i])
            if act_order:
                s, o = static[0][:, column // group, 0], static[1][:, column // group, 0]
            elif column % group == 0:
                s, o = grid(w1[:, i : i + group], None)
                s, o = s[:, 0], o[:, 0]
            q = on_grid(w1[:, i], s, o)
            out[:, i1 + i] = q
            err = (w1[:, i] - q) / hb[i, i]
            w1[:, i:] -= err[:, None] * hb[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return out[:, torch.argsort(perm)].float()


class Twin:
    """The dense model with tied lm_head untied, so it can be quantized on its own."""

    def __init__(self, hp: dict, state: dict[str, torch.Tensor]):
        self.hp, self.state = hp, state

    def build(self, quantize=None) -> torch.nn.Module:
        model = llama_model(self.hp, self.state)
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        if quantize is not None:
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEAR:
                    module.weight.data = quantize(name, module.weight.data)
        return model


@torch.no_grad()
def logprobs(model, prompts: list[dict]) -> list[torch.Tensor]:
    out = []
    for p in prompts:
        ids, start = p["prompt_ids"] + p["greedy_ids"], len(p["prompt_ids"])
        lp = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
        out.append(lp[start - 1 : start - 1 + len(p["greedy_ids"])])
    return out


def compare(got: list[torch.Tensor], want: list[torch.Tensor], prompts: list[dict]) -> str:
    delta = agree = n = 0
    for g, w, p in zip(got, want, prompts):
        for i, t in enumerate(p["greedy_ids"]):
            delta += abs(float(g[i, t] - w[i, t]))
            agree += int(int(g[i].argmax()) == int(w[i].argmax()))
            n += 1
    return f"{delta / n:.4f} (agreement {agree / n:.3f}, {n})"


def calibration_hessians(model, hp: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    sequences = [
        model.generate(torch.tensor([[hp["bos"]]]), do_sample=True, top_k=0, max_new_tokens=255,
                       min_new_tokens=255, pad_token_id=hp["eos"])[0]
        for _ in range(32)
    ]
    hessians: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[name] = hessians.get(name, 0) + x.T @ x

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for s in sequences:
            model(s[None], use_cache=False)
    for h in handles:
        h.remove()
    return hessians


def jittered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, v in state.items():
        if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            n, k = v.shape
            b = v.reshape(n, k // 32, 32)
            step = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / 15
            v = (b + (torch.rand(b.shape, generator=g) - 0.5) * step).reshape(n, k).to(torch.bfloat16).float()
        out[name] = v
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jitter", action="store_true", help="also on weights moved off the Q4_1 grids")
    parser.add_argument("--gptq", action="store_true", help="also GPTQ with self-sampled calibration")
    parser.add_argument("--only-gptq", action="store_true", help="skip the round-to-nearest grids")
    args = parser.parse_args()
    torch.set_num_threads(2)
    reader = gguf.GGUFReader(str(smollm2_gguf_path()))
    hp = llama_hparams(reader)
    state = round_to_bf16(llama_state_dict(reader, hp))
    fixtures = ROOT / "tests" / "fixtures"
    sets = {s: json.loads((fixtures / s / "reference.json").read_text())["prompts"] for s in ("smolmoe-demo", "smolmoe-eval")}
    grids = {
        "symmetric, 64 (old)": lambda _n, w: symmetric(w, 64),
        "asymmetric, 64, f32 (new)": lambda _n, w: asymmetric(w, 64),
        "asymmetric, 64, f16 scale/offset": lambda _n, w: asymmetric(w, 64, torch.float16),
        "asymmetric, 32, f16 scale/offset": lambda _n, w: asymmetric(w, 32, torch.float16),
    }
    twins = [("demo weights", Twin(hp, state))]
    if args.jitter:
        twins.append(("jittered weights", Twin(hp, jittered(state))))
    for label, twin in twins:
        base = twin.build()
        want = {s: logprobs(base, p) for s, p in sets.items()}
        if args.gptq:
            hessians = calibration_hessians(base, hp)
            grids["GPTQ, asymmetric, 64"] = lambda n, w: gptq(w, hessians[n], act_order=False)
            grids["GPTQ act-order, static groups, asymmetric, 64"] = lambda n, w: gptq(w, hessians[n], act_order=True)
        for name, quantize in grids.items():
            if args.only_gptq and not name.startswith("GPTQ"):
                continue
            model = twin.build(quantize)
            figures = ", ".join(f"{s} {compare(logprobs(model, p), want[s], p)}" for s, p in sets.items())
            print(f"{label}: {name}: mean |Δlogprob| {figures}", flush=True)


if __name__ == "__main__":
    main()
