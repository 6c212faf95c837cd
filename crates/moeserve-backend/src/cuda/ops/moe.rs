//! The MoE block's device kernels: router, segment offsets, permute and unpermute.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{
    MAX_EXPERTS, MAX_TOP_K, ROUTER_WARPS, ROW_THREADS, check, check_len, per_row, typed, untyped,
};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// The router: softmax, top-k, renormalise, capacity slots (see moe_router.cu).
pub struct RouteArgs<'a, T> {
    /// `[num_tokens, num_experts]`
    pub logits: CudaView<'a, T>,
    /// `[num_experts]`, added to the logits.
    pub bias: Option<CudaView<'a, f32>>,
    /// `[num_tokens, top_k]` outputs.
    pub topk_ids: CudaViewMut<'a, i32>,
    pub topk_weights: CudaViewMut<'a, f32>,
    pub slots: CudaViewMut<'a, i32>,
    /// `[num_experts]`; zeroed here, then counts the pairs that asked for each expert.
    pub expert_counts: CudaViewMut<'a, i32>,
    pub top_k: usize,
    /// Pairs per expert per step; `None` is dropless.
    pub capacity: Option<usize>,
    /// Whether the kept weights are renormalised to sum to 1 (`norm_topk_prob`).
    pub renormalize: bool,
}

pub fn route_top_k<T: CudaElement>(
    b: &CudaBackend,
    mut a: RouteArgs<'_, T>,
) -> Result<(), CudaError> {
    let e = a.expert_counts.len();
    check("route_top_k", (1..=MAX_EXPERTS).contains(&e), || {
        format!("{e} experts (1..={MAX_EXPERTS})")
    })?;
    check(
        "route_top_k",
        (1..=MAX_TOP_K.min(e)).contains(&a.top_k),
        || format!("top_k {} with {e} experts (at most {MAX_TOP_K})", a.top_k),
    )?;
    check("route_top_k", a.logits.len().is_multiple_of(e), || {
        "logits are not [num_tokens, num_experts]".into()
    })?;
    let n = a.logits.len() / e;
    for (what, len) in [
        ("topk_ids", a.topk_ids.len()),
        ("topk_weights", a.topk_weights.len()),
        ("slots", a.slots.len()),
    ] {
        check_len("route_top_k", what, len, n * a.top_k)?;
    }
    if let Some(bias) = &a.bias {
        check_len("route_top_k", "bias", bias.len(), e)?;
    }
    b.memset_zeros(&mut a.expert_counts)?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::MoeRouter, "route_top_k", T::SUFFIX)?;
    let (num_tokens, num_experts, top_k) = (n as i32, e as i32, a.top_k as i32);
    let capacity = a.capacity.unwrap_or(0) as i32;
    let renormalize = i32::from(a.renormalize);
    let null = 0u64;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&a.logits);
    match &a.bias {
        Some(bias) => l.arg(bias),
        None => l.arg(&null),
    };
    l.arg(&mut a.topk_ids)
        .arg(&mut a.topk_weights)
        .arg(&mut a.slots)
        .arg(&mut a.expert_counts);
    l.arg(&num_tokens)
        .arg(&num_experts)
        .arg(&top_k)
        .arg(&capacity)
        .arg(&renormalize);
    let blocks = (n as u32).div_ceil(ROUTER_WARPS);
    // SAFETY: lengths and the kernel's compiled limits checked above.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * ROUTER_WARPS, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}

/// `offsets[e]` of each expert's segment from the router's counts; `offsets: [E + 1]`.
pub fn moe_segment_offsets(
    b: &CudaBackend,
    expert_counts: CudaView<'_, i32>,
    mut offsets: CudaViewMut<'_, i32>,
    capacity: Option<usize>,
) -> Result<(), CudaError> {
    let e = expert_counts.len();
    check_len("moe_segment_offsets", "offsets", offsets.len(), e + 1)?;
    let f = untyped(b, KernelFile::MoePermute, "moe_segment_offsets")?;
    let (num_experts, cap) = (e as i32, capacity.unwrap_or(0) as i32);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&expert_counts)
        .arg(&mut offsets)
        .arg(&num_experts)
        .arg(&cap);
    // SAFETY: lengths checked.
    unsafe { l.launch(per_row(1, 32)) }?;
    Ok(())
}

/// The routing of one step on the device, as the router left it.
pub struct DeviceRouting<'a> {
    /// `[num_tokens, top_k]`
    pub topk_ids: CudaView<'a, i32>,
    pub topk_weights: CudaView<'a, f32>,
    pub slots: CudaView<'a, i32>,
    /// `[num_experts + 1]`
    pub offsets: CudaView<'a, i32>,
    pub top_k: usize,
}

/// Scatters token rows into per-expert segments: `permuted: [≥ kept pairs, hidden]`.
pub fn moe_permute<T: CudaElement>(
    b: &CudaBackend,
    x: CudaView<'_, T>,
    routing: &DeviceRouting<'_>,
    mut permuted: CudaViewMut<'_, T>,
    mut pair_of_row: CudaViewMut<'_, i32>,
) -> Result<(), CudaError> {
    let pairs = routing.topk_ids.len();
    check(
        "moe_permute",
        routing.top_k > 0 && pairs.is_multiple_of(routing.top_k),
        || "topk_ids are not [num_tokens, top_k]".into(),
    )?;
    let n = pairs / routing.top_k;
    check("moe_permute", n > 0 && x.len().is_multiple_of(n), || {
        "x is not [num_tokens, hidden]".into()
    })?;
    let h = x.len() / n;
    check_len("moe_permute", "permuted", permuted.len(), pairs * h)?;
    check_len("moe_permute", "pair_of_row", pair_of_row.len(), pairs)?;
    let f = typed(b, KernelFile::MoePermute, "moe_permute", T::SUFFIX)?;
    let (top_k, hidden) = (routing.top_k as i32, h as i32);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&x)
        .arg(&routing.topk_ids)
        .arg(&routing.slots)
        .arg(&routing.offsets);
    l.arg(&mut permuted)
        .arg(&mut pair_of_row)
        .arg(&top_k)
        .arg(&hidden);
    // SAFETY: permuted has room for every pair (dropless worst case); lengths checked.
    unsafe { l.launch(per_row(pairs, ROW_THREADS)) }?;
    Ok(())
}

/// Weighted sum of each token's expert outputs back in token order: `out: [num_tokens, hidden]`.
pub fn moe_unpermute<T: CudaElement>(
    b: &CudaBackend,
    expert_out: CudaView<'_, T>,
    routing: &DeviceRouting<'_>,
    mut out: CudaViewMut<'_, T>,
) -> Result<(), CudaError> {
    let pairs = routing.topk_ids.len();
    check(
        "moe_unpermute",
        routing.top_k > 0 && pairs.is_multiple_of(routing.top_k) && pairs > 0,
        || "topk_ids are not [num_tokens, top_k]".into(),
    )?;
    let n = pairs / routing.top_k;
    check("moe_unpermute", out.len().is_multiple_of(n), || {
        "out is not [num_tokens, hidden]".into()
    })?;
    let h = out.len() / n;
    check_len("moe_unpermute", "expert_out", expert_out.len(), pairs * h)?;
    check_len(
        "moe_unpermute",
        "topk_weights",
        routing.topk_weights.len(),
        pairs,
    )?;
    let f = typed(b, KernelFile::MoePermute, "moe_unpermute", T::SUFFIX)?;
    let (top_k, hidden) = (routing.top_k as i32, h as i32);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&expert_out)
        .arg(&routing.topk_ids)
        .arg(&routing.topk_weights)
        .arg(&routing.slots);
    l.arg(&routing.offsets)
        .arg(&mut out)
        .arg(&top_k)
        .arg(&hidden);
    // SAFETY: lengths checked; rows of expert_out come from the same routing.
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}
