//! Multi-head latent attention's row-wise kernels (mla.cu): RoPE on the rotary slices, the
//! rotary queries beside the absorbed ones, the latent rows into the cache.

use cudarc::driver::PushKernelArg;

use super::{ROW_THREADS, check, check_len, per_row, typed};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// The widths of one layer's latent attention.
#[derive(Clone, Copy, Debug)]
pub struct LatentShape {
    pub num_heads: usize,
    /// `qk_nope_head_dim`: the part of a query head that is absorbed.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `kv_lora_rank`.
    pub rank: usize,
}

impl LatentShape {
    fn qk_head_dim(&self) -> usize {
        self.nope + self.rope
    }

    fn latent_dim(&self) -> usize {
        self.rank + self.rope
    }

    /// `num_heads, qk_head_dim, nope, rope, latent_dim, kv_lora_rank`: the kernels' `int`
    /// arguments, in mla.cu's order.
    fn kernel_args(&self) -> [i32; 6] {
        [
            self.num_heads,
            self.qk_head_dim(),
            self.nope,
            self.rope,
            self.latent_dim(),
            self.rank,
        ]
        .map(|v| v as i32)
    }
}

/// RoPE in place on each query head's rotary slice and each latent row's rotary key.
pub struct LatentRopeArgs<'a, T> {
    /// `[num_tokens, num_heads * (nope + rope)]`
    pub q: CudaViewMut<'a, T>,
    /// `[num_tokens, rank + rope]`
    pub latent: CudaViewMut<'a, T>,
    /// `[num_tokens]`
    pub positions: CudaView<'a, i32>,
    /// `[rope / 2]`
    pub inv_freq: CudaView<'a, f32>,
    pub shape: LatentShape,
    /// Pairs `(2i, 2i + 1)` instead of `(i, i + rope / 2)`.
    pub interleave: bool,
    /// YaRN's attention factor on the cosines and sines (1 otherwise).
    pub scaling: f32,
}

pub fn mla_rope<T: CudaElement>(
    b: &CudaBackend,
    mut a: LatentRopeArgs<'_, T>,
) -> Result<(), CudaError> {
    let (s, n) = (a.shape, a.positions.len());
    check("mla_rope", s.rope.is_multiple_of(2), || {
        format!("qk_rope_head_dim {} is odd", s.rope)
    })?;
    check_len(
        "mla_rope",
        "q",
        a.q.len(),
        n * s.num_heads * s.qk_head_dim(),
    )?;
    check_len("mla_rope", "latent", a.latent.len(), n * s.latent_dim())?;
    check_len("mla_rope", "inv_freq", a.inv_freq.len(), s.rope / 2)?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Mla, "mla_rope", T::SUFFIX)?;
    let [heads, qk, nope, rope, latent, rank] = s.kernel_args();
    let interleave = a.interleave as i32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut a.q)
        .arg(&mut a.latent)
        .arg(&a.positions)
        .arg(&a.inv_freq)
        .arg(&heads)
        .arg(&qk)
        .arg(&nope)
        .arg(&rope)
        .arg(&latent)
        .arg(&rank)
        .arg(&interleave)
        .arg(&a.scaling);
    // SAFETY: lengths checked above.
    unsafe { l.launch(per_row(n, 128)) }?;
    Ok(())
}

/// `latent_q[t, h, rank..] = q[t, h, nope..]`: each head's rotary query beside its absorbed
/// one (`latent_q: [num_tokens, num_heads * (rank + rope)]`).
pub fn mla_copy_rope<T: CudaElement>(
    b: &CudaBackend,
    q: CudaView<'_, T>,
    mut latent_q: CudaViewMut<'_, T>,
    s: LatentShape,
) -> Result<(), CudaError> {
    let per_token = s.num_heads * s.qk_head_dim();
    check(
        "mla_copy_rope",
        per_token > 0 && q.len().is_multiple_of(per_token),
        || format!("q length {} is not a multiple of {per_token}", q.len()),
    )?;
    let n = q.len() / per_token;
    check_len(
        "mla_copy_rope",
        "latent_q",
        latent_q.len(),
        n * s.num_heads * s.latent_dim(),
    )?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Mla, "mla_copy_rope", T::SUFFIX)?;
    let [heads, qk, nope, rope, latent, rank] = s.kernel_args();
    let mut l = b.stream().launch_builder(&f);
    l.arg(&q)
        .arg(&mut latent_q)
        .arg(&heads)
        .arg(&qk)
        .arg(&nope)
        .arg(&rope)
        .arg(&latent)
        .arg(&rank);
    // SAFETY: lengths checked above.
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// The step's latent rows (`[num_tokens, latent_dim]`) into one layer's cache (`[num_slots,
/// latent_dim]`) at `slot_mapping` (negative: skipped).
pub fn write_latent<T: CudaElement>(
    b: &CudaBackend,
    latent: CudaView<'_, T>,
    mut cache: CudaViewMut<'_, T>,
    slot_mapping: CudaView<'_, i64>,
    latent_dim: usize,
) -> Result<(), CudaError> {
    let n = slot_mapping.len();
    check_len("write_latent", "latent", latent.len(), n * latent_dim)?;
    check(
        "write_latent",
        latent_dim > 0 && cache.len().is_multiple_of(latent_dim),
        || format!("cache length {} is not [slots, {latent_dim}]", cache.len()),
    )?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Mla, "write_latent", T::SUFFIX)?;
    let width = latent_dim as i32;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&latent)
        .arg(&mut cache)
        .arg(&slot_mapping)
        .arg(&width);
    // SAFETY: lengths checked; slots are in range (the block tables come from the KV manager).
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}
