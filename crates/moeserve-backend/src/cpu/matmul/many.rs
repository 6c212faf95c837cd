//! Several products of one input (a layer's q, k and v) as one parallel job.

use super::matmul_wt_on;
#[cfg(target_arch = "x86_64")]
use super::{
    Dims, OutPtr, PANEL_OUT, QUANTIZED_X, Quantizer, TiledRows, for_each_task,
    integer_panel_product, pairs_panels, quantizer, weight_panel, weight_panel_pair, write_panel,
};
use crate::Weight;
#[cfg(target_arch = "x86_64")]
use crate::cpu::Isa;
use crate::cpu::isa;
#[cfg(target_arch = "x86_64")]
use crate::cpu::packed::PANEL;

/// `outs[i] = x · Wᵢᵀ` for `N` weights of the same input width (a layer's q, k and v
/// projections), as [`super::matmul_wt_in`] gives each, but as one parallel job: the input
/// tiled (or, for integer weights that quantize it alike, quantized) once, one fork-join for
/// all their panels instead of one per product. At batch 1 each of these products is tens of
/// microseconds, and a worker that fell asleep before one wakes late into it: a profile
/// found 31 % of their time on one thread. Integer weights that quantize their input
/// differently (GPTQ act-order) and the portable kernels run the products one by one.
pub fn matmul_wt_many<const N: usize>(
    x: &[f32],
    m: usize,
    products: [(&Weight, &mut [f32]); N],
    tiled: &mut Vec<f32>,
) {
    let isa = isa();
    let k = products.first().map_or(0, |(w, _)| w.shape()[1]);
    #[cfg(target_arch = "x86_64")]
    if isa.packs_weights() && m > 0 && k > 0 {
        let floats = (products.iter()).all(|(w, _)| {
            w.shape().len() == 2 && w.shape()[1] == k && quantizer(isa, w.packed()).is_none()
        });
        if floats {
            return run_floats(isa, x, m, k, products, tiled);
        }
        if let Some(how) = shared_quantizer(isa, k, &products) {
            return run_integers(how, x, m, k, products);
        }
    }
    for (w, out) in products {
        matmul_wt_on(isa, x, m, w, out, tiled);
    }
}

/// Float weights: `x` tiled once, one task per panel (or pair of panels) of every product.
#[cfg(target_arch = "x86_64")]
fn run_floats<const N: usize>(
    isa: Isa,
    x: &[f32],
    m: usize,
    k: usize,
    products: [(&Weight, &mut [f32]); N],
    tiled: &mut Vec<f32>,
) {
    let products = outputs(x, m, k, products);
    let x = TiledRows::pack(isa, x, m, k, tiled);
    let per_task = if pairs_panels(isa, m) { 2 } else { 1 };
    let tasks = products.map(|(_, _, d)| d.n.div_ceil(PANEL).div_ceil(per_task));
    for_each_product_task(&products, tasks, |(w, out, d), t| {
        let q = t * per_task;
        PANEL_OUT.with_borrow_mut(|acc| {
            acc.resize(per_task * m * PANEL, 0.0);
            let (a, b) = acc.split_at_mut(m * PANEL);
            if per_task == 2 && q + 1 < d.n.div_ceil(PANEL) {
                weight_panel_pair(isa, x, [(w, q, None), (w, q + 1, None)], a, b);
                // SAFETY: only this task computes panel q + 1 of this product.
                unsafe { write_panel(b, d, q + 1, out) };
            } else {
                weight_panel(isa, x, None, w, q, a);
            }
            // SAFETY: only this task computes panel q of this product.
            unsafe { write_panel(a, d, q, out) };
        })
    });
}

/// The quantizer every product takes its input through, when all are 2-D integer weights of
/// input width `k` that quantize it alike ([`Quantizer::same_as`]).
#[cfg(target_arch = "x86_64")]
fn shared_quantizer<'w, const N: usize>(
    isa: Isa,
    k: usize,
    products: &[(&'w Weight, &mut [f32]); N],
) -> Option<Quantizer<'w>> {
    let mut hows = products.iter().map(|(w, _)| {
        (w.shape().len() == 2 && w.shape()[1] == k)
            .then(|| quantizer(isa, w.packed()))
            .flatten()
    });
    let first = hows.next()??;
    hows.all(|how| how.is_some_and(|h| h.same_as(&first)))
        .then_some(first)
}

/// Integer weights that quantize their input alike: `x` quantized once, then one task per
/// panel of every product — each panel's sums as `run_integer` gives them, so the same bits
/// as the products one by one.
#[cfg(target_arch = "x86_64")]
fn run_integers<const N: usize>(
    how: Quantizer<'_>,
    x: &[f32],
    m: usize,
    k: usize,
    products: [(&Weight, &mut [f32]); N],
) {
    let products = outputs(x, m, k, products);
    let mut buf = QUANTIZED_X.take();
    let xq = buf.quantize(how, TiledRows::rows(x, m, k));
    let tasks = products.map(|(_, _, d)| d.n.div_ceil(PANEL));
    for_each_product_task(&products, tasks, |(w, out, d), q| {
        PANEL_OUT.with_borrow_mut(|acc| {
            acc.resize(m * PANEL, 0.0);
            integer_panel_product(w.packed(), xq, q, acc);
            // SAFETY: only this task computes panel q of this product.
            unsafe { write_panel(acc, d, q, out) };
        })
    });
    QUANTIZED_X.set(buf);
}

/// Each product's weight, output and sizes, checked against `x: [m, k]`.
#[cfg(target_arch = "x86_64")]
fn outputs<'w, const N: usize>(
    x: &[f32],
    m: usize,
    k: usize,
    products: [(&'w Weight, &mut [f32]); N],
) -> [(&'w Weight, OutPtr, Dims); N] {
    assert_eq!(x.len(), m * k, "matmul_wt_many: x is not {m}×{k}");
    products.map(|(w, out)| {
        let n = w.shape()[0];
        assert_eq!(out.len(), m * n, "matmul_wt_many: an output is not {m}×{n}");
        (w, OutPtr(out.as_mut_ptr()), Dims { m, n, k })
    })
}

/// `task(product, t)` for every task `t < tasks[i]` of every product `i`, as one parallel job.
#[cfg(target_arch = "x86_64")]
fn for_each_product_task<P: Copy + Sync, const N: usize>(
    products: &[(P, OutPtr, Dims); N],
    tasks: [usize; N],
    task: impl Fn((P, OutPtr, Dims), usize) + Sync + Send,
) {
    let all = Dims {
        n: products.iter().map(|(_, _, d)| d.n).sum(),
        ..products[0].2
    };
    for_each_task(tasks.iter().sum(), all, |mut t| {
        // The product this task belongs to, and its task there.
        let mut i = 0;
        while t >= tasks[i] {
            t -= tasks[i];
            i += 1;
        }
        task(products[i], t)
    });
}
