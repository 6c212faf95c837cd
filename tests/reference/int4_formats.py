"""GPTQ and AWQ int4 checkpoints, packed from the formats' published descriptions.

Used by moe_family_cases.py for `qwen3-moe-gptq` and `qwen2-moe-awq`. A quantized linear layer
`{p}` (out features n, in features k) is stored instead of `{p}.weight` as:

GPTQ (AutoGPTQ / GPTQModel / optimum, `checkpoint_format: "gptq"`, i.e. v1):
  qweight int32 [k / 8, n]   input 8i + j of column r in bits 4j.. of qweight[i, r]
  qzeros  int32 [G, n / 8]   zero point of group g, output 8w + j in bits 4j.. of qzeros[g, w],
                             stored minus one (v1; a reader adds 1 back, as vLLM's kernels do)
  scales  f16   [G, n]
  g_idx   int32 [k]          the group of each input; with act-order (`desc_act`) the groups are
                             consecutive runs of the permuted inputs: g_idx[perm[i]] = i // group
AWQ (AutoAWQ GEMM, `version: "gemm"`):
  qweight int32 [k, n / 8]   output 8w + order[j] of input i in bits 4j.. of qweight[i, w],
                             order = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros  int32 [G, n / 8]   the same packing of the zero points
  scales  f16   [G, n]
and w[r, p] = (q[r, p] - zero[g, r]) * scale[g, r] with g the group of input p, G = ceil(k / group).

The quantization is round-to-nearest on each format's grid (GPTQ's quantizer: the range widened
to include 0, 15 steps, zero = round(-min / scale), or 8 when symmetric; AWQ's pseudo_quantize:
the group's own range, zero = clamp(-round(min / scale), 0, 15)), scales rounded to f16 first so
the stored codes are the nearest on the stored grid. The dequantisation reads the packed tensors
back (`unpack_*`), so the reference weights come from the bytes the checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble j holds output AWQ_ORDER[j]


@dataclass(frozen=True)
class Int4Scheme:
    method: str  # "gptq" or "awq"
    group: int  # positions per group; -1 (GPTQ): the whole row
    desc_act: bool = False  # GPTQ act-order: groups over a permutation of the inputs
    sym: bool = False  # GPTQ symmetric grid (zero point 8)


def is_int4_quantized(name: str, t: torch.Tensor) -> bool:
    """The decoder layers' linear weights, as GPTQ and AWQ releases quantize them: not the
    embeddings, lm_head, the routers or Qwen2-MoE's one-output shared-expert gate."""
    if t.dim() != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
        return False
    n, k = t.shape
    return n % 8 == 0 and k % 8 == 0


def int4_config(scheme: Int4Scheme) -> dict:
    if scheme.method == "gptq":
        return {
            "bits": 4,
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            "desc_act": scheme.desc_act,
            "group_size": scheme.group,
            "quant_method": "gptq",
            "static_groups": False,
            "sym": scheme.sym,
            "true_sequential": True,
        }
    return {
        "bits": 4,
        "group_size": scheme.group,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }


def _groups(scheme: Int4Scheme, k: int, gen: torch.Generator) -> torch.Tensor:
    """Each input's group [k]: runs of `group`, or (act-order) runs of a random permutation."""
    size = k if scheme.group == -1 else scheme.group
    if not scheme.desc_act:
        return torch.arange(k) // size
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // size
    return g_idx


def _quantize(scheme: Int4Scheme, w: torch.Tensor, g_idx: torch.Tensor):
    """(codes [n, k] in 0..15, zeros [G, n] in 0..15, f16 scales [G, n])."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    codes = torch.empty(n, k, dtype=torch.long)
    zeros = torch.empty(groups, n, dtype=torch.long)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols].double()
        if scheme.method == "gptq":
            lo, hi = x.min(1).values.clamp(max=0), x.max(1).values.clamp(min=0)
            if scheme.sym:
                hi = torch.maximum(lo.abs(), hi)
                lo = -hi
            scale = ((hi - lo) / 15).clamp(min=1e-8).half()
            zero = torch.full((n,), 8, dtype=torch.long) if scheme.sym else torch.round(-lo / scale.double()).long()
        else:
            lo, hi = x.min(1).values, x.max(1).values
            scale = ((hi - lo).clamp(min=1e-5) / 15).half()
            zero = (-torch.round(lo / scale.double())).clamp(0, 15).long()
        codes[:, cols] = (torch.round(x / scale.double()[:, None]) + zero[:, None]).clamp(0, 15).long()
        zeros[g], scales[g] = zero, scale
    return codes, zeros, scales


def _pack_words(nibbles: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[..., 8m] values in 0..15 → int32 [..., m]: nibble j of word w holds value 8w + order[j]."""
    v = nibbles.reshape(*nibbles.shape[:-1], -1, 8).to(torch.int64)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j, o in enumerate(order):
        words |= v[..., o] << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits


def _unpack_words(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """The inverse of _pack_words: int32 [..., m] → [..., 8m] values in 0..15."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*w.shape[:-1], w.shape[-1], 8, dtype=torch.long)
    for j, o in enumerate(order):
        out[..., o] = (w >> (4 * j)) & 0xF
    return out.reshape(*w.shape[:-1], -1)


def int4_checkpoint(scheme: Int4Scheme, hub: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The hub tensors with the quantized layers' weights replaced by their packed tensors."""
    gen = torch.Generator().manual_seed(seed + 4004)
    out = {}
    for name, t in hub.items():
        if not is_int4_quantized(name, t):
            out[name] = t
            continue
        p = name.removesuffix(".weight")
        g_idx = _groups(scheme, t.shape[1], gen)
        codes, zeros, scales = _quantize(scheme, t.float(), g_idx)
        if scheme.method == "gptq":
            if int(zeros.min()) < 1:  # v1 stores zero - 1: a zero of 0 has no code
                raise RuntimeError(f"{name}: a GPTQ v1 zero point of 0")
            k, n = t.shape[1], t.shape[0]  # word i of column r: inputs 8i..8i+8 → [k/8, n]
            out[p + ".qweight"] = _pack_words(codes.T.reshape(k // 8, 8, n).permute(0, 2, 1).reshape(k // 8, 8 * n))
            out[p + ".qzeros"] = _pack_words(zeros - 1).contiguous()
            out[p + ".g_idx"] = g_idx.to(torch.int32)
        else:
            out[p + ".qweight"] = _pack_words(codes.T.contiguous(), AWQ_ORDER).contiguous()  # [k, n/8]
            out[p + ".qzeros"] = _pack_words(zeros, AWQ_ORDER).contiguous()
        out[p + ".scales"] = scales.contiguous()
        unpacked = _unpack(scheme, out, p, t.shape)
        if not torch.equal(unpacked[0], codes) or not torch.equal(unpacked[1], zeros):
            raise RuntimeError(f"{name}: the packed words do not read back as the codes")
        ours = int4_dequantized(scheme, {k: v for k, v in out.items() if k.startswith(p + ".")})[name]
        if not torch.equal(ours, _readers_dequantization(scheme, out, p).T):
            raise RuntimeError(f"{name}: the dequantisation differs from the readers' formulation")
    return out


def _readers_dequantization(scheme: Int4Scheme, stored: dict, p: str) -> torch.Tensor:
    """A layer's weights [k, n] as the readers' own torch dequantisations compute them, written
    independently of _pack_words: AutoGPTQ's `dequantize_weight` (shift every word by 0, 4, …,
    28 along the packed dim, zeros + 1, `scales[g_idx] * (weight - zeros[g_idx])`) and vLLM's
    `awq_dequantize_torch` (the same shifts, then columns reordered by AWQ_REVERSE_ORDER)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight, qzeros, scales = (stored[p + "." + n] for n in ("qweight", "qzeros", "scales"))
    if scheme.method == "gptq":
        zeros = torch.bitwise_right_shift(qzeros[:, :, None].expand(-1, -1, 8), shifts[None, None, :]) & 0xF
        zeros = (zeros + 1).reshape(scales.shape)
        weight = torch.bitwise_right_shift(qweight[:, None, :].expand(-1, 8, -1), shifts[None, :, None]) & 0xF
        weight = weight.reshape(-1, weight.shape[2])
        g_idx = stored[p + ".g_idx"].long()
        return scales.float()[g_idx] * (weight - zeros[g_idx]).float()
    reverse = torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    iweights = (torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]) & 0xF).view(qweight.shape[0], -1)
    izeros = (torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]) & 0xF).view(qzeros.shape[0], -1)
    iweights, izeros = iweights[:, reverse], izeros[:, reverse]
    izeros = izeros.repeat_interleave(scheme.group, dim=0)
    return (iweights - izeros).float() * scales.float().repeat_interleave(scheme.group, dim=0)


def _unpack(scheme: Int4Scheme, stored: dict, p: str, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [n, k], zero points [G, n]) read back from a layer's packed tensors."""
    n, k = shape
    if scheme.method == "gptq":
        q = stored[p + ".qweight"]  # [k/8, n]: 8 inputs per word along dim 0
        codes = _unpack_words(q.T.contiguous()).reshape(n, k)  # word i of column r → inputs 8i..8i+8
        zeros = _unpack_words(stored[p + ".qzeros"]) + 1  # v1
    else:
        codes = _unpack_words(stored[p + ".qweight"], AWQ_ORDER).T.contiguous()  # [k, n] → [n, k]
        zeros = _unpack_words(stored[p + ".qzeros"], AWQ_ORDER)
    return codes, zeros


def _groups_of(scheme: Int4Scheme, stored: dict, p: str, k: int) -> torch.Tensor:
    if scheme.method == "gptq":
        return stored[p + ".g_idx"].long()
    return torch.arange(k) // scheme.group


def int4_dequantized(scheme: Int4Scheme, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights an int4 checkpoint stands for (the other tensors as stored)."""
    out = {}
    for name, t in stored.items():
        if name.endswith((".qzeros", ".scales", ".g_idx")):
            continue
        if not name.endswith(".qweight"):
            out[name] = t
            continue
        p = name.removesuffix(".qweight")
        scales = stored[p + ".scales"].float()
        n = scales.shape[1]
        k = t.shape[0] * 8 if scheme.method == "gptq" else t.shape[0]
        codes, zeros = _unpack(scheme, stored, p, (n, k))
        g = _groups_of(scheme, stored, p, k)
        out[p + ".weight"] = (codes - zeros[g].T).float() * scales[g].T
    return out


def int4_worst_error(scheme: Int4Scheme, stored: dict[str, torch.Tensor], hub: dict[str, torch.Tensor]) -> float:
    """The largest |dequantised - float| of any quantized weight, in steps of its group's scale."""
    worst = 0.0
    for name, w in int4_dequantized(scheme, stored).items():
        p = name.removesuffix(".weight")
        if p + ".scales" not in stored:
            continue
        g = _groups_of(scheme, stored, p, w.shape[1])
        step = stored[p + ".scales"].float()[g].T
        worst = max(worst, float(((w - hub[name].float()).abs() / step).max()))
    return worst
