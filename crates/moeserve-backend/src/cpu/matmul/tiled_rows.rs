//! Activation rows laid out for the panel microkernels ([`TiledRows`]), and the row tiles they
//! are cut into ([`row_tiles`]).

use rayon::prelude::*;

use super::max_rows_per_tile;
use crate::cpu::Isa;
use crate::cpu::packed::PANEL;

/// Activation rows `[m, k]` in the order the microkernels read them: cut into the row tiles of
/// [`row_tiles`], each tile's rows interleaved position by position, so a tile reads one
/// contiguous stream with the rows at constant offsets (no per-row address arithmetic in the
/// inner loop). The tile of rows `i0 .. i0 + mr` starts at `i0 · k`; row `i0 + i` at position
/// `p` is element `i0 · k + p · mr + i`.
///
/// ```text
/// tile (i0, mr=3):  x[i0][0] x[i0+1][0] x[i0+2][0] | x[i0][1] x[i0+1][1] x[i0+2][1] | …
/// ```
#[derive(Clone, Copy)]
pub(in crate::cpu) struct TiledRows<'a> {
    pub data: &'a [f32],
    pub m: usize,
    pub k: usize,
    /// The row-tile limit of the ISA the tiles were cut for.
    pub max_mr: usize,
}

impl<'a> TiledRows<'a> {
    /// `x: [m, k]` rearranged into `buf` for the microkernels of `isa`.
    pub fn pack(isa: Isa, x: &[f32], m: usize, k: usize, buf: &'a mut Vec<f32>) -> Self {
        buf.resize(m * k, 0.0);
        Self::pack_into(isa, x, m, k, buf)
    }

    /// `x: [m, k]` rearranged into `out` (`m · k` elements).
    pub fn pack_into(isa: Isa, x: &[f32], m: usize, k: usize, out: &'a mut [f32]) -> Self {
        debug_assert!(x.len() == m * k && out.len() == m * k);
        let max_mr = max_rows_per_tile(isa);
        // Tiles are consecutive chunks of `out`; each is written in order, reading its rows
        // side by side (a few sequential streams).
        let pack_tile = |(i0, mr, tile): (usize, usize, &mut [f32])| {
            let rows = &x[i0 * k..(i0 + mr) * k];
            for (p, column) in tile.chunks_exact_mut(mr).enumerate() {
                for (i, v) in column.iter_mut().enumerate() {
                    *v = rows[i * k + p];
                }
            }
        };
        let mut rest = &mut *out;
        let tiles = row_tiles(m, max_mr).map(|(i0, mr)| {
            let (tile, tail) = std::mem::take(&mut rest).split_at_mut(mr * k);
            rest = tail;
            (i0, mr, tile)
        });
        if m * k < 1 << 16 {
            tiles.for_each(pack_tile); // decode: no task list to allocate
        } else {
            tiles
                .collect::<Vec<_>>()
                .into_par_iter()
                .for_each(pack_tile);
        }
        Self::already_tiled(isa, out, m, k)
    }

    /// `data` already in the tile order of `isa` (see [`Self::scatter_columns`]).
    pub fn already_tiled(isa: Isa, data: &'a [f32], m: usize, k: usize) -> Self {
        debug_assert_eq!(data.len(), m * k);
        TiledRows {
            data,
            m,
            k,
            max_mr: max_rows_per_tile(isa),
        }
    }

    /// Row `i`: its position 0 onward and the distance between its positions (the tile's
    /// rows); position `p` is element `p · stride`.
    pub fn row(&self, i: usize) -> (&'a [f32], usize) {
        let (i0, mr) = tile_of(self.m, self.max_mr, i);
        (&self.data[i0 * self.k + i - i0..], mr)
    }

    /// `x: [m, k]` row-major as tiles of one row (how [`run_integer`] reads a product's
    /// input).
    pub(in crate::cpu) fn rows(data: &'a [f32], m: usize, k: usize) -> Self {
        TiledRows {
            data,
            m,
            k,
            max_mr: 1,
        }
    }

    /// Writes `cols` columns of `src: [m, PANEL]` (row-major) as positions `p0 .. p0 + cols` of
    /// the tiled layout of `m` rows of `k` positions in `dst` — how a product's output panel
    /// becomes the next product's tiled input.
    ///
    /// # Safety
    /// `dst` points at `m · k` elements and no other thread writes these positions.
    pub unsafe fn scatter_columns(
        isa: Isa,
        src: &[f32],
        (m, k): (usize, usize),
        (p0, cols): (usize, usize),
        dst: *mut f32,
    ) {
        for (i0, mr) in row_tiles(m, max_rows_per_tile(isa)) {
            // The tile's positions p0 .. p0 + cols are one contiguous run of cols × mr.
            // SAFETY: inside the tile of rows i0..i0+mr, positions < k (caller).
            let run =
                unsafe { std::slice::from_raw_parts_mut(dst.add(i0 * k + p0 * mr), cols * mr) };
            let rows = &src[i0 * PANEL..(i0 + mr) * PANEL];
            for (c, column) in run.chunks_exact_mut(mr).enumerate() {
                for (i, v) in column.iter_mut().enumerate() {
                    *v = rows[i * PANEL + c];
                }
            }
        }
    }
}

/// `m` rows cut into the fewest tiles of at most `max_mr` rows, sizes as equal as possible
/// (11 rows run as one tile of 11, not 8 + 3): `(first row, rows)`.
pub(in crate::cpu) fn row_tiles(m: usize, max_mr: usize) -> impl Iterator<Item = (usize, usize)> {
    // One tile without dividing: this runs for every block of every product (batch 1's too).
    let count = if m <= max_mr { 1 } else { m.div_ceil(max_mr) };
    let (base, extra) = if count == 1 {
        (m, 0)
    } else {
        (m / count, m % count)
    };
    (0..count).map(move |t| (t * base + t.min(extra), base + usize::from(t < extra)))
}

/// The tile of [`row_tiles`]`(m, max_mr)` that holds row `i`: `(first row, rows)`.
pub(in crate::cpu) fn tile_of(m: usize, max_mr: usize, i: usize) -> (usize, usize) {
    debug_assert!(i < m);
    let count = m.div_ceil(max_mr).max(1);
    let (base, extra) = (m / count, m % count);
    // The first `extra` tiles hold base + 1 rows.
    let t = if i < extra * (base + 1) {
        i / (base + 1)
    } else {
        extra + (i - extra * (base + 1)) / base
    };
    (t * base + t.min(extra), base + usize::from(t < extra))
}
