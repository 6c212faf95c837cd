//! The input of one forward pass: the step's tokens of many sequences, concatenated (varlen).
//!
//! ```text
//! token_ids:  [ s0 t0 t1 t2 | s1 t0 | s2 t0 t1 ]      one row per scheduled token
//! sequences:  s0 {query_start 0, query_len 3, context_len 3, block_table [..]}   (prefill)
//!             s1 {query_start 3, query_len 1, context_len 9, ...}                (decode)
//! ```
//! A sequence's step tokens sit at positions `context_len - query_len .. context_len`; its
//! earlier tokens are already in the KV cache under the same block table.

use crate::{ModelError, Result};

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug)]
pub struct SequenceSlice<'a> {
    /// Index of the sequence's first step token in `ForwardBatch::token_ids`.
    pub query_start: usize,
    /// Number of tokens this step computes for the sequence.
    pub query_len: usize,
    /// Tokens in the KV cache once this step has written its own.
    pub context_len: usize,
    /// Block ids holding positions `0..context_len`, `block_size` positions per block.
    pub block_table: &'a [u32],
}

impl SequenceSlice<'_> {
    pub fn first_position(&self) -> usize {
        self.context_len - self.query_len
    }
}

/// All tokens of one step.
#[derive(Clone, Copy, Debug)]
pub struct ForwardBatch<'a> {
    pub token_ids: &'a [u32],
    pub sequences: &'a [SequenceSlice<'a>],
}

/// Where each step token belongs: its sequence and absolute position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenPlace {
    pub sequence: usize,
    pub position: usize,
}

impl ForwardBatch<'_> {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Checks the batch against the model and cache limits and lists every token's place.
    pub fn places(&self, limits: &BatchLimits) -> Result<Vec<TokenPlace>> {
        let mut places = Vec::with_capacity(self.token_ids.len());
        self.places_into(limits, &mut places)?;
        Ok(places)
    }

    /// [`ForwardBatch::places`] into `places` (cleared first; a forward's workspace).
    pub fn places_into(&self, limits: &BatchLimits, places: &mut Vec<TokenPlace>) -> Result<()> {
        let bad = |message: String| Err(ModelError::InvalidInput { message });
        places.clear();
        for (s, seq) in self.sequences.iter().enumerate() {
            if seq.query_start != places.len()
                || seq.query_len == 0
                || seq.query_len > seq.context_len
            {
                return bad(format!(
                    "sequence {s}: query range does not follow the previous sequence"
                ));
            }
            if seq.context_len > limits.max_position_embeddings {
                return bad(format!(
                    "sequence {s}: {} tokens exceed the model's context of {}",
                    seq.context_len, limits.max_position_embeddings
                ));
            }
            if seq.block_table.len() * limits.block_size < seq.context_len {
                return bad(format!(
                    "sequence {s}: block table too short for {} tokens",
                    seq.context_len
                ));
            }
            if let Some(b) = seq
                .block_table
                .iter()
                .find(|b| **b as usize >= limits.num_blocks)
            {
                return bad(format!("sequence {s}: block id {b} is outside the cache"));
            }
            places.extend((0..seq.query_len).map(|i| TokenPlace {
                sequence: s,
                position: seq.first_position() + i,
            }));
        }
        if places.len() != self.token_ids.len() {
            return bad(format!(
                "{} tokens given, sequences cover {}",
                self.token_ids.len(),
                places.len()
            ));
        }
        if let Some(t) = self
            .token_ids
            .iter()
            .find(|t| **t as usize >= limits.vocab_size)
        {
            return bad(format!(
                "token id {t} is out of the vocabulary (size {})",
                limits.vocab_size
            ));
        }
        Ok(())
    }
}

/// Model and cache sizes a batch must respect.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: BatchLimits = BatchLimits {
        vocab_size: 10,
        max_position_embeddings: 64,
        block_size: 4,
        num_blocks: 8,
    };

    #[test]
    fn places_follow_context_lengths() {
        let seqs = [
            SequenceSlice {
                query_start: 0,
                query_len: 2,
                context_len: 2,
                block_table: &[0],
            },
            SequenceSlice {
                query_start: 2,
                query_len: 1,
                context_len: 6,
                block_table: &[1, 2],
            },
        ];
        let batch = ForwardBatch {
            token_ids: &[1, 2, 3],
            sequences: &seqs,
        };
        let places = batch.places(&LIMITS).unwrap();
        assert_eq!(
            places[2],
            TokenPlace {
                sequence: 1,
                position: 5
            }
        );
    }

    #[test]
    fn out_of_vocabulary_token_is_refused() {
        let seqs = [SequenceSlice {
            query_start: 0,
            query_len: 1,
            context_len: 1,
            block_table: &[0],
        }];
        let batch = ForwardBatch {
            token_ids: &[10],
            sequences: &seqs,
        };
        let msg = batch.places(&LIMITS).unwrap_err().to_string();
        assert!(
            msg.contains("token id 10 is out of the vocabulary"),
            "{msg}"
        );
    }

    #[test]
    fn short_block_table_is_refused() {
        let seqs = [SequenceSlice {
            query_start: 0,
            query_len: 1,
            context_len: 5,
            block_table: &[0],
        }];
        let batch = ForwardBatch {
            token_ids: &[1],
            sequences: &seqs,
        };
        assert!(batch.places(&LIMITS).is_err());
    }
}
