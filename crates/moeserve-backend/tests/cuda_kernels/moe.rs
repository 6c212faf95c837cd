//! The MoE block on the device: the router kernel (top-k, renormalised weights, slots) against a
//! scalar router written as the CPU's (`moeserve-model` `moe/router.rs`: softmax or sigmoid
//! with a correction bias, groups, ties to the lower expert, renormalise, scale), and a whole expert layer (router → offsets → permute → grouped
//! GEMM → SwiGLU → grouped GEMM → unpermute) against `Σ w · w2(silu(w1 x) · w3 x)`.

use moeserve_backend::cpu;
use moeserve_backend::cuda::gemm::{GroupedGemm, grouped_expert_matmul};
use moeserve_backend::cuda::ops::{self, DeviceRouting, RouteArgs, RouterGroups, RouterScores};
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaSlice};

use crate::common::*;
use crate::for_each_dtype;

/// `(expert ids, weights)` of every token, best first, as the CPU router computes them.
fn reference_route(logits: &[f32], num_experts: usize, top_k: usize) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(num_experts) {
        let mut probs = row.to_vec();
        cpu::softmax_in_place(&mut probs);
        let mut order: Vec<usize> = (0..num_experts).collect();
        order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b)));
        let sum: f32 = order[..top_k].iter().map(|e| probs[*e]).sum();
        for e in &order[..top_k] {
            ids.push(*e as i32);
            weights.push(probs[*e] / sum);
        }
    }
    (ids, weights)
}

/// The router's outputs copied back.
struct Routed {
    ids: Vec<i32>,
    weights: Vec<f32>,
    slots: Vec<i32>,
    counts: Vec<i32>,
}

struct RouterBuffers {
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    slots: CudaSlice<i32>,
    counts: CudaSlice<i32>,
}

fn route_on<T: CudaElement>(
    gpu: &CudaBackend,
    logits: &CudaSlice<T>,
    shape: (usize, usize, usize),
    capacity: Option<usize>,
    renormalize: bool,
) -> RouterBuffers {
    let softmax = RouterScores::Softmax { groups: None };
    route_scored(gpu, logits, shape, (capacity, renormalize), softmax, 1.0)
}

fn route_scored<T: CudaElement>(
    gpu: &CudaBackend,
    logits: &CudaSlice<T>,
    shape: (usize, usize, usize),
    (capacity, renormalize): (Option<usize>, bool),
    scores: RouterScores<'_>,
    scale: f32,
) -> RouterBuffers {
    let (tokens, experts, top_k) = shape;
    let mut b = RouterBuffers {
        ids: gpu.zeros(tokens * top_k).unwrap(),
        weights: gpu.zeros(tokens * top_k).unwrap(),
        slots: gpu.zeros(tokens * top_k).unwrap(),
        counts: gpu.zeros(experts).unwrap(),
    };
    ops::route_top_k(
        gpu,
        RouteArgs {
            logits: logits.as_view(),
            bias: None,
            topk_ids: b.ids.as_view_mut(),
            topk_weights: b.weights.as_view_mut(),
            slots: b.slots.as_view_mut(),
            expert_counts: b.counts.as_view_mut(),
            top_k,
            capacity,
            renormalize,
            scores,
            scale,
        },
    )
    .unwrap();
    b
}

fn download(gpu: &CudaBackend, b: &RouterBuffers) -> Routed {
    Routed {
        ids: gpu.download(&b.ids).unwrap(),
        weights: gpu.download(&b.weights).unwrap(),
        slots: gpu.download(&b.slots).unwrap(),
        counts: gpu.download(&b.counts).unwrap(),
    }
}

/// Slots of each expert are exactly 0..kept, each once.
fn assert_slots_partition(r: &Routed, experts: usize, capacity: Option<usize>) {
    for e in 0..experts {
        let mut slots: Vec<i32> = r
            .ids
            .iter()
            .zip(&r.slots)
            .filter(|(id, s)| **id == e as i32 && **s >= 0)
            .map(|(_, s)| *s)
            .collect();
        slots.sort();
        let kept = capacity.map_or(r.counts[e], |c| r.counts[e].min(c as i32));
        assert_eq!(slots, (0..kept).collect::<Vec<_>>(), "expert {e}");
    }
}

fn router_matches_the_cpu_router<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    for (tokens, experts, top_k) in [(37, 8, 2), (5, 160, 6)] {
        let mut raw = random(tokens * experts, 30 + experts as u64, 4.0);
        // Ties: token 0 has equal logits everywhere; the lower experts must win.
        raw[..experts].fill(0.5);
        let (logits, logits_f32) = rounded::<T>(&raw);
        let logits_d = upload(gpu, &logits);
        let r = download(
            gpu,
            &route_on(gpu, &logits_d, (tokens, experts, top_k), None, true),
        );
        let (want_ids, want_weights) = reference_route(&logits_f32, experts, top_k);
        assert_eq!(r.ids, want_ids, "{experts} experts");
        assert_eq!(
            &r.ids[..top_k],
            &(0..top_k as i32).collect::<Vec<_>>(),
            "ties"
        );
        assert_close(
            "router weights",
            moeserve_core::DType::F32,
            &r.weights,
            &want_weights,
            1e-12,
        );
        let mut want_counts = vec![0; experts];
        want_ids.iter().for_each(|e| want_counts[*e as usize] += 1);
        assert_eq!(r.counts, want_counts);
        assert_slots_partition(&r, experts, None);
    }
}
for_each_dtype!(router_matches_the_cpu_router, router_matches_the_cpu_router);

/// `(expert ids, weights)` of every token under DeepSeek's routers, as the CPU router's
/// `Ranking::rank_scored` and `capacity::assign` compute them (dropless): softmax or sigmoid
/// scores; ranked by the scores plus `correction`; only the experts of the `keep` best groups
/// (scored by their best, or with sigmoid by the sum of their two best, ties to the lower
/// group); the weights renormalised in rank order, then scaled.
fn reference_scored(
    logits: &[f32],
    experts: usize,
    top_k: usize,
    (sigmoid, correction): (bool, Option<&[f32]>),
    (groups, keep): (usize, usize),
    scale: f32,
) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    let size = experts / groups;
    for row in logits.chunks_exact(experts) {
        let mut scores = row.to_vec();
        if sigmoid {
            scores
                .iter_mut()
                .for_each(|x| *x = 1.0 / (1.0 + (-*x).exp()));
        } else {
            cpu::softmax_in_place(&mut scores);
        }
        let mut choice = scores.clone();
        if let Some(c) = correction {
            choice.iter_mut().zip(c).for_each(|(v, b)| *v += b);
        }
        let mut group_scores: Vec<(f32, usize)> = choice
            .chunks_exact(size)
            .enumerate()
            .map(|(g, members)| {
                let mut sorted = members.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let score = if sigmoid && size > 1 {
                    sorted[0] + sorted[1]
                } else {
                    sorted[0]
                };
                (score, g)
            })
            .collect();
        group_scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, g) in &group_scores[keep..] {
            choice[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
        }
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|a, b| choice[*b].total_cmp(&choice[*a]).then(a.cmp(b)));
        let sum: f32 = order[..top_k].iter().map(|e| scores[*e]).sum();
        for e in &order[..top_k] {
            ids.push(*e as i32);
            weights.push(scores[*e] / sum * scale);
        }
    }
    (ids, weights)
}

/// DeepSeek-V3's `noaux_tc` (sigmoid, correction bias, 8 groups of 32 scored by their two
/// best, 4 kept, top 8, scaled by 2.5), the same without groups (GLM-4.5's single group), and
/// DeepSeek-V2's `group_limited_greedy` (softmax, 8 groups of 20 by their best, 3 kept, top 6)
/// on the device, against the CPU's computation. The correction bias is large enough to move
/// the choice away from the plain scores, so a kernel that ignored it would fail.
fn grouped_routers_match_the_cpu_router<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    for (experts, top_k, sigmoid, groups, keep, scale) in [
        (256, 8, true, 8, 4, 2.5),
        (160, 8, true, 1, 1, 1.0),
        (160, 6, false, 8, 3, 1.0),
    ] {
        let tokens = 19;
        let (logits, logits_f32) =
            rounded::<T>(&random(tokens * experts, 50 + experts as u64, 3.0));
        let logits_d = upload(gpu, &logits);
        let correction = random(experts, 51, 0.3);
        let correction_d = upload(gpu, &correction);
        let limit = (groups > 1).then_some(RouterGroups { groups, keep });
        let scores = if sigmoid {
            RouterScores::Sigmoid {
                correction: Some(correction_d.as_view()),
                groups: limit,
            }
        } else {
            RouterScores::Softmax { groups: limit }
        };
        let shape = (tokens, experts, top_k);
        let r = download(
            gpu,
            &route_scored(gpu, &logits_d, shape, (None, true), scores, scale),
        );
        let correction = sigmoid.then_some(&correction[..]);
        let (want_ids, want_weights) = reference_scored(
            &logits_f32,
            experts,
            top_k,
            (sigmoid, correction),
            (groups, keep),
            scale,
        );
        let what = format!("{experts} experts, sigmoid {sigmoid}, {groups} groups");
        assert_eq!(r.ids, want_ids, "{what}");
        assert_close(
            &what,
            moeserve_core::DType::F32,
            &r.weights,
            &want_weights,
            1e-12,
        );
        assert_slots_partition(&r, experts, None);
    }
}
for_each_dtype!(
    grouped_routers_match_the_cpu_router,
    grouped_routers_match_the_cpu_router
);

/// Without `norm_topk_prob` (Qwen2-MoE, OLMoE) the chosen pairs keep their softmax
/// probabilities over all experts.
fn router_without_renormalisation_keeps_the_probabilities<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (tokens, experts, top_k) = (9, 64, 8);
    let (logits, logits_f32) = rounded::<T>(&random(tokens * experts, 45, 4.0));
    let logits_d = upload(gpu, &logits);
    let r = download(
        gpu,
        &route_on(gpu, &logits_d, (tokens, experts, top_k), None, false),
    );
    let (want_ids, _) = reference_route(&logits_f32, experts, top_k);
    assert_eq!(r.ids, want_ids);
    let mut want = Vec::new();
    for (t, row) in logits_f32.chunks_exact(experts).enumerate() {
        let mut probs = row.to_vec();
        cpu::softmax_in_place(&mut probs);
        want.extend(
            r.ids[t * top_k..][..top_k]
                .iter()
                .map(|e| probs[*e as usize]),
        );
    }
    assert_close(
        "router weights",
        moeserve_core::DType::F32,
        &r.weights,
        &want,
        1e-12,
    );
}
for_each_dtype!(
    router_without_renormalisation_keeps_the_probabilities,
    router_without_renormalisation_keeps_the_probabilities
);

fn router_capacity_drops_overflow_and_renormalises<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (tokens, experts, top_k, capacity) = (64, 8, 2, 10);
    let (logits, _) = rounded::<T>(&random(tokens * experts, 40, 4.0));
    let logits_d = upload(gpu, &logits);
    let r = download(
        gpu,
        &route_on(
            gpu,
            &logits_d,
            (tokens, experts, top_k),
            Some(capacity),
            true,
        ),
    );
    assert_slots_partition(&r, experts, Some(capacity));
    assert!(
        r.slots.iter().any(|s| *s < 0),
        "64·2 pairs over 8·10 slots must drop some"
    );
    for t in 0..tokens {
        let (w, s) = (
            &r.weights[t * top_k..][..top_k],
            &r.slots[t * top_k..][..top_k],
        );
        let kept: f32 = w
            .iter()
            .zip(s)
            .filter(|(_, s)| **s >= 0)
            .map(|(w, _)| w)
            .sum();
        let any_kept = s.iter().any(|s| *s >= 0);
        assert!(
            if any_kept {
                (kept - 1.0).abs() < 1e-6
            } else {
                kept == 0.0
            },
            "token {t}: {w:?} {s:?}"
        );
        assert!(
            w.iter().zip(s).all(|(w, s)| *s >= 0 || *w == 0.0),
            "dropped pairs weigh 0"
        );
    }
}
for_each_dtype!(
    router_capacity_drops_overflow_and_renormalises,
    router_capacity_drops_overflow_and_renormalises
);

fn moe_layer_matches_the_scalar_experts<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let (tokens, hidden, inter, experts, top_k) = (19, 64, 96, 8, 2);
    let (x, x_f32) = rounded::<T>(&random(tokens * hidden, 50, 1.0));
    let (logits, logits_f32) = rounded::<T>(&random(tokens * experts, 51, 3.0));
    // Per expert: the fused [w1; w3] ([2·inter, hidden]) and w2 ([hidden, inter]).
    let w13: Vec<(Vec<T>, Vec<f32>)> = (0..experts)
        .map(|e| rounded::<T>(&random(2 * inter * hidden, 60 + e as u64, 0.15)))
        .collect();
    let w2: Vec<(Vec<T>, Vec<f32>)> = (0..experts)
        .map(|e| rounded::<T>(&random(hidden * inter, 80 + e as u64, 0.15)))
        .collect();
    let w13_d: Vec<CudaSlice<T>> = w13.iter().map(|(w, _)| upload(gpu, w)).collect();
    let w2_d: Vec<CudaSlice<T>> = w2.iter().map(|(w, _)| upload(gpu, w)).collect();

    let (x_d, logits_d) = (upload(gpu, &x), upload(gpu, &logits));
    let routed = route_on(gpu, &logits_d, (tokens, experts, top_k), None, true);
    let mut offsets_d = gpu.zeros::<i32>(experts + 1).unwrap();
    ops::moe_segment_offsets(gpu, routed.counts.as_view(), offsets_d.as_view_mut(), None).unwrap();
    let offsets: Vec<usize> = gpu
        .download(&offsets_d)
        .unwrap()
        .iter()
        .map(|o| *o as usize)
        .collect();
    let pairs = tokens * top_k;
    assert_eq!(offsets[experts], pairs);
    let routing = DeviceRouting {
        topk_ids: routed.ids.as_view(),
        topk_weights: routed.weights.as_view(),
        slots: routed.slots.as_view(),
        offsets: offsets_d.as_view(),
        top_k,
        ids_by_rank: true,
    };
    let mut permuted = gpu.zeros::<T>(pairs * hidden).unwrap();
    let mut pair_of_row = gpu.zeros::<i32>(pairs).unwrap();
    ops::moe_permute(
        gpu,
        x_d.as_view(),
        &routing,
        permuted.as_view_mut(),
        pair_of_row.as_view_mut(),
    )
    .unwrap();
    let mut gate_up = gpu.zeros::<T>(pairs * 2 * inter).unwrap();
    grouped_expert_matmul(
        gpu,
        GroupedGemm {
            x: permuted.as_view(),
            weights: &w13_d,
            y: gate_up.as_view_mut(),
            offsets: &offsets,
            n: 2 * inter,
            k: hidden,
        },
    )
    .unwrap();
    let mut act = gpu.zeros::<T>(pairs * inter).unwrap();
    ops::silu_mul(gpu, gate_up.as_view(), act.as_view_mut(), inter).unwrap();
    let mut expert_out = gpu.zeros::<T>(pairs * hidden).unwrap();
    grouped_expert_matmul(
        gpu,
        GroupedGemm {
            x: act.as_view(),
            weights: &w2_d,
            y: expert_out.as_view_mut(),
            offsets: &offsets,
            n: hidden,
            k: inter,
        },
    )
    .unwrap();
    let mut out = gpu.zeros::<T>(tokens * hidden).unwrap();
    ops::moe_unpermute(gpu, expert_out.as_view(), &routing, out.as_view_mut()).unwrap();

    // Every row of the permuted block is one pair's token.
    let rows = gpu.download(&pair_of_row).unwrap();
    let mut seen = rows.clone();
    seen.sort();
    assert_eq!(seen, (0..pairs as i32).collect::<Vec<_>>());

    let (ids, weights) = reference_route(&logits_f32, experts, top_k);
    let mut want = vec![0.0f32; tokens * hidden];
    for t in 0..tokens {
        let xt = &x_f32[t * hidden..][..hidden];
        // Summed in ascending expert order, as the CPU combines.
        let mut order: Vec<usize> = (0..top_k).collect();
        order.sort_by_key(|j| ids[t * top_k + j]);
        for j in order {
            let e = ids[t * top_k + j] as usize;
            let mut gu = vec![0.0; 2 * inter];
            cpu::reference::matmul_wt(xt, 1, &w13[e].1, 2 * inter, &mut gu);
            let (gate, up) = gu.split_at_mut(inter);
            cpu::silu_mul(gate, up);
            let mut y = vec![0.0; hidden];
            cpu::reference::matmul_wt(gate, 1, &w2[e].1, hidden, &mut y);
            let w = weights[t * top_k + j];
            want[t * hidden..][..hidden]
                .iter_mut()
                .zip(&y)
                .for_each(|(o, y)| *o += w * y);
        }
    }
    assert_close(
        "moe layer",
        T::DTYPE,
        &download_f32(gpu, &out),
        &want,
        chained_tolerance(T::DTYPE),
    );
}
for_each_dtype!(
    moe_layer_matches_the_scalar_experts,
    moe_layer_matches_the_scalar_experts
);

/// The experts' GEMM that reads the segment offsets on the device, against the per-segment
/// scalar product: empty segments, one row, exactly one pass of rows, one past it, several
/// passes; widths with and without 16-byte loads; an output width that leaves a block's last
/// warps without columns.
fn device_offset_gemm_matches_each_segments_product<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let rows_per_expert = [0usize, 1, ops::MOE_GEMM_ROWS, ops::MOE_GEMM_ROWS + 1, 40, 3];
    let experts = rows_per_expert.len();
    let offsets: Vec<i32> = std::iter::once(0)
        .chain(rows_per_expert.iter().scan(0, |acc, r| {
            *acc += *r as i32;
            Some(*acc)
        }))
        .collect();
    let rows = *offsets.last().unwrap() as usize;
    for (n, k) in [(50usize, 64usize), (24, 37)] {
        let (x, x_f32) = rounded::<T>(&random(rows * k, 11 + k as u64, 1.0));
        let weights: Vec<(Vec<T>, Vec<f32>)> = (0..experts)
            .map(|e| rounded::<T>(&random(n * k, 100 + e as u64, 0.5)))
            .collect();
        let w_d: Vec<CudaSlice<T>> = weights.iter().map(|(w, _)| upload(gpu, w)).collect();
        // SAFETY: `w_d` outlives the table (both live to the end of this iteration).
        let table = unsafe { ops::ExpertTable::new(gpu, &w_d, n, k) }.unwrap();
        let x_d = upload(gpu, &x);
        let offsets_d = gpu.upload(&offsets).unwrap();
        let mut y = gpu.zeros::<T>(rows * n).unwrap();
        ops::moe_grouped_gemm(
            gpu,
            x_d.as_view(),
            &table,
            y.as_view_mut(),
            offsets_d.as_view(),
        )
        .unwrap();
        let mut want = vec![0.0f32; rows * n];
        for e in 0..experts {
            let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
            if r1 == r0 {
                continue;
            }
            cpu::reference::matmul_wt(
                &x_f32[r0 * k..r1 * k],
                r1 - r0,
                &weights[e].1,
                n,
                &mut want[r0 * n..r1 * n],
            );
        }
        assert_close(
            &format!("moe_grouped_gemm n {n} k {k}"),
            T::DTYPE,
            &download_f32(gpu, &y),
            &want,
            tolerance(T::DTYPE),
        );
    }
}
for_each_dtype!(
    device_offset_gemm_matches_each_segments_product,
    device_offset_gemm_matches_each_segments_product
);
