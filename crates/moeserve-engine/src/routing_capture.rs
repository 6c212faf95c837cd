//! One request's routed experts (`return_routed_experts`), captured step by step by position.

use std::ops::Range;

use moeserve_model::moe::MoeStepRecord;

use crate::request::RoutedExperts;

/// One request's routed experts, kept by position (a recomputed position overwrites itself).
#[derive(Clone)]
pub(crate) struct RoutingCapture {
    /// The first position kept: 0 with the prompt, else the last prompt position.
    pub(crate) first: usize,
    /// Values per position: MoE layers × top_k.
    pub(crate) stride: usize,
    pub(crate) top_k: usize,
    /// `[position - first][layer][k]`, flat.
    pub(crate) flat: Vec<u32>,
}

impl RoutingCapture {
    /// Copies the step's routing of positions `positions` (step rows from `row`).
    pub(crate) fn record(&mut self, record: &MoeStepRecord, row: usize, positions: Range<usize>) {
        for (i, position) in positions.enumerate() {
            let Some(at) = position.checked_sub(self.first) else {
                continue;
            };
            let end = (at + 1) * self.stride;
            if self.flat.len() < end {
                self.flat.resize(end, 0);
            }
            let k = self.top_k;
            for (l, layer) in record
                .layers
                .iter()
                .enumerate()
                .take(self.stride / k.max(1))
            {
                // A backend that recorded no choices leaves zeros rather than failing the step.
                let Some(chosen) = layer.chosen_experts.get((row + i) * k..(row + i + 1) * k)
                else {
                    continue;
                };
                let start = at * self.stride + l * k;
                self.flat[start..start + k].copy_from_slice(chosen);
            }
        }
    }

    /// `[layer][k]` at `position`.
    pub(crate) fn at(&self, position: usize) -> Vec<Vec<u32>> {
        let at = position.saturating_sub(self.first);
        self.flat
            .get(at * self.stride..(at + 1) * self.stride)
            .unwrap_or_default()
            .chunks(self.top_k.max(1))
            .map(<[u32]>::to_vec)
            .collect()
    }

    /// The whole request's: the prompt's positions (when kept) and one per generated token.
    pub(crate) fn finish(&self, prompt_len: usize, num_generated: usize) -> RoutedExperts {
        let last_prompt = prompt_len - 1;
        RoutedExperts {
            prompt: (self.first == 0).then(|| (0..last_prompt).map(|p| self.at(p)).collect()),
            generated: (0..num_generated)
                .map(|i| self.at(last_prompt + i))
                .collect(),
        }
    }
}
