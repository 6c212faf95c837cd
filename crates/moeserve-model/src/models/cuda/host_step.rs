//! The host's share of a CUDA step: the index arrays the kernels read (positions, slots, block
//! tables, logit rows) and routings made on the host in the kernels' layout.

use moeserve_backend::cuda::CudaView;
use moeserve_backend::cuda::ops::{
    MOE_GEMM_ROWS, RouterGroups, RouterScores, Split, attention_tiles, router_kernel_takes,
    rows_per_block,
};

use crate::Result;
use crate::batch::{BatchLimits, ForwardBatch, TokenPlace};
use crate::config::ModelConfig;
use crate::kv_cache::slot_of;
use crate::models::LogitsFor;
use crate::moe::record::LayerRouting;
use crate::moe::{Capacity, GroupLimit, RoutedStep, RoutingCounts, Scoring};

/// The host-side layout of one step: what the kernels index by.
pub(super) struct StepInputs {
    pub(super) ids: Vec<u32>,
    pub(super) positions: Vec<i32>,
    /// Per token: its sequence (row of the block tables).
    pub(super) token_seq: Vec<i32>,
    pub(super) slots: Vec<i64>,
    /// `[num_sequences, max_blocks]`, padded with 0 (never read past a sequence's length).
    pub(super) block_tables: Vec<i32>,
    pub(super) max_blocks: usize,
    /// The tokens that get logits.
    pub(super) logit_rows: Vec<i32>,
}

pub(super) fn step_inputs(
    batch: &ForwardBatch<'_>,
    limits: &BatchLimits,
    logits: LogitsFor,
) -> Result<StepInputs> {
    let places = batch.places(limits)?;
    let seqs = batch.sequences;
    let max_blocks = seqs
        .iter()
        .map(|s| s.block_table.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut block_tables = vec![0i32; seqs.len() * max_blocks];
    for (row, s) in block_tables.chunks_exact_mut(max_blocks).zip(seqs) {
        for (dst, b) in row.iter_mut().zip(s.block_table) {
            *dst = *b as i32;
        }
    }
    let slot = |p: &TokenPlace| {
        slot_of(seqs[p.sequence].block_table, limits.block_size, p.position) as i64
    };
    let logit_rows = match logits {
        LogitsFor::AllTokens => (0..places.len() as i32).collect(),
        LogitsFor::LastTokens => seqs
            .iter()
            .map(|s| (s.query_start + s.query_len - 1) as i32)
            .collect(),
    };
    Ok(StepInputs {
        ids: batch.token_ids.to_vec(),
        positions: places.iter().map(|p| p.position as i32).collect(),
        token_seq: places.iter().map(|p| p.sequence as i32).collect(),
        slots: places.iter().map(slot).collect(),
        block_tables,
        max_blocks,
        logit_rows,
    })
}

/// Floats of room for split attention's partial results (64 MiB; a batch of 64 Mixtral
/// sequences at 16 384 tokens of context needs 8.5 M).
const PARTIAL_FLOATS: usize = 1 << 24;

/// The attention kernel's view of a model: query heads, KV heads, value width (MLA: all heads
/// over one latent "KV head", values `kv_lora_rank` wide).
fn attention_geometry(c: &ModelConfig) -> (usize, usize, usize) {
    match &c.mla {
        Some(m) => (c.num_attention_heads, 1, m.kv_lora_rank),
        None => (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
    }
}

/// How attention splits the keys of `tokens` step tokens whose longest context is
/// `max_context` (one partition per `PARTITION_KEYS` keys while the partials fit).
pub(crate) fn attention_split(c: &ModelConfig, tokens: usize, max_context: usize) -> Split {
    let (heads, _, value_dim) = attention_geometry(c);
    Split::for_step(tokens, heads, value_dim, max_context, PARTIAL_FLOATS)
}

/// Floats of partial results `split` writes for `tokens` tokens.
pub(crate) fn partial_floats(c: &ModelConfig, split: Split, tokens: usize) -> usize {
    let (heads, _, value_dim) = attention_geometry(c);
    split.partial_floats(tokens, heads, value_dim)
}

/// Whether a step's MoE layers route on the device: dropless, on one GPU, with a router the
/// kernel takes ([`device_router_scores`]; every family's scoring, within its compiled limits).
/// Anything else routes on the host with the CPU's router (a capacity, whose overflow must be
/// chosen in token order; the placement's slots under expert parallelism).
pub(crate) fn routes_on_device(c: &ModelConfig, capacity: Capacity, expert_parallel: bool) -> bool {
    capacity == Capacity::Dropless
        && !expert_parallel
        && router_kernel_takes(
            c.num_local_experts,
            c.num_experts_per_tok,
            &device_router_scores(c.router_scoring, None),
        )
}

/// The router kernel's scoring for the CPU router's `scoring`, with the layer's
/// `e_score_correction_bias` on the device (sigmoid scoring).
pub(crate) fn device_router_scores(
    scoring: Scoring,
    correction: Option<CudaView<'_, f32>>,
) -> RouterScores<'_> {
    let limit = |g: GroupLimit| RouterGroups {
        groups: g.groups,
        keep: g.keep,
    };
    match scoring {
        Scoring::Softmax => RouterScores::Softmax { groups: None },
        Scoring::SoftmaxGrouped { group_limit } => RouterScores::Softmax {
            groups: Some(limit(group_limit)),
        },
        Scoring::Sigmoid { group_limit } => RouterScores::Sigmoid {
            correction,
            groups: group_limit.map(limit),
        },
    }
}

/// Whether a device-routed step of `tokens` tokens runs its experts on the GEMM that reads the
/// segment offsets on the device: at most `MOE_GEMM_ROWS` rows per expert on average, where
/// one pass over each expert's weights serves its rows. Larger steps read the offsets back for
/// cuBLAS.
pub(crate) fn experts_on_device_offsets(c: &ModelConfig, tokens: usize) -> bool {
    tokens * c.num_experts_per_tok <= MOE_GEMM_ROWS * c.num_local_experts
}

/// How one step's attention runs: its token tiles and its split of long contexts.
pub(super) struct AttentionLayout {
    pub(super) tiles: Vec<i32>,
    pub(super) split: Split,
}

impl AttentionLayout {
    pub(super) fn new(c: &ModelConfig, x: &StepInputs) -> Self {
        let (heads, kv_heads, _) = attention_geometry(c);
        let (_, tokens_per_tile) = rows_per_block(heads, kv_heads);
        let max_context = x.positions.iter().max().map_or(0, |p| *p as usize + 1);
        AttentionLayout {
            tiles: attention_tiles(&x.token_seq, tokens_per_tile),
            split: attention_split(c, x.ids.len(), max_context),
        }
    }
}

/// The order of the logits rows on the device when some rows want only their greedy token:
/// the rows to sample first (their logits come back as one block), then the greedy ones
/// (reduced on the device). Returns the original row of each device row, and how many rows
/// come back whole.
pub(super) fn greedy_order(wanted: &[bool]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..wanted.len()).filter(|r| !wanted[*r]).collect();
    let sampled = order.len();
    order.extend((0..wanted.len()).filter(|r| wanted[*r]));
    (order, sampled)
}

/// A routing made on the host in the device kernels' layout (see `moe_permute.cu`): per
/// (token, rank) pair its expert, weight and row within the expert's segment (`-1`: no pair
/// there, e.g. dropped), and the segments' offsets.
pub(super) struct HostRouting {
    /// `[num_tokens * top_k]`
    pub(super) topk_ids: Vec<i32>,
    pub(super) weights: Vec<f32>,
    pub(super) slots: Vec<i32>,
    /// `[num_experts + 1]`
    pub(super) offsets: Vec<i32>,
}

impl HostRouting {
    /// One segment per expert.
    pub(super) fn new(routed: &RoutedStep, num_experts: usize) -> Self {
        Self::with_segments(routed, num_experts, |expert, _| expert as usize)
    }

    /// `segment(expert, ordinal)`: the segment of the `ordinal`-th pair routed to `expert` this
    /// step (e.g. the physical slot of a placement). A token's computed pairs fill its first
    /// ranks in ascending expert order (the order the combine sums them in, as on the CPU);
    /// segment rows are handed out in token order, every pass of an expert in one segment
    /// (spilled pairs compute the same values as in a later pass).
    pub(super) fn with_segments(
        routed: &RoutedStep,
        num_segments: usize,
        mut segment: impl FnMut(u32, usize) -> usize,
    ) -> Self {
        let k = routed.top_k;
        let n = routed.num_tokens * k;
        let mut h = HostRouting {
            topk_ids: vec![0; n],
            weights: vec![0.0; n],
            slots: vec![-1; n],
            offsets: vec![0; num_segments + 1],
        };
        let mut next_row = vec![0i32; num_segments];
        let mut ordinal = vec![0usize; routed.num_experts()];
        let mut pairs = Vec::with_capacity(k);
        for t in 0..routed.num_tokens {
            pairs.clear();
            pairs.extend_from_slice(routed.token_pairs(t));
            pairs.sort_by_key(|p| p.expert);
            for (j, pair) in pairs.iter().enumerate() {
                let nth = &mut ordinal[pair.expert as usize];
                let s = segment(pair.expert, *nth);
                *nth += 1;
                h.topk_ids[t * k + j] = s as i32;
                h.weights[t * k + j] = pair.weight;
                h.slots[t * k + j] = next_row[s];
                next_row[s] += 1;
            }
        }
        for (e, rows) in next_row.iter().enumerate() {
            h.offsets[e + 1] = h.offsets[e] + rows;
        }
        h
    }
}

/// A dropless layer's routing summary from the segment offsets and the router's choices.
pub(super) fn dropless_routing(
    offsets: &[usize],
    topk_ids: Vec<i32>,
    top_k: usize,
) -> LayerRouting {
    let expert_load: Vec<u32> = offsets.windows(2).map(|w| (w[1] - w[0]) as u32).collect();
    LayerRouting {
        counts: RoutingCounts {
            pairs: topk_ids.len() as u64,
            ..RoutingCounts::default()
        },
        expert_load,
        top_k,
        chosen_experts: topk_ids.into_iter().map(|e| e as u32).collect(),
        ..LayerRouting::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SequenceSlice;
    use crate::moe::{Capacity, RouterConfig, route};

    #[test]
    fn step_inputs_index_tokens_by_sequence_position_and_slot() {
        // A 3-token prefill (blocks 4, 5 of size 2) and a decode at position 4 (blocks 0, 2, 7).
        let seqs = [
            SequenceSlice {
                query_start: 0,
                query_len: 3,
                context_len: 3,
                block_table: &[4, 5],
            },
            SequenceSlice {
                query_start: 3,
                query_len: 1,
                context_len: 5,
                block_table: &[0, 2, 7],
            },
        ];
        let batch = ForwardBatch {
            token_ids: &[10, 11, 12, 13],
            sequences: &seqs,
        };
        let limits = BatchLimits {
            vocab_size: 100,
            max_position_embeddings: 64,
            block_size: 2,
            num_blocks: 8,
        };
        let x = step_inputs(&batch, &limits, LogitsFor::LastTokens).unwrap();
        assert_eq!(x.positions, [0, 1, 2, 4]);
        assert_eq!(x.token_seq, [0, 0, 0, 1]);
        assert_eq!(x.slots, [8, 9, 10, 14]);
        assert_eq!(x.max_blocks, 3);
        assert_eq!(x.block_tables, [4, 5, 0, 0, 2, 7]);
        assert_eq!(x.logit_rows, [2, 3]);
        let all = step_inputs(&batch, &limits, LogitsFor::AllTokens).unwrap();
        assert_eq!(all.logit_rows, [0, 1, 2, 3]);
        // A block outside the cache is refused before anything reaches the device.
        let limits = BatchLimits {
            num_blocks: 7,
            ..limits
        };
        assert!(step_inputs(&batch, &limits, LogitsFor::LastTokens).is_err());
    }

    #[test]
    fn host_routing_lays_out_every_computed_pair_once_in_its_experts_segment() {
        use crate::moe::OverflowPolicy;
        // 40 tokens over 6 experts, skewed towards expert 0, top-2, capacity factor 1.
        let logits: Vec<f32> = (0..40 * 6)
            .map(|i| ((i * 7919) % 13) as f32 * 0.3 - if i % 6 == 0 { 0.0 } else { 1.0 })
            .collect();
        for overflow in [
            OverflowPolicy::Drop,
            OverflowPolicy::Reroute,
            OverflowPolicy::Spill,
        ] {
            let config = RouterConfig {
                top_k: 2,
                capacity: Capacity::Factor {
                    alpha: 1.0,
                    overflow,
                },
                renormalize: true,
                scoring: Default::default(),
                scale: 1.0,
            };
            let routed = route(&logits, 6, &config);
            let h = HostRouting::new(&routed, 6);
            assert_eq!(h.offsets[6] as usize, routed.pairs.len(), "{overflow}");
            let mut seen = vec![Vec::new(); 6];
            for t in 0..routed.num_tokens {
                let mut pairs = routed.token_pairs(t).to_vec();
                pairs.sort_by_key(|p| p.expert);
                for j in 0..2 {
                    let at = t * 2 + j;
                    match pairs.get(j) {
                        Some(p) => {
                            assert_eq!(h.topk_ids[at], p.expert as i32);
                            assert_eq!(h.weights[at], p.weight);
                            seen[p.expert as usize].push(h.slots[at]);
                        }
                        None => assert_eq!(h.slots[at], -1, "{overflow}: token {t} rank {j}"),
                    }
                }
            }
            for (e, rows) in seen.iter().enumerate() {
                let want: Vec<i32> = (0..rows.len() as i32).collect();
                assert_eq!(*rows, want, "{overflow}: expert {e}'s rows in token order");
                assert_eq!(h.offsets[e + 1] - h.offsets[e], rows.len() as i32);
                assert_eq!(routed.expert_load[e] as usize, rows.len(), "{overflow}");
            }
            if overflow == OverflowPolicy::Drop {
                assert!(routed.counts.dropped > 0, "the case must drop something");
            }
        }
    }

    #[test]
    fn greedy_rows_go_last_and_the_rest_keep_their_order() {
        let (order, sampled) = greedy_order(&[true, false, true, false, false]);
        assert_eq!(order, [1, 3, 4, 0, 2]);
        assert_eq!(sampled, 3);
        assert_eq!(greedy_order(&[false, false]), (vec![0, 1], 2));
        assert_eq!(greedy_order(&[true]), (vec![0], 0));
    }

    /// Every family's dropless router runs on the device, within the kernel's limits; a
    /// capacity, expert parallelism or a router past those limits routes on the host.
    #[test]
    fn dropless_routers_within_the_kernels_limits_route_on_the_device() {
        use crate::models::cuda::plan::tests::config;
        use moeserve_formats::presets::Preset;
        for preset in [
            Preset::Mixtral8x7b2l,
            Preset::Qwen3Moe30bA3b2l,
            Preset::DeepseekV2Lite2l,
            Preset::DeepseekV32l,
            Preset::GptOss20b2l,
        ] {
            let c = config(preset, 2);
            assert!(
                routes_on_device(&c, Capacity::Dropless, false),
                "{preset:?}"
            );
            assert!(
                !routes_on_device(&c, Capacity::Dropless, true),
                "{preset:?}, EP"
            );
            let capacity = Capacity::from_factor(Some(1.0), crate::moe::OverflowPolicy::Drop);
            assert!(
                !routes_on_device(&c, capacity, false),
                "{preset:?}, capacity"
            );
        }
        // Kimi-K2's 384 experts are more than the kernel's 256 (8 per lane of a warp).
        let mut kimi = config(Preset::DeepseekV32l, 2);
        kimi.num_local_experts = 384;
        assert!(!routes_on_device(&kimi, Capacity::Dropless, false));
    }

    #[test]
    fn dropless_routing_counts_each_experts_pairs() {
        let r = dropless_routing(&[0, 2, 2, 5], vec![0, 2, 2, 0, 2], 1);
        assert_eq!(r.expert_load, [2, 0, 3]);
        assert_eq!(r.counts.pairs, 5);
        assert_eq!(r.counts.dropped, 0);
        assert_eq!(r.chosen_experts, [0, 2, 2, 0, 2]);
    }
}
