//! 4-bit integer weights with a scale and a zero point per group of input positions, as GPTQ
//! and AWQ checkpoints store them: `w[r][p] = (q[r][p] − zero[g][r]) · scale[g][r]` with
//! `q ∈ 0..16` and `g` the group of position `p` — `p / group_size`, or with GPTQ's act-order
//! (`desc_act`) any group `g_idx[p]`. They stay 4-bit in memory, in the GEMM's panel layout
//! (the codes laid out as MXFP4's, `mxfp4.rs`), with each group's 32 scales and offsets per
//! panel in f32:
//!
//! ```text
//! panel q, position p:  codes   [q][p][j] = q(32q + j, p) | q(32q + 16 + j, p) << 4
//! panel q, group g:     scales  [q][g][c] = scale[g][32q + c]
//!                       offsets [q][g][c] = −zero[g][32q + c] · scale[g][32q + c]
//! ```
//!
//! The kernels widen a block of positions to f32 as `q · scale + offset` (one FMA). Both
//! products are exact — `q` and `zero` have at most 5 significant bits and a stored scale
//! (f16, bf16) at most 11 — so the sum is `(q − zero) · scale` exactly: a product is the same
//! FMA chain as over the dequantised weights in f32, and a GPTQ or AWQ model gives the tokens
//! of its dequantised copy. Positions keep their order under act-order (the widening looks up
//! each position's group), so the activations need no permutation. Decode reads 4 bits per
//! weight plus 8 bytes per group of 32 rows: 0.27× of bf16 with groups of 128.

use rayon::prelude::*;

use super::packed::PANEL;

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

    /// The end of the run of positions from `p` (before `end`) that share `p`'s group.
    fn run_end(&self, p: usize, end: usize) -> usize {
        match self {
            GroupOf::Runs(size) => ((p / size + 1) * size).min(end),
            GroupOf::Index(g) => (p + 1..end).find(|&i| g[i] != g[p]).unwrap_or(end),
        }
    }
}

/// A `[n, k]` 4-bit matrix in panel layout (see the module note). Padding rows of the last
/// panel are zero codes under scale 0.
#[derive(Clone)]
pub struct Int4Panels {
    n: usize,
    k: usize,
    groups: usize,
    group_of: GroupOf,
    /// `[num_panels, k, PANEL / 2]`.
    codes: Vec<u8>,
    /// `[num_panels, groups, PANEL]`.
    scales: Vec<f32>,
    /// `[num_panels, groups, PANEL]`: `−zero · scale`.
    offsets: Vec<f32>,
}

/// How [`Int4Panels::new`] reads a checkpoint's matrix: each callback by (row, position) or
/// (group, row), rows being output features.
pub struct Int4Source<C, S, Z> {
    /// The code of element `(r, p)`, in `0..16`.
    pub code: C,
    /// The scale of group `g`, row `r`.
    pub scale: S,
    /// The zero point of group `g`, row `r`, in `0..=16` (GPTQ's v1 format stores zero − 1,
    /// so a stored 15 reads as 16).
    pub zero: Z,
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
        let mut offsets = vec![0.0f32; panels * groups * PANEL];
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
                offsets[at] = -(z as f32) * s;
            }
        }
        let mut codes = vec![0u8; panels * k * PANEL / 2];
        // Unpacking is most of a large model's load: one task per panel.
        codes
            .par_chunks_mut(k * PANEL / 2)
            .enumerate()
            .for_each(|(q, panel)| {
                for c in 0..PANEL.min(n - q * PANEL) {
                    let (byte, shift) = (c % (PANEL / 2), 4 * (c / (PANEL / 2)));
                    for (p, pos) in panel.chunks_exact_mut(PANEL / 2).enumerate() {
                        pos[byte] |= ((src.code)(q * PANEL + c, p) & 0xF) << shift;
                    }
                }
            });
        Ok(Int4Panels {
            n,
            k,
            groups,
            group_of,
            codes,
            scales,
            offsets,
        })
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }

    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes one pass of the kernels reads: codes, scales and offsets (and act-order's group
    /// indices).
    pub fn size_in_bytes(&self) -> usize {
        let index = match &self.group_of {
            GroupOf::Runs(_) => 0,
            GroupOf::Index(g) => g.len() * 4,
        };
        self.codes.len() + (self.scales.len() + self.offsets.len()) * 4 + index
    }

    /// Element `(r, p)`'s value.
    pub fn value(&self, r: usize, p: usize) -> f32 {
        let (q, c) = (r / PANEL, r % PANEL);
        let byte = self.codes[(q * self.k + p) * PANEL / 2 + c % (PANEL / 2)];
        let code = (byte >> (4 * (c / (PANEL / 2)))) & 0xF;
        let at = (q * self.groups + self.group_of.of(p)) * PANEL + c;
        f32::from(code) * self.scales[at] + self.offsets[at]
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

    /// Positions `k0 .. k0 + kc` of panel `q` widened into `dst: [kc, PANEL]`, as the f32 panel
    /// of the dequantised weights holds them.
    pub(super) fn widen_block(
        &self,
        isa: super::Isa,
        q: usize,
        k0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        assert!(k0 + kc <= self.k && dst.len() == kc * PANEL);
        for (p, end, run) in self.runs(q, k0, k0 + kc) {
            let out = &mut dst[(p - k0) * PANEL..(end - k0) * PANEL];
            match isa {
                // SAFETY: the caller's `isa` is supported; the run's slices agree in length.
                #[cfg(target_arch = "x86_64")]
                super::Isa::Avx512 => unsafe { widen_avx512(run, out) },
                #[cfg(target_arch = "x86_64")]
                super::Isa::Avx2 => unsafe { widen_avx2(run, out) },
                _ => widen_portable(run, out),
            }
        }
    }

    /// Positions `from .. to` of panel `q` as runs under one group's scales and offsets:
    /// `(first position, end, run)`.
    fn runs(
        &self,
        q: usize,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (usize, usize, Run<'_>)> {
        let panel_codes = &self.codes[q * self.k * PANEL / 2..][..self.k * PANEL / 2];
        let group_base = q * self.groups * PANEL;
        let mut p = from;
        std::iter::from_fn(move || {
            if p >= to {
                return None;
            }
            let (start, end) = (p, self.group_of.run_end(p, to));
            let g = group_base + self.group_of.of(start) * PANEL;
            p = end;
            let run = Run {
                codes: &panel_codes[start * PANEL / 2..end * PANEL / 2],
                scales: &self.scales[g..g + PANEL],
                offsets: &self.offsets[g..g + PANEL],
            };
            Some((start, end, run))
        })
    }
}

impl Int4Panels {
    /// Panel `q` of `x · Wᵀ` for one tile of `mr` activation rows (`x`: the tile's `k`
    /// positions in tile order, `x[p · mr + i]`) into `acc: [mr, PANEL]`, each position widened
    /// in registers and multiplied straight in: the decode case, where no other tile would
    /// reuse a widened block. The same widening and the same FMA chain over `p` in order as
    /// [`Self::widen_block`] then the tile microkernels, so the same bits.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn tile_product(
        &self,
        isa: super::Isa,
        q: usize,
        x: &[f32],
        mr: usize,
        acc: &mut [f32],
    ) {
        assert!(x.len() == self.k * mr && acc.len() == mr * PANEL);
        for (p, _, run) in self.runs(q, 0, self.k) {
            let t = FusedRun {
                run,
                x: x[p * mr..].as_ptr(),
                acc: acc.as_mut_ptr(),
                first: p == 0,
            };
            // SAFETY: the caller's `isa` is supported; x holds the run's positions for mr rows
            // and acc mr × 32 sums (mr within the ISA's tile rows, checked by the match).
            unsafe {
                match (isa, mr) {
                    (super::Isa::Avx2, 1) => fused_avx2::<1>(t),
                    (super::Isa::Avx2, 2) => fused_avx2::<2>(t),
                    (super::Isa::Avx2, 3) => fused_avx2::<3>(t),
                    (super::Isa::Avx512, 1) => fused_avx512::<1>(t),
                    (super::Isa::Avx512, 2) => fused_avx512::<2>(t),
                    (super::Isa::Avx512, 3) => fused_avx512::<3>(t),
                    (super::Isa::Avx512, 4) => fused_avx512::<4>(t),
                    (super::Isa::Avx512, 5) => fused_avx512::<5>(t),
                    (super::Isa::Avx512, 6) => fused_avx512::<6>(t),
                    (super::Isa::Avx512, 7) => fused_avx512::<7>(t),
                    (super::Isa::Avx512, 8) => fused_avx512::<8>(t),
                    _ => unreachable!("{isa:?} fused int4 tiles of {mr} rows"),
                }
            }
        }
    }
}

/// The most rows [`Int4Panels::tile_product`] takes on `isa` (one tile; past it, a block
/// widened once serves every tile).
#[cfg(target_arch = "x86_64")]
pub(super) fn fused_rows(isa: super::Isa) -> usize {
    match isa {
        super::Isa::Avx512 => 8,
        super::Isa::Avx2 => super::avx2::MAX_MR,
        super::Isa::Scalar => 0,
    }
}

/// One run's operands for the fused kernels.
#[cfg(target_arch = "x86_64")]
struct FusedRun<'a> {
    run: Run<'a>,
    /// The tile's rows at the run's first position, in tile order.
    x: *const f32,
    /// `MR × PANEL` running sums, read back unless `first`.
    acc: *mut f32,
    first: bool,
}

/// # Safety
/// The CPU supports AVX2 and FMA; the pointers cover what [`FusedRun`] says for `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_avx2<const MR: usize>(t: FusedRun<'_>) {
    use std::arch::x86_64::*;
    unsafe {
        let s = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(t.run.scales.as_ptr().add(i)));
        let o = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(t.run.offsets.as_ptr().add(i)));
        let nibble = _mm256_set1_epi32(0xF);
        let bytes8 = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let mut acc = [[_mm256_setzero_ps(); 4]; MR];
        if !t.first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, a) in row.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(t.acc.add(i * PANEL + 8 * j));
                }
            }
        }
        for (p, pos) in t.run.codes.chunks_exact(PANEL / 2).enumerate() {
            prefetch_ahead(pos.as_ptr());
            let (a, c) = (bytes8(pos.as_ptr()), bytes8(pos.as_ptr().add(8)));
            let codes = [
                _mm256_and_si256(a, nibble),
                _mm256_and_si256(c, nibble),
                _mm256_srli_epi32::<4>(a),
                _mm256_srli_epi32::<4>(c),
            ];
            let xs: [__m256; MR] = std::array::from_fn(|i| _mm256_set1_ps(*t.x.add(p * MR + i)));
            for (j, v) in codes.into_iter().enumerate() {
                let w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s[j], o[j]);
                for (row, x) in acc.iter_mut().zip(&xs) {
                    row[j] = _mm256_fmadd_ps(w, *x, row[j]);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                _mm256_storeu_ps(t.acc.add(i * PANEL + 8 * j), *a);
            }
        }
    }
}

/// # Safety
/// The CPU supports AVX-512F; the pointers cover what [`FusedRun`] says for `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fused_avx512<const MR: usize>(t: FusedRun<'_>) {
    use std::arch::x86_64::*;
    unsafe {
        let s = [0, 16].map(|i| _mm512_loadu_ps(t.run.scales.as_ptr().add(i)));
        let o = [0, 16].map(|i| _mm512_loadu_ps(t.run.offsets.as_ptr().add(i)));
        let nibble = _mm512_set1_epi32(0xF);
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if !t.first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, a) in row.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(t.acc.add(i * PANEL + 16 * j));
                }
            }
        }
        for (p, pos) in t.run.codes.chunks_exact(PANEL / 2).enumerate() {
            prefetch_ahead(pos.as_ptr());
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(pos.as_ptr() as *const __m128i));
            let codes = [
                _mm512_and_si512(bytes, nibble),
                _mm512_srli_epi32::<4>(bytes),
            ];
            let xs: [__m512; MR] = std::array::from_fn(|i| _mm512_set1_ps(*t.x.add(p * MR + i)));
            for (j, v) in codes.into_iter().enumerate() {
                let w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s[j], o[j]);
                for (row, x) in acc.iter_mut().zip(&xs) {
                    row[j] = _mm512_fmadd_ps(w, *x, row[j]);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                _mm512_storeu_ps(t.acc.add(i * PANEL + 16 * j), *a);
            }
        }
    }
}

/// Consecutive positions of one panel in one group.
#[derive(Clone, Copy)]
struct Run<'a> {
    /// `[positions, PANEL / 2]`.
    codes: &'a [u8],
    scales: &'a [f32],
    offsets: &'a [f32],
}

/// [`Int4Panels::widen_block`] of one run without SIMD (and the definition the SIMD versions
/// must equal; both products are exact, so `a · b + c` and the FMA agree).
fn widen_portable(run: Run<'_>, dst: &mut [f32]) {
    const HALF: usize = PANEL / 2;
    for (pos, out) in run
        .codes
        .chunks_exact(HALF)
        .zip(dst.chunks_exact_mut(PANEL))
    {
        for (j, byte) in pos.iter().enumerate() {
            let (lo, hi) = (f32::from(byte & 0xF), f32::from(byte >> 4));
            out[j] = lo * run.scales[j] + run.offsets[j];
            out[j + HALF] = hi * run.scales[j + HALF] + run.offsets[j + HALF];
        }
    }
}

/// Prefetches the line of codes the microkernels' distance ahead of `pos` once per 64-byte
/// line (the codes stream as a bf16 panel does): positions are 16 bytes apart, so exactly one
/// in each line starts in its first 16 bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(pos: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
    if (pos as usize) % 64 < PANEL / 2 {
        let ahead = pos.wrapping_add(super::avx512::PREFETCH_BYTES);
        // SAFETY: a prefetch of any address is harmless (it never faults).
        unsafe { _mm_prefetch::<_MM_HINT_T2>(ahead as *const i8) };
    }
}

/// 16 lanes: the 16 bytes of a position widened once; rows 0..16 are their low nibbles, rows
/// 16..32 their high ones.
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(run: Run<'_>, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    unsafe {
        let s = [0, 16].map(|i| _mm512_loadu_ps(run.scales.as_ptr().add(i)));
        let o = [0, 16].map(|i| _mm512_loadu_ps(run.offsets.as_ptr().add(i)));
        let nibble = _mm512_set1_epi32(0xF);
        for (pos, out) in run
            .codes
            .chunks_exact(PANEL / 2)
            .zip(dst.chunks_exact_mut(PANEL))
        {
            prefetch_ahead(pos.as_ptr());
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(pos.as_ptr() as *const __m128i));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(bytes));
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_fmadd_ps(lo, s[0], o[0]));
            _mm512_storeu_ps(out.as_mut_ptr().add(16), _mm512_fmadd_ps(hi, s[1], o[1]));
        }
    }
}

/// 8 lanes: bytes 0..8 hold rows 0..8 (low nibbles) and 16..24 (high), bytes 8..16 rows 8..16
/// and 24..32.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_avx2(run: Run<'_>, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    unsafe {
        let s = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(run.scales.as_ptr().add(i)));
        let o = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(run.offsets.as_ptr().add(i)));
        let nibble = _mm256_set1_epi32(0xF);
        let bytes8 = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        for (pos, out) in run
            .codes
            .chunks_exact(PANEL / 2)
            .zip(dst.chunks_exact_mut(PANEL))
        {
            prefetch_ahead(pos.as_ptr());
            let (a, c) = (bytes8(pos.as_ptr()), bytes8(pos.as_ptr().add(8)));
            let rows = [
                _mm256_and_si256(a, nibble),
                _mm256_and_si256(c, nibble),
                _mm256_srli_epi32::<4>(a),
                _mm256_srli_epi32::<4>(c),
            ];
            for (i, v) in rows.into_iter().enumerate() {
                let w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s[i], o[i]);
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;

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

    fn definition(group_of: &GroupOf, r: usize, p: usize) -> f32 {
        let src = source();
        let g = group_of.of(p);
        (f32::from((src.code)(r, p)) - (src.zero)(g, r) as f32) * (src.scale)(g, r)
    }

    fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") {
                isas.push(Isa::Avx512);
            }
            if has!("avx2") && has!("fma") {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    #[test]
    fn values_and_widened_blocks_are_the_definition_for_runs_and_act_order() {
        let (n, k) = (45, 100); // a padded second panel, a partial last group
        let shuffled: Vec<u32> = (0..k).map(|p| ((p * 37) % k / 32) as u32).collect();
        for group_of in [
            GroupOf::Runs(32),
            GroupOf::Runs(k),
            GroupOf::Index(shuffled),
        ] {
            let groups = match &group_of {
                GroupOf::Runs(s) => k.div_ceil(*s),
                GroupOf::Index(_) => 4,
            };
            let w = Int4Panels::new((n, k), groups, group_of.clone(), source()).unwrap();
            for r in 0..n {
                for p in 0..k {
                    let want = definition(&group_of, r, p);
                    assert_eq!(w.value(r, p).to_bits(), want.to_bits(), "({r}, {p})");
                }
            }
            for isa in isas() {
                for q in 0..w.num_panels() {
                    // Blocks that start and end inside groups.
                    for (k0, kc) in [(0, k), (3, 50), (60, 40)] {
                        let mut got = vec![f32::NAN; kc * PANEL];
                        w.widen_block(isa, q, k0, kc, &mut got);
                        for p in 0..kc {
                            for c in 0..PANEL {
                                let r = q * PANEL + c;
                                let want = if r < n { w.value(r, k0 + p) } else { 0.0 };
                                assert_eq!(
                                    got[p * PANEL + c].to_bits(),
                                    want.to_bits(),
                                    "{isa:?} {group_of:?} panel {q} block {k0} ({r}, {p})"
                                );
                            }
                        }
                    }
                }
            }
        }
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
