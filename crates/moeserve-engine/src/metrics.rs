//! Every metric name moeserve exports, declared once, with its kind, help text and histogram
//! buckets. Names follow vLLM's (`vllm:` becomes `moeserve:`), so dashboards port by swapping the
//! prefix; [`vllm_name`] gives the vLLM name of a series for the compatibility export.
//!
//! Nothing here records values: the server refreshes gauges and counters from
//! [`crate::stats::EngineStats`] (the [`MOE`] series from [`crate::moe::MoeStats`]) before each
//! scrape and observes histograms per request, both through the `metrics` facade with these
//! names.

/// Prefix of every moeserve series.
pub const PREFIX: &str = "moeserve:";
/// Prefix of the same series under vLLM's names (`--metrics-compat vllm`).
pub const VLLM_PREFIX: &str = "vllm:";
/// Label carried by every series: the served model name.
pub const LABEL_MODEL_NAME: &str = "model_name";
/// Label of [`REQUEST_SUCCESS_TOTAL`]: `stop`, `length`, or `abort` for a request that ended
/// early (timed out, disconnected, failed in the engine, cancelled by the shutdown drain).
pub const LABEL_FINISHED_REASON: &str = "finished_reason";
/// Label of [`REQUEST_ERRORS_TOTAL`]: `timeout`, `client_disconnect`, `engine_error`,
/// `shutdown` or `rejected`.
pub const LABEL_CAUSE: &str = "cause";

pub const NUM_REQUESTS_RUNNING: &str = "moeserve:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "moeserve:num_requests_waiting";
pub const KV_CACHE_USAGE_PERC: &str = "moeserve:kv_cache_usage_perc";
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "moeserve:prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "moeserve:prefix_cache_hits_total";
pub const NUM_PREEMPTIONS_TOTAL: &str = "moeserve:num_preemptions_total";
pub const PROMPT_TOKENS_TOTAL: &str = "moeserve:prompt_tokens_total";
pub const GENERATION_TOKENS_TOTAL: &str = "moeserve:generation_tokens_total";
pub const REQUEST_SUCCESS_TOTAL: &str = "moeserve:request_success_total";
pub const REQUEST_ERRORS_TOTAL: &str = "moeserve:request_errors_total";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "moeserve:time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "moeserve:time_per_output_token_seconds";
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "moeserve:inter_token_latency_seconds";
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "moeserve:e2e_request_latency_seconds";
pub const REQUEST_QUEUE_TIME_SECONDS: &str = "moeserve:request_queue_time_seconds";
pub const REQUEST_PREFILL_TIME_SECONDS: &str = "moeserve:request_prefill_time_seconds";
pub const REQUEST_DECODE_TIME_SECONDS: &str = "moeserve:request_decode_time_seconds";
pub const REQUEST_PROMPT_TOKENS: &str = "moeserve:request_prompt_tokens";
pub const REQUEST_GENERATION_TOKENS: &str = "moeserve:request_generation_tokens";

/// Labels of the MoE series ([`MOE`]): layer index, logical expert index, device index.
pub const LABEL_LAYER: &str = "layer";
pub const LABEL_EXPERT: &str = "expert";
pub const LABEL_DEVICE: &str = "device";

pub const MOE_PAIRS_TOTAL: &str = "moeserve:moe_pairs_total";
pub const MOE_DROPPED_PAIRS_TOTAL: &str = "moeserve:moe_dropped_pairs_total";
pub const MOE_REROUTED_PAIRS_TOTAL: &str = "moeserve:moe_rerouted_pairs_total";
pub const MOE_SPILLED_PAIRS_TOTAL: &str = "moeserve:moe_spilled_pairs_total";
pub const MOE_SHARED_EXPERT_TOKENS_TOTAL: &str = "moeserve:moe_shared_expert_tokens_total";
pub const MOE_DROPPED_TOKENS_TOTAL: &str = "moeserve:moe_dropped_tokens_total";
pub const MOE_LOAD_IMBALANCE: &str = "moeserve:moe_load_imbalance";
pub const MOE_STEP_IMBALANCE: &str = "moeserve:moe_step_imbalance";
pub const MOE_DEVICE_TOKENS_TOTAL: &str = "moeserve:moe_device_tokens_total";
pub const MOE_DEVICE_EXPERT_SECONDS: &str = "moeserve:moe_device_expert_seconds";
pub const MOE_REBALANCES_TOTAL: &str = "moeserve:moe_rebalances_total";
pub const MOE_REBALANCE_GAIN_RATIO: &str = "moeserve:moe_rebalance_gain_ratio";
pub const MOE_EXPERT_WINDOWED_PAIRS: &str = "moeserve:moe_expert_windowed_pairs";
pub const MOE_EXPERT_TOKENS_TOTAL: &str = "moeserve:moe_expert_tokens_total";

pub const STRUCTURED_OUTPUT_MASKS_TOTAL: &str = "moeserve:structured_output_masks_total";
pub const STRUCTURED_OUTPUT_MASK_SECONDS: &str = "moeserve:structured_output_mask_seconds";
pub const STRUCTURED_OUTPUT_WAIT_SECONDS: &str = "moeserve:structured_output_wait_seconds";

/// vLLM's deprecated name of the KV usage gauge, still read by many dashboards.
pub const VLLM_GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Which bucket boundaries a histogram uses (vLLM's choices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buckets {
    /// Not a histogram.
    None,
    TimeToFirstToken,
    /// Per-token latencies (TPOT, ITL).
    TokenLatency,
    /// Whole-request phases (e2e, queue, prefill, decode).
    RequestLatency,
    /// Token counts: 1-2-5 steps up to the model's context length.
    TokenCount,
}

/// One exported series.
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
    pub buckets: Buckets,
}

const fn def(name: &'static str, kind: MetricKind, help: &'static str) -> MetricDef {
    MetricDef {
        name,
        kind,
        help,
        buckets: Buckets::None,
    }
}

const fn hist(name: &'static str, buckets: Buckets, help: &'static str) -> MetricDef {
    MetricDef {
        name,
        kind: MetricKind::Histogram,
        help,
        buckets,
    }
}

use MetricKind::{Counter, Gauge};

/// Every series, in the order a dashboard would list them.
pub const ALL: &[MetricDef] = &[
    def(
        NUM_REQUESTS_RUNNING,
        Gauge,
        "Number of requests in model execution batches.",
    ),
    def(
        NUM_REQUESTS_WAITING,
        Gauge,
        "Number of requests waiting to be processed.",
    ),
    def(
        KV_CACHE_USAGE_PERC,
        Gauge,
        "KV-cache usage. 1 means 100 percent usage.",
    ),
    def(
        PREFIX_CACHE_QUERIES_TOTAL,
        Counter,
        "Prefix cache queries, in tokens.",
    ),
    def(
        PREFIX_CACHE_HITS_TOTAL,
        Counter,
        "Prefix cache hits, in tokens.",
    ),
    def(
        NUM_PREEMPTIONS_TOTAL,
        Counter,
        "Cumulative number of preemptions.",
    ),
    def(
        PROMPT_TOKENS_TOTAL,
        Counter,
        "Number of prefill tokens processed.",
    ),
    def(
        GENERATION_TOKENS_TOTAL,
        Counter,
        "Number of generation tokens processed.",
    ),
    def(
        REQUEST_SUCCESS_TOTAL,
        Counter,
        "Count of successfully processed requests.",
    ),
    def(
        REQUEST_ERRORS_TOTAL,
        Counter,
        "Requests that did not finish normally, by cause (timeout, client_disconnect, engine_error, shutdown; rejected: refused before running).",
    ),
    hist(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Buckets::TimeToFirstToken,
        "Time to first token in seconds.",
    ),
    hist(
        TIME_PER_OUTPUT_TOKEN_SECONDS,
        Buckets::TokenLatency,
        "Time per output token in seconds.",
    ),
    hist(
        INTER_TOKEN_LATENCY_SECONDS,
        Buckets::TokenLatency,
        "Inter-token latency in seconds.",
    ),
    hist(
        E2E_REQUEST_LATENCY_SECONDS,
        Buckets::RequestLatency,
        "End to end request latency in seconds.",
    ),
    hist(
        REQUEST_QUEUE_TIME_SECONDS,
        Buckets::RequestLatency,
        "Time spent waiting in the queue, in seconds.",
    ),
    hist(
        REQUEST_PREFILL_TIME_SECONDS,
        Buckets::RequestLatency,
        "Time spent in the prefill phase, in seconds.",
    ),
    hist(
        REQUEST_DECODE_TIME_SECONDS,
        Buckets::RequestLatency,
        "Time spent in the decode phase, in seconds.",
    ),
    hist(
        REQUEST_PROMPT_TOKENS,
        Buckets::TokenCount,
        "Number of prefill tokens per request.",
    ),
    hist(
        REQUEST_GENERATION_TOKENS,
        Buckets::TokenCount,
        "Number of generation tokens per request.",
    ),
];

/// The structured-output series, refreshed from [`crate::stats::EngineStats`]: how many token
/// masks were computed, the time they took (on a thread beside the forward) and the part of it
/// steps waited for after their forward had finished. No `vllm:` copies (vLLM has none).
pub const STRUCTURED: &[MetricDef] = &[
    def(
        STRUCTURED_OUTPUT_MASKS_TOTAL,
        Counter,
        "Token masks computed for constrained sequences (one per sequence per step).",
    ),
    def(
        STRUCTURED_OUTPUT_MASK_SECONDS,
        Gauge,
        "Seconds spent computing token masks since start-up, beside the forward (a running \
         total; a gauge because the metrics facade's counters are integers).",
    ),
    def(
        STRUCTURED_OUTPUT_WAIT_SECONDS,
        Gauge,
        "Seconds steps waited for token masks after their forward had finished, since \
         start-up (a running total).",
    ),
];

/// The MoE series, refreshed from [`crate::moe::MoeStats`]. vLLM has no counterpart, so they
/// have no `vllm:` copies. The last two (per layer × expert) are exported only with
/// `--expert-metrics full`.
pub const MOE: &[MetricDef] = &[
    def(
        MOE_PAIRS_TOTAL,
        Counter,
        "(token, expert) pairs the router chose, per MoE layer.",
    ),
    def(
        MOE_DROPPED_PAIRS_TOTAL,
        Counter,
        "Pairs dropped by the expert capacity limit, per MoE layer.",
    ),
    def(
        MOE_REROUTED_PAIRS_TOTAL,
        Counter,
        "Pairs rerouted to a lower-ranked expert with room, per MoE layer.",
    ),
    def(
        MOE_SPILLED_PAIRS_TOTAL,
        Counter,
        "Pairs computed in an extra spill pass, per MoE layer.",
    ),
    def(
        MOE_SHARED_EXPERT_TOKENS_TOTAL,
        Counter,
        "Tokens through the shared expert, per MoE layer (every token; never capacity-limited, not in the pairs).",
    ),
    def(
        MOE_DROPPED_TOKENS_TOTAL,
        Counter,
        "Tokens that lost every expert to the capacity limit, per MoE layer.",
    ),
    def(
        MOE_LOAD_IMBALANCE,
        Gauge,
        "Windowed max / mean device load of a MoE layer (1 is balanced).",
    ),
    def(
        MOE_STEP_IMBALANCE,
        Gauge,
        "Windowed expert imbalance of whole steps: sum of layer maxima over sum of layer means.",
    ),
    def(
        MOE_DEVICE_TOKENS_TOTAL,
        Counter,
        "(token, expert) pairs computed, per device (each pair is one token through one expert).",
    ),
    def(
        MOE_DEVICE_EXPERT_SECONDS,
        Gauge,
        "Seconds spent in expert compute since start-up, per device (a running total; a gauge \
         because the metrics facade's counters are integers).",
    ),
    def(
        MOE_REBALANCES_TOTAL,
        Counter,
        "Online expert re-placements swapped in.",
    ),
    def(
        MOE_REBALANCE_GAIN_RATIO,
        Gauge,
        "Imbalance before / predicted imbalance of the last re-placement.",
    ),
    def(
        MOE_EXPERT_WINDOWED_PAIRS,
        Gauge,
        "Pairs per (layer, expert) over the load window.",
    ),
    def(
        MOE_EXPERT_TOKENS_TOTAL,
        Counter,
        "(token, expert) pairs per (layer, expert) since start-up.",
    ),
];

const TIME_TO_FIRST_TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

impl Buckets {
    /// Upper bounds of the buckets; `max_model_len` bounds the token-count buckets.
    pub fn bounds(self, max_model_len: usize) -> Vec<f64> {
        match self {
            Buckets::None => Vec::new(),
            Buckets::TimeToFirstToken => TIME_TO_FIRST_TOKEN_BUCKETS.to_vec(),
            Buckets::TokenLatency => TOKEN_LATENCY_BUCKETS.to_vec(),
            Buckets::RequestLatency => REQUEST_LATENCY_BUCKETS.to_vec(),
            Buckets::TokenCount => one_two_five_buckets(max_model_len),
        }
    }
}

/// `1, 2, 5, 10, 20, 50, ...` up to `max` (vLLM's `build_1_2_5_buckets`); at least `[1]`.
pub fn one_two_five_buckets(max: usize) -> Vec<f64> {
    let mut bounds = vec![1.0];
    let mut scale = 1usize;
    'outer: loop {
        for step in [2, 5, 10] {
            let Some(value) = scale.checked_mul(step) else {
                break 'outer;
            };
            if value > max {
                break 'outer;
            }
            bounds.push(value as f64);
        }
        scale *= 10;
    }
    bounds
}

/// The vLLM name of a moeserve series: `moeserve:x` → `vllm:x`.
pub fn vllm_name(name: &str) -> String {
    let rest = name.strip_prefix(PREFIX).unwrap_or(name);
    format!("{VLLM_PREFIX}{rest}")
}

/// Registers the help text of every series with the installed `metrics` recorder.
pub fn describe_metrics() {
    for def in ALL.iter().chain(STRUCTURED) {
        describe(def.name.to_string(), def);
    }
}

/// Registers the help text of the vLLM-named copies (for `--metrics-compat vllm`).
pub fn describe_vllm_metrics() {
    for def in ALL {
        describe(vllm_name(def.name), def);
    }
    metrics::describe_gauge!(
        VLLM_GPU_CACHE_USAGE_PERC,
        "GPU KV-cache usage (deprecated name of vllm:kv_cache_usage_perc)."
    );
}

/// Registers the help text of the MoE series.
pub fn describe_moe_metrics() {
    for def in MOE {
        describe(def.name.to_string(), def);
    }
}

fn describe(name: String, def: &MetricDef) {
    match def.kind {
        MetricKind::Counter => metrics::describe_counter!(name, def.help),
        MetricKind::Gauge => metrics::describe_gauge!(name, def.help),
        MetricKind::Histogram => metrics::describe_histogram!(name, def.help),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_prometheus_name(name: &str) -> bool {
        let mut chars = name.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    #[test]
    fn counters_end_in_total_and_latencies_in_seconds() {
        for d in ALL {
            match d.kind {
                MetricKind::Counter => assert!(d.name.ends_with("_total"), "{}", d.name),
                MetricKind::Histogram => assert_ne!(d.buckets, Buckets::None, "{}", d.name),
                MetricKind::Gauge => assert_eq!(d.buckets, Buckets::None),
            }
            if d.buckets == Buckets::RequestLatency || d.buckets == Buckets::TokenLatency {
                assert!(d.name.ends_with("_seconds"), "{}", d.name);
            }
        }
    }

    #[test]
    fn every_name_is_prefixed_unique_and_valid() {
        let mut names: Vec<&str> = ALL
            .iter()
            .chain(MOE)
            .chain(STRUCTURED)
            .map(|d| d.name)
            .collect();
        assert!(
            names
                .iter()
                .all(|n| n.starts_with(PREFIX) && is_prometheus_name(n))
        );
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len() + MOE.len() + STRUCTURED.len());
        for d in MOE.iter().chain(STRUCTURED) {
            assert_ne!(d.kind, MetricKind::Histogram);
            assert_eq!(
                d.kind == MetricKind::Counter,
                d.name.ends_with("_total"),
                "{}",
                d.name
            );
        }
    }

    #[test]
    fn moe_series_carry_the_names_the_issue_gives() {
        let names: Vec<&str> = MOE.iter().map(|d| d.name).collect();
        for name in [
            "moeserve:moe_pairs_total",
            "moeserve:moe_dropped_pairs_total",
            "moeserve:moe_rerouted_pairs_total",
            "moeserve:moe_load_imbalance",
            "moeserve:moe_device_tokens_total",
            "moeserve:moe_rebalances_total",
            "moeserve:moe_rebalance_gain_ratio",
            "moeserve:moe_expert_tokens_total",
        ] {
            assert!(names.contains(&name), "{name} is not declared");
        }
    }

    #[test]
    fn vllm_names_swap_the_prefix() {
        assert_eq!(vllm_name(KV_CACHE_USAGE_PERC), "vllm:kv_cache_usage_perc");
        assert_eq!(
            vllm_name(REQUEST_SUCCESS_TOTAL),
            "vllm:request_success_total"
        );
    }

    #[test]
    fn token_count_buckets_step_one_two_five_up_to_the_limit() {
        assert_eq!(
            one_two_five_buckets(1024),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        assert_eq!(one_two_five_buckets(0), vec![1.0]);
        assert_eq!(Buckets::TokenCount.bounds(10).last(), Some(&10.0));
    }
}
