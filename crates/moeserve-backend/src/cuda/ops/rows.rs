//! Row-wise kernels: embedding, row gather, RMSNorm with the residual add, SwiGLU, RoPE, the
//! KV-cache write, and the seeded fill of synthetic weights.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{ROW_THREADS, check, check_len, per_row, typed, untyped};
use crate::cpu::GatedActivation;
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// `out[t] = table[ids[t]]` widened to f32: the embedding, into the residual stream.
pub struct EmbeddingArgs<'a, T> {
    /// `[vocab, hidden]`
    pub table: CudaView<'a, T>,
    /// `[num_tokens]`, each `< vocab`.
    pub ids: CudaView<'a, u32>,
    /// `[num_tokens, hidden]`
    pub out: CudaViewMut<'a, f32>,
    pub hidden: usize,
}

pub fn embedding<T: CudaElement>(
    b: &CudaBackend,
    mut a: EmbeddingArgs<'_, T>,
) -> Result<(), CudaError> {
    let (n, h) = (a.ids.len(), a.hidden);
    check_len("embedding", "out", a.out.len(), n * h)?;
    check(
        "embedding",
        h > 0 && a.table.len().is_multiple_of(h),
        || {
            format!(
                "table length {} is not a multiple of hidden {h}",
                a.table.len()
            )
        },
    )?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Embedding, "embedding", T::SUFFIX)?;
    let hidden = h as i32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&a.table).arg(&a.ids).arg(&mut a.out).arg(&hidden);
    // SAFETY: lengths checked above; ids are in range (checked by the caller).
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// `dst[r] = src[rows[r]]` for f32 rows: the last token of each sequence before lm_head.
pub struct GatherRowsArgs<'a> {
    pub src: CudaView<'a, f32>,
    pub rows: CudaView<'a, i32>,
    pub dst: CudaViewMut<'a, f32>,
    pub hidden: usize,
}

pub fn gather_rows(b: &CudaBackend, mut a: GatherRowsArgs<'_>) -> Result<(), CudaError> {
    let (n, h) = (a.rows.len(), a.hidden);
    check_len("gather_rows", "dst", a.dst.len(), n * h)?;
    if n == 0 {
        return Ok(());
    }
    let f = untyped(b, KernelFile::Embedding, "gather_rows_f32")?;
    let hidden = h as i32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&a.src).arg(&a.rows).arg(&mut a.dst).arg(&hidden);
    // SAFETY: dst length checked; rows index src (checked by the caller).
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// `residual += delta` (when given), then `out = rmsnorm(residual) * weight`, per row.
pub struct RmsNormArgs<'a, T> {
    /// `[num_tokens, hidden]`, the f32 residual stream.
    pub residual: CudaViewMut<'a, f32>,
    /// `[num_tokens, hidden]`, the layer output to add first.
    pub delta: Option<CudaView<'a, T>>,
    /// `[hidden]`
    pub weight: CudaView<'a, T>,
    /// `[num_tokens, hidden]`
    pub out: CudaViewMut<'a, T>,
    pub eps: f32,
}

pub fn rms_norm_residual<T: CudaElement>(
    b: &CudaBackend,
    mut a: RmsNormArgs<'_, T>,
) -> Result<(), CudaError> {
    let h = a.weight.len();
    check(
        "rms_norm_residual",
        h > 0 && a.residual.len().is_multiple_of(h),
        || {
            format!(
                "residual length {} is not a multiple of hidden {h}",
                a.residual.len()
            )
        },
    )?;
    let n = a.residual.len() / h;
    check_len("rms_norm_residual", "out", a.out.len(), n * h)?;
    if let Some(d) = &a.delta {
        check_len("rms_norm_residual", "delta", d.len(), n * h)?;
    }
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::RmsNorm, "rms_norm_residual", T::SUFFIX)?;
    let (hidden, null) = (h as i32, 0u64);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut a.residual);
    match &a.delta {
        Some(d) => l.arg(d),
        None => l.arg(&null),
    };
    l.arg(&a.weight).arg(&mut a.out).arg(&hidden).arg(&a.eps);
    // SAFETY: every length checked above; a null delta is what the kernel tests for.
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// `out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]`.
pub fn silu_mul<T: CudaElement>(
    b: &CudaBackend,
    gate_up: CudaView<'_, T>,
    out: CudaViewMut<'_, T>,
    inter: usize,
) -> Result<(), CudaError> {
    gated_activation(b, gate_up, out, inter, GatedActivation::Silu)
}

/// `out[r, i] = act(gate_up[r, i], gate_up[r, inter + i])`: SwiGLU, or GPT-OSS's clamped one.
pub fn gated_activation<T: CudaElement>(
    b: &CudaBackend,
    gate_up: CudaView<'_, T>,
    mut out: CudaViewMut<'_, T>,
    inter: usize,
    act: GatedActivation,
) -> Result<(), CudaError> {
    let name = match act {
        GatedActivation::Silu => "silu_mul",
        GatedActivation::ClampedSwiglu { .. } => "clamped_swiglu",
    };
    check(name, inter > 0 && out.len().is_multiple_of(inter), || {
        format!(
            "out length {} is not a multiple of inter {inter}",
            out.len()
        )
    })?;
    let rows = out.len() / inter;
    check_len(name, "gate_up", gate_up.len(), 2 * rows * inter)?;
    if rows == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::SwiGlu, name, T::SUFFIX)?;
    let (r, i) = (rows as i32, inter as i32);
    let blocks = (rows * inter).div_ceil(ROW_THREADS as usize).min(1 << 20);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&gate_up).arg(&mut out).arg(&r).arg(&i);
    let (alpha, limit) = match act {
        GatedActivation::Silu => (0.0, 0.0),
        GatedActivation::ClampedSwiglu { alpha, limit } => (alpha, limit),
    };
    if let GatedActivation::ClampedSwiglu { .. } = act {
        l.arg(&alpha).arg(&limit);
    }
    // SAFETY: lengths checked; the kernel strides over the grid.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}

/// Rotary embeddings of q and k in place (HF `rotate_half` layout).
pub struct RopeArgs<'a, T> {
    /// `[num_tokens, num_heads * head_dim]`
    pub q: CudaViewMut<'a, T>,
    /// `[num_tokens, num_kv_heads * head_dim]`
    pub k: CudaViewMut<'a, T>,
    /// `[num_tokens]`
    pub positions: CudaView<'a, i32>,
    /// `[rotary_dim / 2]`, from `cpu::rope_inv_freq`.
    pub inv_freq: CudaView<'a, f32>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The rotated leading part of a head (`head_dim` unless `partial_rotary_factor` < 1).
    pub rotary_dim: usize,
    /// The cosines and sines are multiplied by it (YaRN's attention factor; 1 otherwise).
    pub scaling: f32,
}

pub fn rope<T: CudaElement>(b: &CudaBackend, mut a: RopeArgs<'_, T>) -> Result<(), CudaError> {
    let n = a.positions.len();
    check(
        "rope",
        a.rotary_dim.is_multiple_of(2) && a.rotary_dim <= a.head_dim,
        || {
            format!(
                "rotary_dim {} must be even and at most head_dim {}",
                a.rotary_dim, a.head_dim
            )
        },
    )?;
    check_len("rope", "q", a.q.len(), n * a.num_heads * a.head_dim)?;
    check_len("rope", "k", a.k.len(), n * a.num_kv_heads * a.head_dim)?;
    check_len("rope", "inv_freq", a.inv_freq.len(), a.rotary_dim / 2)?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Rope, "rope", T::SUFFIX)?;
    let (nh, nkv, d, r) = (
        a.num_heads as i32,
        a.num_kv_heads as i32,
        a.head_dim as i32,
        a.rotary_dim as i32,
    );
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut a.q)
        .arg(&mut a.k)
        .arg(&a.positions)
        .arg(&a.inv_freq)
        .arg(&nh)
        .arg(&nkv)
        .arg(&d)
        .arg(&r)
        .arg(&a.scaling);
    // SAFETY: lengths checked above.
    unsafe { l.launch(per_row(n, 128)) }?;
    Ok(())
}

/// Writes the step's keys and values into one layer's cache at `slot_mapping` (-1 skips).
pub struct WriteKvArgs<'a, T> {
    /// `[num_tokens, kv_dim]`
    pub k: CudaView<'a, T>,
    pub v: CudaView<'a, T>,
    /// `[num_slots, kv_dim]`, one layer.
    pub k_cache: CudaViewMut<'a, T>,
    pub v_cache: CudaViewMut<'a, T>,
    /// `[num_tokens]`, each `< num_slots` or negative.
    pub slot_mapping: CudaView<'a, i64>,
    pub kv_dim: usize,
}

pub fn write_kv<T: CudaElement>(
    b: &CudaBackend,
    mut a: WriteKvArgs<'_, T>,
) -> Result<(), CudaError> {
    let n = a.slot_mapping.len();
    check_len("write_kv", "k", a.k.len(), n * a.kv_dim)?;
    check_len("write_kv", "v", a.v.len(), n * a.kv_dim)?;
    check_len("write_kv", "v_cache", a.v_cache.len(), a.k_cache.len())?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::KvCache, "write_kv", T::SUFFIX)?;
    let kv_dim = a.kv_dim as i32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&a.k)
        .arg(&a.v)
        .arg(&mut a.k_cache)
        .arg(&mut a.v_cache)
        .arg(&a.slot_mapping)
        .arg(&kv_dim);
    // SAFETY: lengths checked; slots are in range (the block tables come from the KV manager).
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// Fills `out` with seeded uniform values in `[-scale, scale)` (synthetic weights).
pub fn fill_uniform<T: CudaElement>(
    b: &CudaBackend,
    mut out: CudaViewMut<'_, T>,
    seed: u64,
    scale: f32,
) -> Result<(), CudaError> {
    let n = out.len() as i64;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Init, "fill_uniform", T::SUFFIX)?;
    let blocks = (out.len().div_ceil(ROW_THREADS as usize)).min(1 << 16) as u32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut out).arg(&n).arg(&seed).arg(&scale);
    // SAFETY: the kernel writes out[0..n] with a grid-stride loop.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}
