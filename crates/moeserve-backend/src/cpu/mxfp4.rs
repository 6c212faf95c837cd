//! MXFP4 weights (OCP Microscaling FP4, how GPT-OSS ships its experts): e2m1 elements, two per
//! byte, and one e8m0 scale (a power of two, stored as its exponent + 127) per [`BLOCK`]
//! consecutive elements of a row. They stay 4-bit in memory, in the GEMM's panel layout: a
//! panel of 32 output rows holds, per position, 16 bytes (byte `j` is row `j` in its low nibble
//! and row `j + 16` in its high one) and, per block of positions, 32 scale bytes.
//!
//! ```text
//! panel q, position p:  codes  [q][p][j] = e2m1(w[32q + j][p]) | e2m1(w[32q + 16 + j][p]) << 4
//! panel q, block b:     scales [q][b][c] = e8m0 of row 32q + c, positions 32b .. 32b + 32
//! ```
//!
//! The kernels widen a block of positions to f32 — a 16-entry table lookup per nibble times the
//! row's scale, exact (an e2m1 value has two significant bits, the scale is a power of two) —
//! so a product is the same FMA chain as over the dequantised weights in f32 or bf16, and an
//! MXFP4 model gives the tokens of its dequantised copy. Decode reads 4.25 bits per weight:
//! 0.27× of bf16.

pub use moeserve_core::mxfp4::{BLOCK, E2M1, e8m0};

use super::packed::PANEL;

/// A `[n, k]` MXFP4 matrix in panel layout (see the module note); `k` a multiple of
/// [`BLOCK`]. Padding rows of the last panel are zero codes under scale 1.
#[derive(Clone)]
pub struct Mxfp4Panels {
    n: usize,
    k: usize,
    /// `[num_panels, k, PANEL / 2]`.
    codes: Vec<u8>,
    /// `[num_panels, k / BLOCK, PANEL]`.
    scales: Vec<u8>,
}

impl Mxfp4Panels {
    /// Packs rows as checkpoints store them: `row(r)` gives row `r`'s `k / 2` bytes (element
    /// `2i` in the low nibble of byte `i`, `2i + 1` in the high one) and its `k / BLOCK` scale
    /// bytes.
    pub fn from_rows<'a>(
        n: usize,
        k: usize,
        row: impl Fn(usize) -> (&'a [u8], &'a [u8]),
    ) -> Result<Self, String> {
        if !k.is_multiple_of(BLOCK) {
            return Err(format!(
                "rows of {k} elements are not whole blocks of {BLOCK}"
            ));
        }
        let (panels, blocks) = (n.div_ceil(PANEL), k / BLOCK);
        let mut codes = vec![0u8; panels * k * PANEL / 2];
        let mut scales = vec![127u8; panels * blocks * PANEL];
        for r in 0..n {
            let (bytes, row_scales) = row(r);
            if bytes.len() != k / 2 || row_scales.len() != blocks {
                return Err(format!(
                    "row {r}: {} bytes and {} scales, want {} and {blocks}",
                    bytes.len(),
                    row_scales.len(),
                    k / 2
                ));
            }
            if let Some(b) = row_scales.iter().position(|&s| s == 255) {
                return Err(format!(
                    "row {r}, elements {}..{}: scale 255 is e8m0's NaN",
                    b * BLOCK,
                    (b + 1) * BLOCK
                ));
            }
            let (q, c) = (r / PANEL, r % PANEL);
            let (byte, shift) = (c % (PANEL / 2), 4 * (c / (PANEL / 2)));
            for (p, code) in bytes.iter().flat_map(|b| [b & 0xF, b >> 4]).enumerate() {
                codes[(q * k + p) * PANEL / 2 + byte] |= code << shift;
            }
            for (b, s) in row_scales.iter().enumerate() {
                scales[(q * blocks + b) * PANEL + c] = *s;
            }
        }
        Ok(Mxfp4Panels {
            n,
            k,
            codes,
            scales,
        })
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }

    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes one pass of the kernels reads: codes and scales.
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + self.scales.len()
    }

    /// Element `(r, p)`'s value.
    pub fn value(&self, r: usize, p: usize) -> f32 {
        let (q, c) = (r / PANEL, r % PANEL);
        let byte = self.codes[(q * self.k + p) * PANEL / 2 + c % (PANEL / 2)];
        let code = (byte >> (4 * (c / (PANEL / 2)))) & 0xF;
        let scale = self.scales[(q * (self.k / BLOCK) + p / BLOCK) * PANEL + c];
        E2M1[code as usize] * e8m0(scale)
    }

    /// Row `r`'s values into `out` (length `k`).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.k,
            "Mxfp4Panels::row_into: want {} values",
            self.k
        );
        out.iter_mut()
            .enumerate()
            .for_each(|(p, v)| *v = self.value(r, p));
    }

    /// Positions `k0 .. k0 + kc` of panel `q` (both multiples of [`BLOCK`]) widened into
    /// `dst: [kc, PANEL]`, as the f32 panel of the dequantised weights holds them.
    pub(super) fn widen_block(
        &self,
        isa: super::Isa,
        q: usize,
        k0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        assert!(k0.is_multiple_of(BLOCK) && kc.is_multiple_of(BLOCK) && k0 + kc <= self.k);
        assert_eq!(dst.len(), kc * PANEL);
        let codes = &self.codes[(q * self.k + k0) * PANEL / 2..][..kc * PANEL / 2];
        let blocks = self.k / BLOCK;
        let scales = &self.scales[(q * blocks + k0 / BLOCK) * PANEL..][..kc / BLOCK * PANEL];
        match isa {
            // SAFETY: the caller's `isa` is supported; the slices hold kc positions.
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx512 => unsafe { widen_avx512(codes, scales, dst) },
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx2 => unsafe { widen_avx2(codes, scales, dst) },
            _ => widen_portable(codes, scales, dst),
        }
    }
}

/// [`Mxfp4Panels::widen_block`] without SIMD (and the definition the SIMD versions must equal).
fn widen_portable(codes: &[u8], scales: &[u8], dst: &mut [f32]) {
    const HALF: usize = PANEL / 2;
    for (p, (pos, out)) in codes
        .chunks_exact(HALF)
        .zip(dst.chunks_exact_mut(PANEL))
        .enumerate()
    {
        let scale = &scales[p / BLOCK * PANEL..][..PANEL];
        for (j, byte) in pos.iter().enumerate() {
            out[j] = E2M1[(byte & 0xF) as usize] * e8m0(scale[j]);
            out[j + HALF] = E2M1[(byte >> 4) as usize] * e8m0(scale[j + HALF]);
        }
    }
}

/// Positions per 64-byte line of codes: the SIMD versions prefetch once per line.
#[cfg(target_arch = "x86_64")]
const POSITIONS_PER_LINE: usize = 64 / (PANEL / 2);

/// At the first position `p` of each line of codes (at `pos`), prefetches the line the
/// microkernels' distance ahead (the codes stream as a bf16 panel does).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(pos: *const u8, p: usize) {
    use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
    if p.is_multiple_of(POSITIONS_PER_LINE) {
        let ahead = pos.wrapping_add(super::avx512::PREFETCH_BYTES);
        // SAFETY: a prefetch of any address is harmless (it never faults).
        unsafe { _mm_prefetch::<_MM_HINT_T2>(ahead as *const i8) };
    }
}

/// 16 lanes: the lookup is one `vpermps` of the whole table (it reads an index's low 4 bits, so
/// the low nibble needs no mask), the scale's bits the exponent shifted into place.
///
/// # Safety
/// The CPU supports AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen_avx512(codes: &[u8], scales: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    unsafe {
        let table = _mm512_loadu_ps(E2M1.as_ptr());
        let scale16 = |s: *const u8| {
            let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(s as *const __m128i));
            let bits = _mm512_slli_epi32::<23>(e);
            let zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            _mm512_castsi512_ps(_mm512_mask_mov_epi32(
                bits,
                zero,
                _mm512_set1_epi32(0x0040_0000),
            ))
        };
        for (b, block) in codes.chunks_exact(BLOCK * PANEL / 2).enumerate() {
            let s = scales.as_ptr().add(b * PANEL);
            let (s0, s1) = (scale16(s), scale16(s.add(16)));
            let out = dst.as_mut_ptr().add(b * BLOCK * PANEL);
            for p in 0..BLOCK {
                let pos = block.as_ptr().add(p * PANEL / 2);
                prefetch_ahead(pos, p);
                let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(pos as *const __m128i));
                let lo = _mm512_permutexvar_ps(idx, table);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), table);
                _mm512_storeu_ps(out.add(p * PANEL), _mm512_mul_ps(lo, s0));
                _mm512_storeu_ps(out.add(p * PANEL + 16), _mm512_mul_ps(hi, s1));
            }
        }
    }
}

/// 8 lanes: `vpermps` over the 8 magnitudes (it reads an index's low 3 bits) with the code's
/// bit 3 shifted into the sign.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(codes: &[u8], scales: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    unsafe {
        let magnitudes = _mm256_loadu_ps(E2M1.as_ptr());
        let sign = _mm256_set1_epi32(i32::MIN);
        let decode = |idx: __m256i| {
            let m = _mm256_castps_si256(_mm256_permutevar8x32_ps(magnitudes, idx));
            let s = _mm256_and_si256(_mm256_slli_epi32::<28>(idx), sign);
            _mm256_castsi256_ps(_mm256_or_si256(m, s))
        };
        let bytes8 = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let scale8 = |s: *const u8| {
            let e = bytes8(s);
            let bits = _mm256_slli_epi32::<23>(e);
            let zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
            let tiny = _mm256_and_si256(zero, _mm256_set1_epi32(0x0040_0000));
            _mm256_castsi256_ps(_mm256_or_si256(bits, tiny))
        };
        for (b, block) in codes.chunks_exact(BLOCK * PANEL / 2).enumerate() {
            let s = scales.as_ptr().add(b * PANEL);
            let sc = [
                scale8(s),
                scale8(s.add(8)),
                scale8(s.add(16)),
                scale8(s.add(24)),
            ];
            let out = dst.as_mut_ptr().add(b * BLOCK * PANEL);
            for p in 0..BLOCK {
                let pos = block.as_ptr().add(p * PANEL / 2);
                prefetch_ahead(pos, p);
                // Bytes 0..8 hold rows 0..8 (low) and 16..24 (high); bytes 8..16 rows 8..16
                // and 24..32.
                let (a, c) = (bytes8(pos), bytes8(pos.add(8)));
                let rows = [
                    decode(a),
                    decode(c),
                    decode(_mm256_srli_epi32::<4>(a)),
                    decode(_mm256_srli_epi32::<4>(c)),
                ];
                for (i, (v, s)) in rows.iter().zip(&sc).enumerate() {
                    _mm256_storeu_ps(out.add(p * PANEL + 8 * i), _mm256_mul_ps(*v, *s));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;

    /// Rows of pseudo-random bytes covering every value, and scales across the range.
    fn rows(n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
        let bytes = (0..n * k / 2).map(|i| (i * 97 + i / 256) as u8).collect();
        let scales = (0..n * k / BLOCK).map(|i| ((i * 37) % 255) as u8).collect();
        (bytes, scales)
    }

    fn panels(n: usize, k: usize, bytes: &[u8], scales: &[u8]) -> Mxfp4Panels {
        Mxfp4Panels::from_rows(n, k, |r| {
            (
                &bytes[r * k / 2..(r + 1) * k / 2],
                &scales[r * k / BLOCK..(r + 1) * k / BLOCK],
            )
        })
        .unwrap()
    }

    #[test]
    fn elements_are_the_definition_low_nibble_first() {
        let (n, k) = (40, 64);
        let (bytes, scales) = rows(n, k);
        let w = panels(n, k, &bytes, &scales);
        for r in 0..n {
            for p in 0..k {
                let byte = bytes[r * k / 2 + p / 2];
                let code = if p % 2 == 0 { byte & 0xF } else { byte >> 4 };
                let scale = 2f64.powi(i32::from(scales[r * k / BLOCK + p / BLOCK]) - 127);
                let want = f64::from(E2M1[code as usize]) * scale;
                assert_eq!(
                    w.value(r, p).to_bits(),
                    (want as f32).to_bits(),
                    "({r}, {p})"
                );
            }
        }
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(
            (e8m0(127), e8m0(128), e8m0(254)),
            (1.0, 2.0, 2f32.powi(127))
        );
    }

    #[test]
    fn simd_widening_equals_the_portable_one_bit_for_bit() {
        let (n, k) = (45, 96); // a padded second panel
        let (bytes, scales) = rows(n, k);
        let w = panels(n, k, &bytes, &scales);
        let mut isas = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") {
                isas.push(Isa::Avx512);
            }
            if has!("avx2") {
                isas.push(Isa::Avx2);
            }
        }
        for q in 0..w.num_panels() {
            let mut want = vec![0.0; k * PANEL];
            w.widen_block(Isa::Scalar, q, 0, k, &mut want);
            for p in 0..k {
                for c in 0..PANEL.min(n - q * PANEL) {
                    assert_eq!(
                        want[p * PANEL + c].to_bits(),
                        w.value(q * PANEL + c, p).to_bits()
                    );
                }
            }
            for &isa in &isas {
                let mut got = vec![f32::NAN; k * PANEL];
                w.widen_block(isa, q, 0, k, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa:?} panel {q}");
            }
        }
    }

    #[test]
    fn nan_scales_and_partial_blocks_are_refused() {
        let (bytes, mut scales) = rows(2, 64);
        scales[3] = 255;
        let err =
            Mxfp4Panels::from_rows(2, 64, |r| (&bytes[r * 32..][..32], &scales[r * 2..][..2]))
                .err()
                .unwrap();
        assert!(err.contains("row 1, elements 32..64: scale 255"), "{err}");
        let err = Mxfp4Panels::from_rows(1, 48, |_| (&bytes[..24], &scales[..1]))
            .err()
            .unwrap();
        assert!(err.contains("not whole blocks of 32"), "{err}");
    }
}
