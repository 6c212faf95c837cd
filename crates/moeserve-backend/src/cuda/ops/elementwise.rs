//! Element-wise kernels of the families' options (elementwise.cu) and the in-place row RMSNorm
//! of q/k norms (rmsnorm.cu): a linear layer's bias, the `clip_qkv` clamp, the shared expert's
//! (optionally sigmoid-gated) add.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{ROW_THREADS, check, check_len, per_row, typed};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// A grid-strided launch over `n` elements.
fn strided(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(ROW_THREADS as usize).min(1 << 20) as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows of `width` in `len` elements, or an error naming `op`.
fn rows_of(op: &'static str, len: usize, width: usize) -> Result<usize, CudaError> {
    check(op, width > 0 && len.is_multiple_of(width), || {
        format!("length {len} is not a multiple of the row width {width}")
    })?;
    Ok(len / width)
}

/// `x[r] += bias` for every row of `x: [rows, bias.len()]`.
pub fn add_bias<T: CudaElement>(
    b: &CudaBackend,
    mut x: CudaViewMut<'_, T>,
    bias: CudaView<'_, T>,
) -> Result<(), CudaError> {
    let rows = rows_of("add_bias", x.len(), bias.len())?;
    if rows == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Elementwise, "add_bias", T::SUFFIX)?;
    let (r, w, launch) = (rows as i32, bias.len() as i32, strided(x.len()));
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut x).arg(&bias).arg(&r).arg(&w);
    // SAFETY: x is rows · width long, checked above; the kernel strides over the grid.
    unsafe { l.launch(launch) }?;
    Ok(())
}

/// `x[r] += bias[e]` for the rows of segment e (`offsets[e] <= r < offsets[e + 1]`): an expert's
/// bias over its rows of the permuted activations. `x: [rows, width]` with at least
/// `offsets[num_segments]` rows; `bias: [num_segments, width]` in f32; `offsets` as
/// `moe_segment_offsets` leaves them (`[num_segments + 1]`, on the device).
pub fn add_segment_bias<T: CudaElement>(
    b: &CudaBackend,
    mut x: CudaViewMut<'_, T>,
    bias: CudaView<'_, f32>,
    offsets: CudaView<'_, i32>,
    width: usize,
) -> Result<(), CudaError> {
    let segments = offsets.len().saturating_sub(1);
    check("add_segment_bias", segments > 0 && width > 0, || {
        format!("{} offsets, width {width}", offsets.len())
    })?;
    check_len("add_segment_bias", "bias", bias.len(), segments * width)?;
    rows_of("add_segment_bias", x.len(), width)?;
    let f = typed(b, KernelFile::Elementwise, "add_segment_bias", T::SUFFIX)?;
    let (n, w, launch) = (segments as i32, width as i32, strided(x.len()));
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut x).arg(&bias).arg(&offsets).arg(&n).arg(&w);
    // SAFETY: the kernel visits the offsets' rows only, and the caller's offsets end within x
    // (the permuted rows the offsets were made for).
    unsafe { l.launch(launch) }?;
    Ok(())
}

/// `x = clamp(x, -limit, limit)`.
pub fn clamp<T: CudaElement>(
    b: &CudaBackend,
    mut x: CudaViewMut<'_, T>,
    limit: f32,
) -> Result<(), CudaError> {
    check("clamp", limit >= 0.0, || format!("negative limit {limit}"))?;
    if x.is_empty() {
        return Ok(());
    }
    let f = typed(b, KernelFile::Elementwise, "clamp", T::SUFFIX)?;
    let (n, launch) = (x.len() as i64, strided(x.len()));
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut x).arg(&n).arg(&limit);
    // SAFETY: n is x's length; the kernel strides over the grid.
    unsafe { l.launch(launch) }?;
    Ok(())
}

/// `delta[r] += g[r] · src[r]` over rows of `width`, `g[r] = sigmoid(gate_logit[r])` or 1.
pub fn add_gated<T: CudaElement>(
    b: &CudaBackend,
    mut delta: CudaViewMut<'_, T>,
    src: CudaView<'_, T>,
    gate_logit: Option<CudaView<'_, T>>,
    width: usize,
) -> Result<(), CudaError> {
    let rows = rows_of("add_gated", delta.len(), width)?;
    check_len("add_gated", "src", src.len(), delta.len())?;
    if let Some(g) = &gate_logit {
        check_len("add_gated", "gate_logit", g.len(), rows)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::Elementwise, "add_gated", T::SUFFIX)?;
    let (r, w, null, launch) = (rows as i32, width as i32, 0u64, strided(delta.len()));
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut delta).arg(&src);
    match &gate_logit {
        Some(g) => l.arg(g),
        None => l.arg(&null),
    };
    l.arg(&r).arg(&w);
    // SAFETY: lengths checked above; a null gate is what the kernel tests for.
    unsafe { l.launch(launch) }?;
    Ok(())
}

/// RMSNorm of `x` in place over rows as wide as `weight` (q/k norms: per head, or over the
/// whole projection).
pub fn rms_norm_rows<T: CudaElement>(
    b: &CudaBackend,
    x: CudaViewMut<'_, T>,
    weight: CudaView<'_, T>,
    eps: f32,
) -> Result<(), CudaError> {
    let width = weight.len();
    rms_norm_row_prefixes(b, x, weight, width, eps)
}

/// RMSNorm in place of the first `weight.len()` elements of each row of `x`, rows `stride`
/// wide (MLA's `kv_a_layernorm` on the latent part of each cached row).
pub fn rms_norm_row_prefixes<T: CudaElement>(
    b: &CudaBackend,
    mut x: CudaViewMut<'_, T>,
    weight: CudaView<'_, T>,
    stride: usize,
    eps: f32,
) -> Result<(), CudaError> {
    check("rms_norm_rows", weight.len() <= stride, || {
        format!("weight of {} wider than rows of {stride}", weight.len())
    })?;
    let rows = rows_of("rms_norm_rows", x.len(), stride)?;
    if rows == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::RmsNorm, "rms_norm_rows", T::SUFFIX)?;
    let (width, stride) = (weight.len() as i32, stride as i32);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut x)
        .arg(&weight)
        .arg(&width)
        .arg(&stride)
        .arg(&eps);
    // SAFETY: x is rows · stride long, checked above, and width ≤ stride; one block per row.
    unsafe { l.launch(per_row(rows, ROW_THREADS)) }?;
    Ok(())
}
