//! Paged KV storage: keys and values of every layer in fixed-size blocks, addressed by slot.
//!
//! A *slot* is `block_id * block_size + offset`; a sequence's block table maps its positions to
//! blocks (position `p` lives in block `table[p / block_size]` at offset `p % block_size`). Which
//! blocks belong to whom is the engine's business (block pool, prefix cache); this type only
//! stores rows. Values are kept in f32 so cached attention equals recomputation exactly.
//!
//! ```text
//! k: [num_layers][num_blocks][block_size][num_kv_heads * head_dim]   (same for v)
//! ```

/// Sizes of a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// `num_key_value_heads * head_dim`.
    pub kv_dim: usize,
}

impl KvCacheLayout {
    /// Bytes one token occupies across all layers (keys and values) in this f32 cache.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_in(std::mem::size_of::<f32>())
    }

    /// The same with elements of `element_bytes` (a GPU cache holds the weights' dtype).
    pub fn bytes_per_token_in(&self, element_bytes: usize) -> usize {
        2 * self.num_layers * self.kv_dim * element_bytes
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
        let len = layout.num_layers * layout.num_slots() * layout.kv_dim;
        PagedKvCache {
            layout,
            k: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    fn offset(&self, layer: usize, slot: usize) -> usize {
        debug_assert!(layer < self.layout.num_layers && slot < self.layout.num_slots());
        (layer * self.layout.num_slots() + slot) * self.layout.kv_dim
    }

    /// Stores one token's key and value rows (`kv_dim` each) at `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let o = self.offset(layer, slot);
        let d = self.layout.kv_dim;
        self.k[o..o + d].copy_from_slice(key);
        self.v[o..o + d].copy_from_slice(value);
    }

    pub fn key(&self, layer: usize, slot: usize) -> &[f32] {
        let o = self.offset(layer, slot);
        &self.k[o..o + self.layout.kv_dim]
    }

    pub fn value(&self, layer: usize, slot: usize) -> &[f32] {
        let o = self.offset(layer, slot);
        &self.v[o..o + self.layout.kv_dim]
    }

    /// All key and value rows of `layer`: `[num_slots, kv_dim]` each.
    pub fn layer_rows(&self, layer: usize) -> (&[f32], &[f32]) {
        let len = self.layout.num_slots() * self.layout.kv_dim;
        let o = self.offset(layer, 0);
        (&self.k[o..o + len], &self.v[o..o + len])
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
            kv_dim: 2,
        };
        let mut cache = PagedKvCache::new(layout);
        cache.write(1, 5, &[1.0, 2.0], &[3.0, 4.0]);
        assert_eq!(cache.key(1, 5), &[1.0, 2.0]);
        assert_eq!(cache.value(1, 5), &[3.0, 4.0]);
        assert_eq!(cache.key(0, 5), &[0.0, 0.0]);
        assert_eq!(layout.bytes_per_token(), 2 * 2 * 2 * 4);
    }

    #[test]
    fn slot_follows_the_block_table() {
        assert_eq!(slot_of(&[7, 2], 4, 0), 28);
        assert_eq!(slot_of(&[7, 2], 4, 5), 9);
    }
}
