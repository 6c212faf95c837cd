//! Paged KV storage: keys and values of every layer in fixed-size blocks, addressed by slot.
//!
//! A *slot* is `block_id * block_size + offset`; a sequence's block table maps its positions to
//! blocks (position `p` lives in block `table[p / block_size]` at offset `p % block_size`). Which
//! blocks belong to whom is the engine's business (block pool, prefix cache); this type only
//! stores rows. Rows are kept in f32 by default, so cached attention equals recomputation
//! exactly; a bf16 cache ([`KvDtype::Bf16`], `--kv-cache-dtype bfloat16`) holds twice the
//! tokens in the same memory and reads half the bytes per decode step, its rows rounded once
//! when written (attention widens them back as it loads them).
//!
//! ```text
//! k: [num_layers][num_blocks][kv_heads][block_size][key_dim / kv_heads]
//! v: [num_layers][num_blocks][kv_heads][block_size][value_dim / kv_heads]   (or none)
//! ```
//!
//! Within a block each KV head's rows lie together, as vLLM's caches keep them: attention
//! reads one head's rows for a sequence, a block's worth (4 KiB of f32 at 16 tokens of 64)
//! in one run instead of a few hundred bytes out of every cache row. A head's rows are then
//! addressed by *head rows* ([`KvCacheLayout::head_row`]): row `head_row(slot, h)` of a layer's
//! `[num_slots · kv_heads, key_dim / kv_heads]` rows is head `h` of `slot`.
//!
//! Multi-head latent attention (DeepSeek-V2/V3) caches one compressed row per token and layer,
//! `[kv_lora_rank | qk_rope_head_dim]`, whatever the number of heads: it is every head's key,
//! and its latent part every head's value, so there is no separate value row (`value_dim` 0).

use half::bf16;

use crate::config::ModelConfig;

/// The element type of a CPU cache's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
}

impl KvDtype {
    /// What a CPU cache holds for `--kv-cache-dtype`: `auto` is f32, the activations' type, so
    /// a cached row is exactly what recomputing it gives.
    pub fn on_cpu(asked: moeserve_core::KvCacheDtype) -> Self {
        use moeserve_core::KvCacheDtype;
        match asked {
            KvCacheDtype::Auto | KvCacheDtype::Float32 => KvDtype::F32,
            KvCacheDtype::Bfloat16 => KvDtype::Bf16,
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "float32",
            KvDtype::Bf16 => "bfloat16",
        }
    }
}

/// One layer's key and value rows in their stored element type (see [`PagedKvCache::layer_rows`]).
#[derive(Clone, Copy)]
pub enum LayerRows<'a> {
    F32(&'a [f32], &'a [f32]),
    Bf16(&'a [bf16], &'a [bf16]),
}

impl<'a> LayerRows<'a> {
    /// The key rows read as the values too (multi-head latent attention: a head's value is
    /// the leading part of the latent row that is its key).
    pub fn keys_as_values(self) -> Self {
        match self {
            LayerRows::F32(keys, _) => LayerRows::F32(keys, keys),
            LayerRows::Bf16(keys, _) => LayerRows::Bf16(keys, keys),
        }
    }
}

/// Keys or values of every layer, in the cache's element type.
enum Rows {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Rows {
    fn zeros(dtype: KvDtype, len: usize) -> Self {
        match dtype {
            KvDtype::F32 => Rows::F32(vec![0.0; len]),
            KvDtype::Bf16 => Rows::Bf16(vec![bf16::ZERO; len]),
        }
    }

    fn write(&mut self, at: usize, row: &[f32]) {
        match self {
            Rows::F32(v) => v[at..at + row.len()].copy_from_slice(row),
            Rows::Bf16(v) => v[at..at + row.len()]
                .iter_mut()
                .zip(row)
                .for_each(|(d, x)| *d = bf16::from_f32(*x)),
        }
    }

    fn read(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        match self {
            Rows::F32(v) => v[range].to_vec(),
            Rows::Bf16(v) => v[range].iter().map(|x| x.to_f32()).collect(),
        }
    }

    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            Rows::F32(v) => v.copy_within(src, dst),
            Rows::Bf16(v) => v.copy_within(src, dst),
        }
    }
}

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
    /// The heads a key (and value) row is made of (`num_key_value_heads`; 1 for MLA's latent
    /// row), each stored with its block's other rows of that head.
    pub kv_heads: usize,
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
            kv_heads: config.kv_cache_heads(),
        }
    }

    /// The row of head `head` of `slot` among a layer's head rows (see the module note): the
    /// head's rows of one block are consecutive.
    pub fn head_row(&self, slot: usize, head: usize) -> usize {
        let (block, offset) = (slot / self.block_size, slot % self.block_size);
        (block * self.kv_heads + head) * self.block_size + offset
    }

    /// Appends to `rows` head `head`'s rows (see [`Self::head_row`]) of `positions` of a
    /// sequence whose blocks are `block_table`: one run per block, no division per position
    /// (attention builds these lists for every head, layer and step).
    pub fn extend_head_rows(
        &self,
        block_table: &[u32],
        positions: std::ops::RangeInclusive<usize>,
        head: usize,
        rows: &mut Vec<usize>,
    ) {
        let bs = self.block_size;
        let (mut p, last) = (*positions.start(), *positions.end());
        while p <= last {
            let (block, offset) = (p / bs, p % bs);
            let run = (bs - offset).min(last + 1 - p);
            let start = (block_table[block] as usize * self.kv_heads + head) * bs + offset;
            rows.extend(start..start + run);
            p += run;
        }
    }

    /// Bytes one token occupies across all layers (keys and values) in an f32 cache.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_in(std::mem::size_of::<f32>())
    }

    /// The same with elements of `element_bytes` (a bf16 CPU cache; a GPU cache holds the
    /// weights' dtype).
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
    k: Rows,
    v: Rows,
}

impl PagedKvCache {
    /// An f32 cache.
    pub fn new(layout: KvCacheLayout) -> Self {
        Self::with_dtype(layout, KvDtype::F32)
    }

    pub fn with_dtype(layout: KvCacheLayout, dtype: KvDtype) -> Self {
        let h = layout.kv_heads;
        assert!(
            h > 0 && layout.key_dim.is_multiple_of(h) && layout.value_dim.is_multiple_of(h),
            "KV rows of {} and {} values do not split into {h} heads",
            layout.key_dim,
            layout.value_dim
        );
        let rows = layout.num_layers * layout.num_slots();
        PagedKvCache {
            layout,
            k: Rows::zeros(dtype, rows * layout.key_dim),
            v: Rows::zeros(dtype, rows * layout.value_dim),
        }
    }

    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    /// `layer`'s first token row plus `slot` (a block's rows, every head of them, start where
    /// its first slot's would: heads are ordered within blocks).
    fn row(&self, layer: usize, slot: usize) -> usize {
        debug_assert!(layer < self.layout.num_layers && slot < self.layout.num_slots());
        layer * self.layout.num_slots() + slot
    }

    /// Where head `head` of `slot` in `layer` starts among rows `width` wide (a whole key or
    /// value row).
    fn head_start(&self, layer: usize, slot: usize, head: usize, width: usize) -> usize {
        let h = self.layout.kv_heads;
        let layer_start = self.row(layer, 0) * width;
        layer_start + self.layout.head_row(slot, head) * (width / h)
    }

    /// Stores one token's key and value rows (`key_dim` and `value_dim` wide) at `slot` of
    /// `layer`, rounded to the cache's element type, each head with its block's rows of it.
    pub fn write(&mut self, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let (dk, dv, h) = (
            self.layout.key_dim,
            self.layout.value_dim,
            self.layout.kv_heads,
        );
        assert!(key.len() == dk && value.len() == dv, "KV row widths");
        for (head, part) in key.chunks_exact(dk / h).enumerate() {
            let at = self.head_start(layer, slot, head, dk);
            self.k.write(at, part);
        }
        if dv > 0 {
            for (head, part) in value.chunks_exact(dv / h).enumerate() {
                let at = self.head_start(layer, slot, head, dv);
                self.v.write(at, part);
            }
        }
    }

    /// The key row at `slot` of `layer`, its heads gathered and widened to f32.
    pub fn key(&self, layer: usize, slot: usize) -> Vec<f32> {
        self.gather(&self.k, layer, slot, self.layout.key_dim)
    }

    /// The value row at `slot` of `layer`, its heads gathered and widened to f32.
    pub fn value(&self, layer: usize, slot: usize) -> Vec<f32> {
        self.gather(&self.v, layer, slot, self.layout.value_dim)
    }

    fn gather(&self, rows: &Rows, layer: usize, slot: usize, width: usize) -> Vec<f32> {
        let part = width / self.layout.kv_heads;
        (0..self.layout.kv_heads)
            .flat_map(|head| {
                let at = self.head_start(layer, slot, head, width);
                rows.read(at..at + part)
            })
            .collect()
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

    /// All key and value rows of `layer`, `num_slots · key_dim` and `num_slots · value_dim`
    /// elements: head rows (`[num_slots · kv_heads, key_dim / kv_heads]`, addressed by
    /// [`KvCacheLayout::head_row`]).
    pub fn layer_rows(&self, layer: usize) -> LayerRows<'_> {
        let (r, n) = (self.row(layer, 0), self.layout.num_slots());
        let (k, v) = (
            r * self.layout.key_dim..(r + n) * self.layout.key_dim,
            r * self.layout.value_dim..(r + n) * self.layout.value_dim,
        );
        match (&self.k, &self.v) {
            (Rows::F32(keys), Rows::F32(values)) => LayerRows::F32(&keys[k], &values[v]),
            (Rows::Bf16(keys), Rows::Bf16(values)) => LayerRows::Bf16(&keys[k], &values[v]),
            _ => unreachable!("keys and values share the cache's element type"),
        }
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
            kv_heads: 1,
        };
        let mut cache = PagedKvCache::new(layout);
        cache.write(1, 5, &[1.0, 2.0], &[3.0, 4.0]);
        assert_eq!(cache.key(1, 5), [1.0, 2.0]);
        assert_eq!(cache.value(1, 5), [3.0, 4.0]);
        assert_eq!(cache.key(0, 5), [0.0, 0.0]);
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
            kv_heads: 1,
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
                assert_eq!(cache.key(layer, dst), [x(src), -x(src)]);
                assert_eq!(cache.value(layer, dst), [x(src) + 0.5]);
            }
        }
    }

    /// Each KV head's rows of a block lie together: head `h` of every slot of a block is one
    /// run of `block_size` rows, found by `head_row`; whole rows read back as written, and a
    /// block copy moves every head of it.
    #[test]
    fn a_blocks_rows_of_one_head_lie_together() {
        let layout = KvCacheLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 4,
            key_dim: 6,
            value_dim: 6,
            kv_heads: 3,
        };
        let mut cache = PagedKvCache::new(layout);
        let row = |layer: usize, slot: usize, sign: f32| -> Vec<f32> {
            (0..6)
                .map(|i| sign * (100 * layer + 10 * slot + i) as f32)
                .collect()
        };
        for layer in 0..2 {
            for slot in 0..12 {
                cache.write(layer, slot, &row(layer, slot, 1.0), &row(layer, slot, -1.0));
            }
        }
        for layer in 0..2 {
            let LayerRows::F32(keys, values) = cache.layer_rows(layer) else {
                panic!("an f32 cache")
            };
            for slot in 0..12 {
                assert_eq!(cache.key(layer, slot), row(layer, slot, 1.0));
                assert_eq!(cache.value(layer, slot), row(layer, slot, -1.0));
                for head in 0..3 {
                    let r = layout.head_row(slot, head);
                    assert_eq!(
                        keys[r * 2..r * 2 + 2],
                        row(layer, slot, 1.0)[head * 2..][..2]
                    );
                    assert_eq!(
                        values[r * 2..r * 2 + 2],
                        row(layer, slot, -1.0)[head * 2..][..2]
                    );
                }
            }
            // Head 1 of block 2: slots 8..12, consecutive rows.
            let run: Vec<usize> = (8..12).map(|slot| layout.head_row(slot, 1)).collect();
            assert_eq!(run, [28, 29, 30, 31]);
            // A sequence's rows by its block table, a block's run at a time: the rows of its
            // slots one by one, from any first to any last position.
            let table = [2, 0, 1];
            for (first, last, head) in [(0, 11, 0), (3, 9, 2), (5, 5, 1), (4, 7, 1)] {
                let mut rows = Vec::new();
                layout.extend_head_rows(&table, first..=last, head, &mut rows);
                let want: Vec<usize> = (first..=last)
                    .map(|p| layout.head_row(slot_of(&table, 4, p), head))
                    .collect();
                assert_eq!(rows, want, "positions {first}..={last}, head {head}");
            }
        }
        cache.copy_block(2, 0);
        for layer in 0..2 {
            for (dst, src) in [(0, 8), (1, 9), (2, 10), (3, 11), (4, 4)] {
                assert_eq!(cache.key(layer, dst), row(layer, src, 1.0));
                assert_eq!(cache.value(layer, dst), row(layer, src, -1.0));
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
            kv_heads: 1,
        };
        let mut cache = PagedKvCache::new(layout);
        cache.write(1, 7, &[1.0, 2.0, 3.0, 4.0, 5.0], &[]);
        assert_eq!(cache.key(1, 7), [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(cache.value(1, 7).is_empty());
        let LayerRows::F32(keys, _) = cache.layer_rows(1) else {
            panic!("an f32 cache")
        };
        assert_eq!(keys.len(), 12 * 5);
        assert_eq!(layout.bytes_per_token(), 2 * 5 * 4);
    }

    #[test]
    fn a_bf16_cache_rounds_rows_once_and_copies_them_whole() {
        let layout = KvCacheLayout {
            num_layers: 2,
            num_blocks: 3,
            block_size: 2,
            key_dim: 3,
            value_dim: 3,
            kv_heads: 1,
        };
        let mut cache = PagedKvCache::with_dtype(layout, KvDtype::Bf16);
        let key = [1.0, 1.0 + 1.0 / 256.0, -2.7182817];
        cache.write(1, 4, &key, &[0.5, 0.25, 1e-3]);
        let rounded: Vec<f32> = key.iter().map(|x| bf16::from_f32(*x).to_f32()).collect();
        assert_eq!(cache.key(1, 4), rounded);
        assert_ne!(cache.key(1, 4), key, "rows are stored in bf16");
        cache.copy_block(2, 0);
        assert_eq!(cache.key(1, 0), rounded);
        let LayerRows::Bf16(keys, values) = cache.layer_rows(1) else {
            panic!("a bf16 cache")
        };
        assert_eq!((keys.len(), values.len()), (6 * 3, 6 * 3));
        assert_eq!(
            layout.bytes_per_token_in(KvDtype::Bf16.size_in_bytes()),
            2 * 6 * 2
        );
    }
}
