//! Paged KV storage: keys and values of every layer in fixed-size blocks, addressed by slot.
//!
//! A *slot* is `block_id * block_size + offset`; a sequence's block table maps its positions to
//! blocks (position `p` lives in block `table[p / block_size]` at offset `p % block_size`). Which
//! blocks belong to whom is the engine's business (block pool, prefix cache); this type only
//! stores rows. Values are kept in f32 so cached attention equals recomputation exactly.
//!
//! ```text
//! k: [num_layers][num_blocks][block_size][key_dim]     (grouped-query: num_kv_heads * head_dim)
//! v: [num_layers][num_blocks][block_size][value_dim]   (the same width, or none)
//! ```
//!
//! Multi-head latent attention (DeepSeek-V2/V3) caches one compressed row per token and layer,
//! `[kv_lora_rank | qk_rope_head_dim]`, whatever the number of heads: it is every head's key,
//! and its latent part every head's value, so there is no separate value row (`value_dim` 0).

use crate::config::ModelConfig;

/// Sizes of a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// One token's key row in one layer: `num_key_value_heads * head_dim`, or MLA's latent
    /// `kv_lora_rank + qk_rope_head_dim`.
    pub key_dim: usize,
    /// One token's value row in one layer: `key_dim`, or 0 for MLA (values are read from the
    /// key rows).
    pub value_dim: usize,
}

impl KvCacheLayout {
    /// The layout `config`'s attention caches, with `num_blocks` blocks of `block_size` tokens.
    pub fn for_model(config: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        let (key_dim, value_dim) = config.kv_cache_row();
        KvCacheLayout {
            num_layers: config.num_hidden_layers,
            num_blocks,
            block_size,
            key_dim,
            value_dim,
        }
    }

    /// Bytes one token occupies across all layers (keys and values) in this f32 cache.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_in(std::mem::size_of::<f32>())
    }

    /// The same with elements of `element_bytes` (a GPU cache holds the weights' dtype).
    pub fn bytes_per_token_in(&self, element_bytes: usize) -> usize {
        self.num_layers * (self.key_dim + self.value_dim) * element_bytes
    }

    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// Key and value rows for every slot of every layer.
pub struct PagedKvCache {
    layout: KvCacheLayout,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl PagedKvCache {
    pub fn new(layout: KvCacheLayout) -> Self {
        let rows = layout.num_layers * layout.num_slots();
        PagedKvCache {
            layout,
            k: vec![0.0; rows * layout.key_dim],
            v: vec![0.0; rows * layout.value_dim],
        }
    }

    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    /// The row index of `slot` in `layer`.
    fn row(&self, layer: usize, slot: usize) -> usize {
        debug_assert!(layer < self.layout.num_layers && slot < self.layout.num_slots());
        layer * self.layout.num_slots() + slot
    }

    /// Stores one token's key and value rows (`key_dim` and `value_dim` wide) at `slot` of
    /// `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let r = self.row(layer, slot);
        let (dk, dv) = (self.layout.key_dim, self.layout.value_dim);
        self.k[r * dk..(r + 1) * dk].copy_from_slice(key);
        self.v[r * dv..(r + 1) * dv].copy_from_slice(value);
    }

    pub fn key(&self, layer: usize, slot: usize) -> &[f32] {
        let (r, d) = (self.row(layer, slot), self.layout.key_dim);
        &self.k[r * d..(r + 1) * d]
    }

    pub fn value(&self, layer: usize, slot: usize) -> &[f32] {
        let (r, d) = (self.row(layer, slot), self.layout.value_dim);
        &self.v[r * d..(r + 1) * d]
    }

    /// Copies every layer's rows of block `src` into block `dst` (a forked sequence's own copy
    /// of a shared partial block).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let (bs, n) = (self.layout.block_size, self.layout.num_blocks);
        assert!(src < n && dst < n, "blocks {src} and {dst} of {n}");
        for layer in 0..self.layout.num_layers {
            let (from, to) = (self.row(layer, src * bs), self.row(layer, dst * bs));
            for (rows, d) in [
                (&mut self.k, self.layout.key_dim),
                (&mut self.v, self.layout.value_dim),
            ] {
                rows.copy_within(from * d..(from + bs) * d, to * d);
            }
        }
    }

    /// All key and value rows of `layer`: `[num_slots, key_dim]` and `[num_slots, value_dim]`.
    pub fn layer_rows(&self, layer: usize) -> (&[f32], &[f32]) {
        let (r, n) = (self.row(layer, 0), self.layout.num_slots());
        let (dk, dv) = (self.layout.key_dim, self.layout.value_dim);
        (&self.k[r * dk..(r + n) * dk], &self.v[r * dv..(r + n) * dv])
    }
}

/// Slot of `position` for a sequence with `block_table`.
pub fn slot_of(block_table: &[u32], block_size: usize, position: usize) -> usize {
    block_table[position / block_size] as usize * block_size + position % block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_written_to_a_slot_are_read_back_per_layer() {
        let layout = KvCacheLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 4,
            key_dim: 2,
            value_dim: 2,
        };
        let mut cache = PagedKvCache::new(layout);
        cache.write(1, 5, &[1.0, 2.0], &[3.0, 4.0]);
        assert_eq!(cache.key(1, 5), &[1.0, 2.0]);
        assert_eq!(cache.value(1, 5), &[3.0, 4.0]);
        assert_eq!(cache.key(0, 5), &[0.0, 0.0]);
        assert_eq!(layout.bytes_per_token(), 2 * 2 * 2 * 4);
    }

    #[test]
    fn copying_a_block_copies_its_rows_in_every_layer_and_nothing_else() {
        let layout = KvCacheLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 2,
            key_dim: 2,
            value_dim: 1,
        };
        let mut cache = PagedKvCache::new(layout);
        for layer in 0..2 {
            for slot in 0..6 {
                let x = (layer * 10 + slot) as f32;
                cache.write(layer, slot, &[x, -x], &[x + 0.5]);
            }
        }
        cache.copy_block(2, 0);
        for layer in 0..2 {
            let x = |slot: usize| (layer * 10 + slot) as f32;
            for (dst, src) in [(0, 4), (1, 5), (2, 2), (3, 3), (4, 4), (5, 5)] {
                assert_eq!(cache.key(layer, dst), &[x(src), -x(src)]);
                assert_eq!(cache.value(layer, dst), &[x(src) + 0.5]);
            }
        }
    }

    #[test]
    fn slot_follows_the_block_table() {
        assert_eq!(slot_of(&[7, 2], 4, 0), 28);
        assert_eq!(slot_of(&[7, 2], 4, 5), 9);
    }

    #[test]
    fn a_latent_cache_holds_one_row_per_token_and_no_values() {
        let layout = KvCacheLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 4,
            key_dim: 5,
            value_dim: 0,
        };
        let mut cache = PagedKvCache::new(layout);
        cache.write(1, 7, &[1.0, 2.0, 3.0, 4.0, 5.0], &[]);
        assert_eq!(cache.key(1, 7), &[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(cache.value(1, 7).is_empty());
        assert_eq!(cache.layer_rows(1).0.len(), 12 * 5);
        assert_eq!(layout.bytes_per_token(), 2 * 5 * 4);
    }
}
