//! Steps of three sequences through one warm workspace, counting heap allocations (the
//! alloc-free tests: `alloc_free.rs`, `alloc_free_int8.rs`, each its own process).

use moeserve_core::alloc_count::allocations_in;
use moeserve_model::batch::{ForwardBatch, SequenceSlice};
use moeserve_model::kv_cache::PagedKvCache;
use moeserve_model::models::{ForwardOptions, ForwardWorkspace, MoeModel};
use moeserve_model::moe::{Capacity, MoeOptions, MoeStepRecord, OverflowPolicy};

use super::common::fixtures_dir;

const BLOCK_SIZE: usize = 4;
const MAX_CONTEXT: usize = 40;
/// The largest step below: a 6-token prompt chunk beside two decodes.
const MAX_STEP_TOKENS: usize = 8;

/// Three sequences over one cache, stepped through one workspace.
struct Steps<'m> {
    model: &'m MoeModel,
    cache: PagedKvCache,
    tables: Vec<Vec<u32>>,
    /// Tokens each sequence has in the cache.
    context: Vec<usize>,
    ws: ForwardWorkspace,
    record: MoeStepRecord,
    capacity: Capacity,
}

impl Steps<'_> {
    /// One step computing `new[s]` tokens of sequence `s` (0 = not scheduled).
    fn step(&mut self, new: &[usize]) {
        let mut slices = [SequenceSlice {
            query_start: 0,
            query_len: 0,
            context_len: 0,
            block_table: &[],
        }; 3];
        let mut used = 0;
        let mut start = 0;
        for (s, &n) in new.iter().enumerate().filter(|(_, n)| **n > 0) {
            self.context[s] += n;
            slices[used] = SequenceSlice {
                query_start: start,
                query_len: n,
                context_len: self.context[s],
                block_table: &self.tables[s],
            };
            used += 1;
            start += n;
        }
        const IDS: [u32; MAX_STEP_TOKENS] = [3, 5, 7, 11, 13, 17, 19, 23];
        let batch = ForwardBatch {
            token_ids: &IDS[..start],
            sequences: &slices[..used],
        };
        self.record.clear();
        let opts = ForwardOptions {
            moe: MoeOptions {
                capacity: self.capacity,
                experts: None,
                record: Some(&mut self.record),
            },
            ..ForwardOptions::default()
        };
        let logits = self
            .model
            .forward_in(&batch, &mut self.cache, opts, &mut self.ws);
        assert_eq!(logits.unwrap().len(), used * self.model.config().vocab_size);
    }
}

/// [`steps_allocate_nothing`] on one model per family option: plain GQA, q/k norms per head
/// with a dense layer, q/k/v biases with a shared expert, flat q/k norms with clipping, fused
/// expert tensors, the sigmoid router with groups and partial rotary, and GPTQ (act-order:
/// every int4 matrix gathers its activations in its own order) and AWQ int4 weights.
///
/// The steps run on a pool thread: a forward started from outside the pool injects one job
/// into rayon's queue, whose lock-free blocks (crossbeam's `Injector`) are allocated every 63
/// jobs — rayon's amortised cost, not the forward's, which 40 steps of these models would hit.
pub fn every_family_allocates_nothing() {
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    for case in [
        "mixtral-gqa",
        "qwen3-moe",
        "qwen2-moe",
        "olmoe",
        "qwen3-moe-fused",
        "glm4-moe",
        "deepseek-v2",
        "deepseek-v3",
        "qwen3-moe-gptq",
        "qwen2-moe-awq",
    ] {
        pool.install(|| steps_allocate_nothing(case));
    }
}

/// Asserts that four steps of fixture `case` after two warm-up steps allocate nothing, dropless
/// and with a capacity factor that spills.
fn steps_allocate_nothing(case: &str) {
    let model = MoeModel::load(&fixtures_dir().join(case)).unwrap();
    model.reserve_task_scratch(MAX_STEP_TOKENS, MAX_CONTEXT);
    let blocks = MAX_CONTEXT / BLOCK_SIZE;
    let spill = Capacity::Factor {
        alpha: 0.5,
        overflow: OverflowPolicy::Spill,
    };
    for capacity in [Capacity::Dropless, spill] {
        let mut steps = Steps {
            model: &model,
            cache: PagedKvCache::new(model.kv_layout(3 * blocks, BLOCK_SIZE)),
            tables: (0..3)
                .map(|s| (s * blocks..(s + 1) * blocks).map(|b| b as u32).collect())
                .collect(),
            context: vec![0; 3],
            ws: ForwardWorkspace::default(),
            record: MoeStepRecord::default(),
            capacity,
        };
        // Warm-up: the largest step, then prompts for the other two sequences.
        steps.step(&[0, 6, 0]);
        steps.step(&[6, 1, 1]);
        // Decodes, and a prompt chunk joining decodes, as the engine schedules them.
        let n = allocations_in(|| {
            steps.step(&[1, 1, 1]);
            steps.step(&[1, 0, 1]);
            steps.step(&[1, 5, 1]);
            steps.step(&[1, 1, 1]);
        });
        assert_eq!(
            n, 0,
            "{case} {capacity:?}: heap allocations in four steps (MOESERVE_ALLOC_TRACE=1 shows them)"
        );
        assert_eq!(steps.record.layers.len(), model.config().num_moe_layers());
    }
}
