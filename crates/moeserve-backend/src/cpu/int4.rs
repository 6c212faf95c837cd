//! 4-bit integer weights with a scale and a zero point per group of input positions, as GPTQ
//! and AWQ checkpoints store them: `w[r][p] = (q[r][p] − zero[g][r]) · scale[g][r]` with
//! `q ∈ 0..16` and `g` the group of position `p` — `p / group_size`, or with GPTQ's act-order
//! (`desc_act`) any group `g_idx[p]`. They stay 4-bit in memory and multiply in integers: the
//! activations are quantized per row and block of 32 positions to 23 bits (`intdot.rs`) and
//! the kernels sum `q · x̂` exactly in i32 with byte dot products — AVX-512 VNNI or AVX-VNNI
//! `vpdpbusd`, or AVX2 `vpmaddwd` — then apply both grids once per block:
//!
//! ```text
//! Σ_{p ∈ block} x_p · w_p ≈ (Σ q·x̂) · (scale · sx) + Σx · offset,   offset = −zero · scale
//! ```
//!
//! `Σx` is the block's exact sum, so the only departure from the dequantised weights' product
//! is the activations' rounding, half a step of `sx = max|x| / (2^22 − 1)` per position: a
//! relative 1.2e-7 of the block's largest activation, f32's own rounding. The integer sum and
//! the f32 epilogue
//! (no FMA) are the same on every kernel, so the three kernels give the same bits, and a row's
//! result does not depend on the batch.
//!
//! Layout. A block must lie in one group, so positions are stored in the kernels' *order*:
//! each group's positions ascending, its run padded with empty slots to whole blocks, groups in
//! turn. With consecutive groups of a multiple of 32 positions (AWQ, GPTQ without act-order)
//! that order is `0..k` itself and no order is kept; otherwise (act-order's scattered groups)
//! the quantizer gathers each activation row through it, as vLLM's Marlin kernels permute
//! theirs. Codes sit in "quads" (four consecutive slots of an output: one 32-bit lane), two
//! outputs to a byte, so that one 64-byte load and two masks give the unsigned bytes of 16
//! outputs × 4 slots:
//!
//! ```text
//! panel q, quad j:  codes [q][j][4c + t] = q(32q + c, 4j + t) | q(32q + 16 + c, 4j + t) << 4
//! panel q, group g: grids [q][g] = f16 scales [c], u8 zero points [c]
//!                   (c < 16 in codes, < 32 in grids; t < 4; positions are slots)
//! ```
//!
//! The grids are the checkpoints' own (f16 scales, 4-bit zero points) at 3 bytes a group and
//! output, the offset `−zero · scale` made in the epilogue; a matrix whose scales are not all
//! f16 (bf16 or f32 in its checkpoint) keeps f32 scales and offsets, 8 bytes.
//!
//! The VNNI kernels take `Σ q·x̂ = 2^16 · Σ q·h + 2^8 · Σ m·q + Σ l·q` as three passes over
//! the block (from L1 after the first): the codes unsigned against the signed high bytes, then
//! the unsigned lower bytes against the codes as signed bytes (`0..16` is both). AVX2 takes
//! `2^8 · h + m` as one 16-bit operand of `vpmaddwd` and `l` as another: two passes. Decode
//! reads 4 bits per weight plus 3 bytes per group of each row: 0.26× of bf16 with groups of
//! 128.

use std::sync::Arc;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod kernels;

use super::grids::PanelGrids;
use super::intdot::{DotKernel, Format, PADDING, QUAD, QuantizedRows, Quantizer};
use super::packed::PANEL;
#[cfg(target_arch = "x86_64")]
use kernels::{Int4Tile, UNPACKED_QUAD_BYTES, unpack_avx2};

/// Positions per block (one activation scale, one integer sum).
const BLOCK: usize = Format::Int4.block();
/// i32 words per quad of activations: the bytes `h`, `m`, `l` of `x̂ = 2^16 · h + 2^8 · m + l`.
const WORDS: usize = Format::Int4.words();
/// Quads per block.
const QUADS_PER_BLOCK: usize = BLOCK / QUAD;
/// Bytes of one quad of a panel: 32 outputs × 4 slots, two to a byte.
const QUAD_BYTES: usize = PANEL * QUAD / 2;
/// Blocks per step when several row tiles share a panel: 4 KiB of codes stay in L1 while
/// every tile runs through them.
const STEP_BLOCKS: usize = 8;

/// The group of each input position.
#[derive(Clone, Debug, PartialEq)]
pub enum GroupOf {
    /// Consecutive runs of this many positions (the last may be shorter): `p / size`.
    Runs(usize),
    /// `g_idx[p]`, as a GPTQ checkpoint with act-order lists it.
    Index(Vec<u32>),
}

impl GroupOf {
    fn of(&self, p: usize) -> usize {
        match self {
            GroupOf::Runs(size) => p / size,
            GroupOf::Index(g) => g[p] as usize,
        }
    }
}

/// A `[n, k]` 4-bit matrix in the kernels' layout (see the module note). Padding rows of the
/// last panel and empty slots are zero codes under scale and offset 0.
#[derive(Clone)]
pub struct Int4Panels {
    n: usize,
    k: usize,
    groups: usize,
    /// The position at each slot ([`PADDING`] for none); `None`: slot `p` is position `p`.
    /// Equal orders are one allocation ([`shared_order`]).
    order: Option<Arc<[u32]>>,
    /// Each position's slot, with `order`.
    slot_of: Option<Vec<u32>>,
    /// Slots: `order`'s length, or `k`.
    slots: usize,
    /// The group of each block of slots.
    block_group: Vec<u32>,
    /// `[num_panels, quads, QUAD_BYTES]`.
    codes: Vec<u8>,
    grids: PanelGrids,
}

/// How [`Int4Panels::new`] reads a checkpoint's matrix: each callback by (row, position) or
/// (group, row), rows being output features.
#[derive(Clone, Copy)]
pub struct Int4Source<C, S, Z> {
    /// The code of element `(r, p)`, in `0..16`.
    pub code: C,
    /// The scale of group `g`, row `r`.
    pub scale: S,
    /// The zero point of group `g`, row `r`, in `0..=16` (GPTQ's v1 format stores zero − 1,
    /// so a stored 15 reads as 16).
    pub zero: Z,
}

/// `order` as one allocation with every equal order alive: an expert's gate and up projections
/// under act-order take their input's Hessian's order, so they share it and the grouped SwiGLU
/// quantizes their input once, knowing it by the pointer alone (`Quantizer::same_as`), not by
/// comparing `k` entries per expert and step.
fn shared_order(order: Vec<u32>) -> Arc<[u32]> {
    use std::collections::HashMap;
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    use std::sync::{LazyLock, Mutex, Weak};
    type Orders = HashMap<u64, Vec<Weak<[u32]>>>;
    static ORDERS: LazyLock<Mutex<Orders>> = LazyLock::new(Default::default);
    let key = BuildHasherDefault::<DefaultHasher>::default().hash_one(&order);
    let mut orders = ORDERS.lock().unwrap_or_else(|e| e.into_inner());
    let same_hash = orders.entry(key).or_default();
    same_hash.retain(|o| o.strong_count() > 0);
    if let Some(shared) = same_hash
        .iter()
        .filter_map(Weak::upgrade)
        .find(|o| **o == *order)
    {
        return shared;
    }
    let order: Arc<[u32]> = order.into();
    same_hash.push(Arc::downgrade(&order));
    order
}

/// The kernels' order of `k` positions in `groups` groups: `(order, block_group)`, the order
/// `None` when it is `0..k` (see the module note).
fn slot_order(k: usize, groups: usize, group_of: &GroupOf) -> (Option<Vec<u32>>, Vec<u32>) {
    if let GroupOf::Runs(size) = group_of
        && (size.is_multiple_of(BLOCK) || *size >= k)
    {
        let block_group = (0..k.div_ceil(BLOCK))
            .map(|b| (b * BLOCK / size) as u32)
            .collect();
        return (None, block_group);
    }
    let mut members = vec![Vec::new(); groups];
    for p in 0..k {
        members[group_of.of(p)].push(p as u32);
    }
    let (mut order, mut block_group) = (Vec::with_capacity(k), Vec::new());
    for (g, positions) in members.iter().enumerate() {
        let blocks = positions.len().div_ceil(BLOCK);
        order.extend_from_slice(positions);
        order.resize(order.len() + blocks * BLOCK - positions.len(), PADDING);
        block_group.resize(block_group.len() + blocks, g as u32);
    }
    // Consecutive groups of whole blocks but the last: the identity after all.
    let identity = order.len() == k.div_ceil(BLOCK) * BLOCK
        && order
            .iter()
            .enumerate()
            .all(|(s, &p)| s as u32 == p || (s >= k && p == PADDING));
    (if identity { None } else { Some(order) }, block_group)
}

impl Int4Panels {
    /// Packs a `[n, k]` matrix of `groups` groups read through `src`. Refuses group indices
    /// out of range, zero points past 16 and scales that are not finite, naming the place.
    pub fn new<C, S, Z>(
        (n, k): (usize, usize),
        groups: usize,
        group_of: GroupOf,
        src: Int4Source<C, S, Z>,
    ) -> Result<Self, String>
    where
        C: Fn(usize, usize) -> u8 + Sync,
        S: Fn(usize, usize) -> f32,
        Z: Fn(usize, usize) -> u32,
    {
        match &group_of {
            GroupOf::Runs(0) => return Err("a group of 0 positions".into()),
            GroupOf::Runs(size) if k.div_ceil(*size) != groups => {
                return Err(format!(
                    "{k} positions in groups of {size} make {} groups, not {groups}",
                    k.div_ceil(*size)
                ));
            }
            GroupOf::Index(g) if g.len() != k => {
                return Err(format!("g_idx has {} entries for {k} positions", g.len()));
            }
            GroupOf::Index(g) => {
                if let Some(p) = g.iter().position(|&x| x as usize >= groups) {
                    return Err(format!(
                        "g_idx[{p}] = {} but there are {groups} groups",
                        g[p]
                    ));
                }
            }
            GroupOf::Runs(_) => {}
        }
        let panels = n.div_ceil(PANEL);
        let mut scales = vec![0.0f32; panels * groups * PANEL];
        let mut zeros = vec![0u8; panels * groups * PANEL];
        for g in 0..groups {
            for r in 0..n {
                let (s, z) = ((src.scale)(g, r), (src.zero)(g, r));
                if !s.is_finite() {
                    return Err(format!("group {g}, row {r}: scale {s} is not finite"));
                }
                if z > 16 {
                    return Err(format!("group {g}, row {r}: zero point {z} is past 16"));
                }
                let at = ((r / PANEL) * groups + g) * PANEL + r % PANEL;
                scales[at] = s;
                zeros[at] = z as u8;
            }
        }
        let (order, block_group) = slot_order(k, groups, &group_of);
        let order = order.map(shared_order);
        let slots = order.as_ref().map_or(k, |o| o.len());
        let slot_of = order.as_ref().map(|order| {
            let mut slot_of = vec![0u32; k];
            for (s, &p) in order.iter().enumerate().filter(|(_, p)| **p != PADDING) {
                slot_of[p as usize] = s as u32;
            }
            slot_of
        });
        let panel_bytes = slots.div_ceil(QUAD) * QUAD_BYTES;
        let mut codes: Vec<u8> = Vec::with_capacity(panels * panel_bytes);
        super::packed::advise_huge_pages(codes.as_mut_ptr(), panels * panel_bytes);
        codes.resize(panels * panel_bytes, 0);
        // Unpacking is most of a large model's load: one task per panel.
        codes
            .par_chunks_mut(panel_bytes)
            .enumerate()
            .for_each(|(q, panel)| {
                for s in 0..slots {
                    let p = order.as_ref().map_or(s as u32, |o| o[s]);
                    if p == PADDING {
                        continue;
                    }
                    let quad = &mut panel[(s / QUAD) * QUAD_BYTES..][..QUAD_BYTES];
                    for c in 0..PANEL.min(n - q * PANEL) {
                        let (byte, shift) = (c % (PANEL / 2), 4 * (c / (PANEL / 2)));
                        let code = (src.code)(q * PANEL + c, p as usize) & 0xF;
                        quad[byte * QUAD + s % QUAD] |= code << shift;
                    }
                }
            });
        Ok(Int4Panels {
            n,
            k,
            groups,
            order,
            slot_of,
            slots,
            block_group,
            codes,
            grids: PanelGrids::with_zeros(scales, zeros),
        })
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }

    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes one pass of the kernels reads: codes and grids (and act-order's order and
    /// blocks' groups).
    pub fn size_in_bytes(&self) -> usize {
        let order = self.order.as_ref().map_or(0, |o| o.len() * 4);
        self.codes.len() + self.grids.size_in_bytes() + order + self.block_group.len() * 4
    }

    /// How a product quantizes its activations for this matrix on `kernel`.
    pub(super) fn quantizer(&self, kernel: DotKernel) -> Quantizer<'_> {
        Quantizer {
            kernel,
            format: Format::Int4,
            order: self.order.as_deref(),
        }
    }

    /// The code and group at slot `s` of row `r`.
    fn code_at(&self, r: usize, s: usize) -> (u8, usize) {
        let (q, c) = (r / PANEL, r % PANEL);
        let panel = &self.codes[q * self.slots.div_ceil(QUAD) * QUAD_BYTES..];
        let byte = panel[(s / QUAD) * QUAD_BYTES + (c % (PANEL / 2)) * QUAD + s % QUAD];
        let code = (byte >> (4 * (c / (PANEL / 2)))) & 0xF;
        (code, self.block_group[s / BLOCK] as usize)
    }

    /// Element `(r, p)`'s value.
    pub fn value(&self, r: usize, p: usize) -> f32 {
        assert!(r < self.n && p < self.k);
        let s = self.slot_of.as_ref().map_or(p, |slots| slots[p] as usize);
        let (code, g) = self.code_at(r, s);
        let (scale, offset) = self
            .grids
            .scale_offset(self.groups, (r / PANEL, g, r % PANEL));
        f32::from(code) * scale + offset
    }

    /// Row `r`'s values into `out` (length `k`).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.k,
            "Int4Panels::row_into: want {} values",
            self.k
        );
        out.iter_mut()
            .enumerate()
            .for_each(|(p, v)| *v = self.value(r, p));
    }

    /// Panel `q` of `x · Wᵀ` into `acc: [m, PANEL]` for activations quantized by
    /// [`Self::quantizer`]: one tile of rows runs the whole panel in one call; more tiles
    /// share each step of [`STEP_BLOCKS`] blocks while it is in L1.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn panel_product(&self, x: QuantizedRows<'_>, q: usize, acc: &mut [f32]) {
        assert!(
            x.k == self.slots && x.format == Format::Int4,
            "int4 weights take activations quantized for them"
        );
        debug_assert!(acc.len() == x.m * PANEL && q < self.num_panels());
        let kernel = x.kernel;
        let (quads, blocks) = (self.slots.div_ceil(QUAD), self.slots.div_ceil(BLOCK));
        let step = if x.m <= kernel.tile_rows(Format::Int4) {
            blocks
        } else {
            STEP_BLOCKS
        };
        let codes = &self.codes[q * quads * QUAD_BYTES..][..quads * QUAD_BYTES];
        // AVX-VNNI's row tiles would each unpack the nibbles again in every pass: with
        // several tiles, a step's codes are unpacked to bytes once, in L1, for all (3-row
        // tiles at batch 32, alternating runs: decode 91 against 87 tokens/s, prefill 109
        // against 97; no gain measured for `Avx2Madd`, whose 16-bit widening stays per tile).
        let unpack = x.m > kernel.tile_rows(Format::Int4) && kernel == DotKernel::AvxVnni;
        UNPACKED.with_borrow_mut(|unpacked| {
            for b0 in (0..blocks).step_by(step) {
                let b1 = (b0 + step).min(blocks);
                let (j0, j1) = (b0 * QUADS_PER_BLOCK, (b1 * QUADS_PER_BLOCK).min(quads));
                if unpack {
                    unpacked.resize((j1 - j0) * UNPACKED_QUAD_BYTES, 0);
                    // SAFETY: the unpacking kernels run on AVX2 CPUs alone; both ranges hold
                    // quads j0..j1.
                    unsafe { unpack_avx2(&codes[j0 * QUAD_BYTES..j1 * QUAD_BYTES], unpacked) };
                }
                let unpacked = if unpack {
                    unpacked.as_ptr()
                } else {
                    std::ptr::null()
                };
                self.step_product(x, q, (b0, b1), (unpacked, j0), acc);
            }
        })
    }

    /// Blocks `b0..b1` of panel `q` for every row tile of `x`; `unpacked` (or null): the
    /// step's codes unpacked to bytes, from quad `quad0` on.
    #[cfg(target_arch = "x86_64")]
    fn step_product(
        &self,
        x: QuantizedRows<'_>,
        q: usize,
        (b0, b1): (usize, usize),
        (unpacked, quad0): (*const u8, usize),
        acc: &mut [f32],
    ) {
        use super::intdot::TileGrids;
        let kernel = x.kernel;
        let (quads, blocks) = (self.slots.div_ceil(QUAD), self.slots.div_ceil(BLOCK));
        for (i0, mr) in super::matmul::row_tiles(x.m, kernel.tile_rows(Format::Int4)) {
            let t = Int4Tile {
                x: x.words[i0 * quads * WORDS..].as_ptr(),
                w: self.codes[q * quads * QUAD_BYTES..].as_ptr(),
                unpacked,
                quad0,
                quads,
                blocks: (b0, b1),
                grids: TileGrids {
                    num_blocks: blocks,
                    sx: x.scales[i0 * blocks..].as_ptr(),
                    sum_x: x.sums[i0 * blocks..].as_ptr(),
                    // The codes are unsigned: no correction.
                    correction: std::ptr::null(),
                    block_group: self.block_group.as_ptr(),
                    grid: self.grids.panel(self.groups, q),
                    acc: acc[i0 * PANEL..(i0 + mr) * PANEL].as_mut_ptr(),
                },
            };
            // SAFETY: `kernel` was chosen for this CPU (`DotKernel::for_isa`); the tile's
            // quads and metadata, the panel's codes and grids and `acc` cover what
            // `Int4Tile` describes for mr rows.
            unsafe { t.run(kernel, mr) };
        }
    }
}

/// Makes this thread's buffer of unpacked codes hold a step without growing (see
/// [`super::reserve_task_scratch`]).
pub(super) fn reserve_task_scratch() {
    UNPACKED.with_borrow_mut(|u| {
        u.reserve((STEP_BLOCKS * QUADS_PER_BLOCK * UNPACKED_QUAD_BYTES).saturating_sub(u.len()))
    });
}

thread_local! {
    /// A step's codes unpacked to bytes, for AVX-VNNI's row tiles.
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `x · Wᵀ` as the kernels compute it, in scalar code (tests): the same quantized
/// activations, integer sums and f32 epilogue.
#[cfg(test)]
pub(super) fn reference_product(x: &[f32], m: usize, w: &Int4Panels) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    let mut out = vec![0.0; m * n];
    let x_max = Format::Int4.x_max();
    for i in 0..m {
        let row = &x[i * k..(i + 1) * k];
        let gathered: Vec<f32> = (0..w.slots)
            .map(|s| match &w.order {
                None => row[s],
                Some(o) if o[s] == PADDING => 0.0,
                Some(o) => row[o[s] as usize],
            })
            .collect();
        for (b, block) in gathered.chunks(BLOCK).enumerate() {
            let mut codes = [0i32; BLOCK];
            let (sx, sum_x, _) = super::intdot::quantize_block(block, x_max, &mut codes);
            for r in 0..n {
                let dot: i32 = (0..block.len())
                    .map(|t| codes[t] * i32::from(w.code_at(r, b * BLOCK + t).0))
                    .sum();
                let g = w.block_group[b] as usize;
                let (scale, offset) = w.grids.scale_offset(w.groups, (r / PANEL, g, r % PANEL));
                let add = dot as f32 * (scale * sx) + sum_x * offset;
                let a = &mut out[i * n + r];
                *a = if b == 0 { add } else { *a + add };
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    type Source =
        Int4Source<fn(usize, usize) -> u8, fn(usize, usize) -> f32, fn(usize, usize) -> u32>;

    /// A matrix's codes, f16-valued scales and zero points, all values covered.
    fn source() -> Source {
        Int4Source {
            code: |r, p| ((r * 7 + p * 13 + r * p) % 16) as u8,
            scale: |g, r| half::f16::from_f32(0.001 + ((g * 31 + r) % 29) as f32 * 0.0137).to_f32(),
            zero: |g, r| ((g * 5 + r * 3) % 17) as u32,
        }
    }

    /// [`source`] with scales that are not f16 (as a checkpoint with f32 scales has them).
    fn float_source() -> Source {
        Int4Source {
            scale: |g, r| (source().scale)(g, r) * (1.0 + 1.0 / (1 << 20) as f32),
            ..source()
        }
    }

    /// Both sources, and whether each keeps f16 grids.
    fn sources() -> [(Source, bool); 2] {
        [(source(), true), (float_source(), false)]
    }

    fn definition(src: &Source, group_of: &GroupOf, r: usize, p: usize) -> f32 {
        let g = group_of.of(p);
        (f32::from((src.code)(r, p)) - (src.zero)(g, r) as f32) * (src.scale)(g, r)
    }

    /// Groupings of `k` positions: runs of whole blocks, one group, runs of part blocks, and
    /// act-order's scattered groups (sizes 32 and uneven).
    fn groupings(k: usize) -> Vec<(GroupOf, usize)> {
        let scattered =
            |size: usize| -> Vec<u32> { (0..k).map(|p| ((p * 37) % k / size) as u32).collect() };
        vec![
            (GroupOf::Runs(32), k.div_ceil(32)),
            (GroupOf::Runs(64), k.div_ceil(64)),
            (GroupOf::Runs(k), 1),
            (GroupOf::Runs(20), k.div_ceil(20)),
            (GroupOf::Index(scattered(32)), k.div_ceil(32)),
            (GroupOf::Index(scattered(45)), k.div_ceil(45)),
        ]
    }

    /// A `[n, k]` matrix of each grouping from each source, with its grouping and source; each
    /// keeps the grids its source's scales allow.
    fn matrices(n: usize, k: usize) -> Vec<(GroupOf, Source, Int4Panels)> {
        let mut out = Vec::new();
        for (group_of, groups) in groupings(k) {
            for (src, half) in sources() {
                let w = Int4Panels::new((n, k), groups, group_of.clone(), src).unwrap();
                assert_eq!(w.grids.is_f16(), half, "{group_of:?}");
                out.push((group_of.clone(), src, w));
            }
        }
        out
    }

    #[test]
    fn values_are_the_definition_for_every_grouping() {
        let (n, k) = (45, 100); // a padded second panel, a partial last group
        for (group_of, src, w) in matrices(n, k) {
            let ordered = w.order.is_some();
            let expect_order = !matches!(group_of, GroupOf::Runs(s) if s % 32 == 0 || s >= k);
            assert_eq!(ordered, expect_order, "{group_of:?}");
            for r in 0..n {
                for p in 0..k {
                    let (want, got) = (definition(&src, &group_of, r, p), w.value(r, p));
                    if w.grids.is_f16() {
                        // `q · s − z · s` in f32 is `(q − z) · s` exactly for an f16 `s`.
                        assert_eq!(got.to_bits(), want.to_bits(), "{group_of:?} ({r}, {p})");
                    } else {
                        let tolerance = 32.0 * (src.scale)(group_of.of(p), r).abs() * f32::EPSILON;
                        assert!((got - want).abs() <= tolerance, "{group_of:?} ({r}, {p})");
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_dot_kernel_is_the_integer_reference_whatever_the_batch() {
        use crate::cpu::intdot::IntActivations;
        use crate::cpu::matmul::TiledRows;
        let kernels: Vec<DotKernel> = [DotKernel::Vnni512, DotKernel::AvxVnni, DotKernel::Avx2Madd]
            .into_iter()
            .filter(|k| k.supported())
            .collect();
        let (n, k) = (45, 100);
        let mut seed = 3u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        for (group_of, _, w) in matrices(n, k) {
            for m in [1, 2, 3, 5, 12, 13, 30] {
                // Rows of very different sizes; one all zero.
                let x: Vec<f32> = (0..m * k)
                    .map(|e| {
                        if e / k == 1 {
                            0.0
                        } else {
                            next() * (1 + e / k % 4) as f32 * 10.0
                        }
                    })
                    .collect();
                let want = reference_product(&x, m, &w);
                // Near the dequantised weights' product: half a step of sx per position.
                for i in 0..m {
                    for r in 0..n {
                        let row = &x[i * k..(i + 1) * k];
                        let exact: f64 = (0..k)
                            .map(|p| f64::from(row[p]) * f64::from(w.value(r, p)))
                            .sum();
                        let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                        let wsum: f64 = (0..k).map(|p| f64::from(w.value(r, p)).abs()).sum();
                        let bound = f64::from(amax) / 4194303.0 * wsum + 1e-5 * exact.abs() + 1e-6;
                        let got = f64::from(want[i * n + r]);
                        assert!(
                            (got - exact).abs() <= bound,
                            "{group_of:?} m {m} ({i}, {r})"
                        );
                    }
                }
                for &kernel in &kernels {
                    let mut acts = IntActivations::default();
                    let xq = acts.quantize(w.quantizer(kernel), TiledRows::rows(&x, m, k));
                    let mut got = vec![0.0f32; m * n];
                    for q in 0..w.num_panels() {
                        let mut acc = vec![f32::NAN; m * PANEL];
                        w.panel_product(xq, q, &mut acc);
                        for i in 0..m {
                            for c in 0..PANEL.min(n - q * PANEL) {
                                got[i * n + q * PANEL + c] = acc[i * PANEL + c];
                            }
                        }
                    }
                    for (e, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            r.to_bits(),
                            "{kernel} {group_of:?} m {m} element {e}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matrices_with_one_order_share_it() {
        let (n, k) = (8, 64);
        let act_order = || GroupOf::Index((0..k).map(|p| ((p * 37) % k / 32) as u32).collect());
        let (a, b) = (
            Int4Panels::new((n, k), 2, act_order(), source()).unwrap(),
            Int4Panels::new((n, k), 2, act_order(), source()).unwrap(),
        );
        let other = GroupOf::Index((0..k).map(|p| ((p * 13) % k / 32) as u32).collect());
        let c = Int4Panels::new((n, k), 2, other, source()).unwrap();
        let (a, b, c) = (a.order.unwrap(), b.order.unwrap(), c.order.unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c) && *a != *c);
    }

    #[test]
    fn bad_groups_zero_points_and_scales_are_refused() {
        let bad = |groups, group_of, zero: u32, scale: f32| {
            let src = Int4Source {
                code: |_: usize, _: usize| 0u8,
                scale: move |_: usize, _: usize| scale,
                zero: move |_: usize, _: usize| zero,
            };
            Int4Panels::new((8, 64), groups, group_of, src)
                .err()
                .unwrap()
        };
        let e = bad(2, GroupOf::Index(vec![2; 64]), 8, 1.0);
        assert!(e.contains("g_idx[0] = 2 but there are 2 groups"), "{e}");
        let e = bad(3, GroupOf::Runs(32), 8, 1.0);
        assert!(e.contains("make 2 groups, not 3"), "{e}");
        let e = bad(2, GroupOf::Runs(32), 17, 1.0);
        assert!(e.contains("zero point 17 is past 16"), "{e}");
        let e = bad(2, GroupOf::Runs(32), 8, f32::NAN);
        assert!(e.contains("scale NaN is not finite"), "{e}");
    }
}
