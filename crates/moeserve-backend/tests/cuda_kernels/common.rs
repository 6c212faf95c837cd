//! The device under test, seeded inputs rounded to the element type, the tolerance table.

use std::sync::OnceLock;

use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaSlice};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;

/// The shared device, or `None` (with a note) when there is none and none is required.
pub fn gpu() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
    GPU.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => {
            b.load_all_kernels()
                .expect("the kernels compile and load on this device");
            Some(b)
        }
        Err(e)
            if std::env::var("MOESERVE_REQUIRE_GPU").is_ok_and(|v| v != "0" && !v.is_empty()) =>
        {
            panic!("MOESERVE_REQUIRE_GPU is set but there is no usable CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("no CUDA device, kernel test not run ({e})");
            None
        }
    })
    .as_ref()
}

/// Largest normalised mean squared error `Σ(got - want)² / Σ want²` per dtype, for one rounding
/// of the output to the element type (the inputs are already exactly representable).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-10,
        DType::F16 => 1e-6,
        DType::BF16 => 3e-5,
        DType::F8E4M3 | DType::Mxfp4 | DType::Int4 => {
            unreachable!("no device element is FP8, MXFP4 or int4")
        }
    }
}

/// The same for a chain of ops each rounding to the element type (attention, the MoE layer).
pub fn chained_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-8,
        DType::F16 => 1e-5,
        DType::BF16 => 3e-4,
        DType::F8E4M3 | DType::Mxfp4 | DType::Int4 => {
            unreachable!("no device element is FP8, MXFP4 or int4")
        }
    }
}

pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| ((g - w) as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    err / norm.max(f64::MIN_POSITIVE)
}

pub fn assert_close(op: &str, dtype: DType, got: &[f32], want: &[f32], tol: f64) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{op} {dtype}: non-finite output"
    );
    let e = nmse(got, want);
    assert!(e <= tol, "{op} {dtype}: NMSE {e:.3e} above {tol:.1e}");
}

/// Seeded values in [-scale, scale) (xorshift; no dependency).
pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `values` as `T`, and those exact values back in f32 (the reference's input).
pub fn rounded<T: CudaElement>(values: &[f32]) -> (Vec<T>, Vec<f32>) {
    let t: Vec<T> = values.iter().map(|v| T::from_f32(*v)).collect();
    let back = t.iter().map(|v| v.to_f32()).collect();
    (t, back)
}

pub fn upload<T: CudaElement>(gpu: &CudaBackend, values: &[T]) -> CudaSlice<T> {
    gpu.upload(values).expect("upload")
}

pub fn download_f32<T: CudaElement>(gpu: &CudaBackend, slice: &CudaSlice<T>) -> Vec<f32> {
    gpu.download(slice)
        .expect("download")
        .into_iter()
        .map(|v| v.to_f32())
        .collect()
}

/// A CPU [`Weight`] holding exactly `values` (already representable in `T`) as `T`.
pub fn weight_of<T: CudaElement>(shape: Vec<usize>, values: &[f32]) -> Weight {
    let bytes: Vec<u8> = match T::DTYPE {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F8E4M3 | DType::Mxfp4 | DType::Int4 => {
            unreachable!("no device element is FP8, MXFP4 or int4")
        }
    };
    Weight::new(T::DTYPE, shape, WeightBytes::owned(&bytes)).expect("weight")
}

/// Runs a generic test body once per element type: `name_f32`, `name_f16`, `name_bf16`.
#[macro_export]
macro_rules! for_each_dtype {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn f32() {
                super::$body::<f32>();
            }
            #[test]
            fn f16() {
                super::$body::<half::f16>();
            }
            #[test]
            fn bf16() {
                super::$body::<half::bf16>();
            }
        }
    };
}
