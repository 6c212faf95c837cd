//! The MoE block's device kernels: router, segment offsets, permute, the experts' GEMM with
//! device-side offsets, and unpermute.

use std::marker::PhantomData;

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::{
    MAX_EXPERTS, MAX_ROUTER_GROUPS, MAX_TOP_K, ROUTER_WARPS, ROW_THREADS, check, check_len,
    per_row, typed, untyped,
};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice, CudaView, CudaViewMut};

/// The router: scores (softmax or sigmoid), group limit, top-k, renormalise, scale, capacity
/// slots (see moe_router.cu).
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
    /// How the logits become rankings and weights.
    pub scores: RouterScores<'a>,
    /// `routed_scaling_factor`: every kept weight is multiplied by it, after renormalising.
    pub scale: f32,
}

/// How a router scores its experts ([`RouteArgs::scores`]), as the CPU router's `Scoring`.
pub enum RouterScores<'a> {
    /// Softmax over all experts (Mixtral, Qwen, OLMoE); with `groups`, ranked within the best
    /// groups by their best probability (DeepSeek-V2's `group_limited_greedy`).
    Softmax { groups: Option<RouterGroups> },
    /// `sigmoid(logit)` weights, ranked by them plus `correction` (`e_score_correction_bias`,
    /// `[num_experts]`) within the best groups by the sum of their two best (DeepSeek-V3's
    /// `noaux_tc`, GLM-4.5).
    Sigmoid {
        correction: Option<CudaView<'a, f32>>,
        groups: Option<RouterGroups>,
    },
}

/// Only the experts of the `keep` best of `groups` equal groups are ranked (`n_group`,
/// `topk_group`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterGroups {
    pub groups: usize,
    pub keep: usize,
}

/// Whether [`route_top_k`] takes a router of `experts` experts choosing `top_k` with `scores`
/// (the limits compiled into moe_router.cu; groups that divide the experts and hold `top_k`).
pub fn router_kernel_takes(experts: usize, top_k: usize, scores: &RouterScores<'_>) -> bool {
    let groups = match *scores {
        RouterScores::Softmax { groups } | RouterScores::Sigmoid { groups, .. } => groups,
    };
    (1..=MAX_EXPERTS).contains(&experts)
        && (1..=MAX_TOP_K.min(experts)).contains(&top_k)
        && groups.is_none_or(|g| groups_fit(g, experts, top_k))
}

/// `g` fits the kernel and `experts` experts choosing `top_k`.
fn groups_fit(RouterGroups { groups, keep }: RouterGroups, experts: usize, top_k: usize) -> bool {
    (1..=MAX_ROUTER_GROUPS).contains(&groups)
        && experts.is_multiple_of(groups)
        && (1..=groups).contains(&keep)
        && top_k <= keep * (experts / groups)
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
    let (sigmoid, correction, groups) = match a.scores {
        RouterScores::Softmax { groups } => (false, None, groups),
        RouterScores::Sigmoid { correction, groups } => (true, correction, groups),
    };
    if let Some(c) = &correction {
        check_len("route_top_k", "correction", c.len(), e)?;
    }
    if let Some(g @ RouterGroups { groups, keep }) = groups {
        check("route_top_k", groups_fit(g, e, a.top_k), || {
            format!(
                "{keep} of {groups} groups of {e} experts for top_k {} (at most \
                     {MAX_ROUTER_GROUPS} groups, dividing the experts, holding top_k)",
                a.top_k
            )
        })?;
    }
    check("route_top_k", a.scale.is_finite() && a.scale > 0.0, || {
        format!("scale {} (a number above 0)", a.scale)
    })?;
    b.memset_zeros(&mut a.expert_counts)?;
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::MoeRouter, "route_top_k", T::SUFFIX)?;
    let (num_tokens, num_experts, top_k) = (n as i32, e as i32, a.top_k as i32);
    let capacity = a.capacity.unwrap_or(0) as i32;
    let renormalize = i32::from(a.renormalize);
    let sigmoid = i32::from(sigmoid);
    // No limit: one group holding every expert.
    let (groups, keep) = groups.map_or((1, 1), |g| (g.groups as i32, g.keep as i32));
    let null = 0u64;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&a.logits);
    match &a.bias {
        Some(bias) => l.arg(bias),
        None => l.arg(&null),
    };
    match &correction {
        Some(c) => l.arg(c),
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
        .arg(&renormalize)
        .arg(&sigmoid)
        .arg(&groups)
        .arg(&keep)
        .arg(&a.scale);
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
    /// Whether `topk_ids` are expert ids best first (the router kernel's), which the combine
    /// sorts to sum in ascending expert order; `false` when the host already laid each token's
    /// pairs out in that order (its ids may then be segments of a placement).
    pub ids_by_rank: bool,
}

/// Most pairs per token the combine orders (moe_permute.cu).
const UNPERMUTE_MAX_TOP_K: usize = 16;

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

/// Weighted sum of each token's expert outputs back in token order, each token's pairs in
/// ascending expert order (the CPU's): `out: [num_tokens, hidden]`.
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
    check(
        "moe_unpermute",
        routing.top_k <= UNPERMUTE_MAX_TOP_K,
        || format!("top_k {} above {UNPERMUTE_MAX_TOP_K}", routing.top_k),
    )?;
    let f = typed(b, KernelFile::MoePermute, "moe_unpermute", T::SUFFIX)?;
    let (top_k, hidden) = (routing.top_k as i32, h as i32);
    let sort_by_id = i32::from(routing.ids_by_rank);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&expert_out)
        .arg(&routing.topk_ids)
        .arg(&routing.topk_weights)
        .arg(&routing.slots);
    l.arg(&routing.offsets)
        .arg(&mut out)
        .arg(&top_k)
        .arg(&hidden)
        .arg(&sort_by_id);
    // SAFETY: lengths checked; rows of expert_out come from the same routing.
    unsafe { l.launch(per_row(n, ROW_THREADS)) }?;
    Ok(())
}

/// Device pointers to one expert matrix `[n, k]` per expert (a layer's `w1 | w3` or `w2`), for
/// [`moe_grouped_gemm`].
pub struct ExpertTable<T> {
    pointers: CudaSlice<u64>,
    n: usize,
    k: usize,
    _element: PhantomData<T>,
}

impl<T: CudaElement> ExpertTable<T> {
    /// The table of `experts`, each `[n, k]`.
    ///
    /// # Safety
    /// The table holds raw device pointers: `experts` must be neither freed nor reallocated
    /// while the table is used (the model keeps both in one layer's weights).
    pub unsafe fn new(
        b: &CudaBackend,
        experts: &[CudaSlice<T>],
        n: usize,
        k: usize,
    ) -> Result<Self, CudaError> {
        let mut pointers = Vec::with_capacity(experts.len());
        for (e, w) in experts.iter().enumerate() {
            check_len("ExpertTable", &format!("expert {e}"), w.len(), n * k)?;
            let (ptr, _sync) = w.device_ptr(b.stream());
            pointers.push(ptr);
        }
        Ok(ExpertTable {
            pointers: b.upload(&pointers)?,
            n,
            k,
            _element: PhantomData,
        })
    }

    pub fn num_experts(&self) -> usize {
        self.pointers.len()
    }
}

/// Rows a segment may have for [`moe_grouped_gemm`] to read its expert's weights once
/// (`MOE_GEMM_ROWS` of moe_gemm.cu); longer segments read them once per this many rows.
pub const MOE_GEMM_ROWS: usize = 16;
/// Output columns per warp, and warps per block (moe_gemm.cu).
const MOE_GEMM_COLS: u32 = 2;
const MOE_GEMM_WARPS: u32 = 8;

/// `y[row] = x[row] · W_eᵀ` for every row of each expert `e`'s segment, the segments' offsets
/// read on the device (no copy to the host): `x: [rows, k]`, `y: [rows, n]`, `offsets:
/// [E + 1]` as the router left them (rows past `offsets[E]` are not touched).
pub fn moe_grouped_gemm<T: CudaElement>(
    b: &CudaBackend,
    x: CudaView<'_, T>,
    table: &ExpertTable<T>,
    mut y: CudaViewMut<'_, T>,
    offsets: CudaView<'_, i32>,
) -> Result<(), CudaError> {
    let (n, k, e) = (table.n, table.k, table.num_experts());
    check_len("moe_grouped_gemm", "offsets", offsets.len(), e + 1)?;
    check(
        "moe_grouped_gemm",
        n > 0 && k > 0 && x.len().is_multiple_of(k) && y.len() == x.len() / k * n,
        || {
            format!(
                "x ({}) and y ({}) are not [rows, {k}] and [rows, {n}]",
                x.len(),
                y.len()
            )
        },
    )?;
    if x.is_empty() || e == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::MoeGemm, "moe_grouped_gemm", T::SUFFIX)?;
    let (n32, k32) = (n as i32, k as i32);
    let mut l = b.stream().launch_builder(&f);
    l.arg(&x)
        .arg(&table.pointers)
        .arg(&mut y)
        .arg(&offsets)
        .arg(&n32)
        .arg(&k32);
    let cols_per_block = MOE_GEMM_COLS * MOE_GEMM_WARPS;
    // SAFETY: the table's matrices are [n, k] (checked when it was made, alive by its
    // contract); x and y hold every row the offsets name (the router's pairs).
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: ((n as u32).div_ceil(cols_per_block), e as u32, 1),
            block_dim: (32 * MOE_GEMM_WARPS, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    Ok(())
}
