//! The element types the kernels are instantiated for, and how Rust names them.

use cudarc::cublas::result::CublasError;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::NcclType;
use half::{bf16, f16};
use moeserve_core::DType;

/// An activation / weight element type on the device: f32, f16 or bf16. Kernels compute in f32
/// and read and write `Self`; their `extern "C"` names end in [`CudaElement::SUFFIX`].
/// NCCL carries it between GPUs (expert parallelism).
pub trait CudaElement:
    DeviceRepr + ValidAsZeroBits + NcclType + Copy + Default + Unpin + Send + Sync + 'static
{
    const SUFFIX: &'static str;
    const DTYPE: DType;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;

    /// cuBLAS GEMM on this type (f32 accumulation); `CudaBlas: Gemm<Self>` spelled as a method,
    /// since a trait's `where` bound on another type is not implied at its uses.
    ///
    /// # Safety
    /// As `cudarc::cublas::Gemm::gemm`: the config must fit the buffers.
    unsafe fn gemm<A: DevicePtr<Self>, B: DevicePtr<Self>, C: DevicePtrMut<Self>>(
        blas: &CudaBlas,
        cfg: GemmConfig<Self>,
        a: &A,
        b: &B,
        c: &mut C,
    ) -> Result<(), CublasError>;

    /// cuBLAS strided batched GEMM on this type, as [`CudaElement::gemm`].
    ///
    /// # Safety
    /// As `cudarc::cublas::Gemm::gemm_strided_batched`: the config must fit the buffers.
    unsafe fn gemm_strided_batched<A: DevicePtr<Self>, B: DevicePtr<Self>, C: DevicePtrMut<Self>>(
        blas: &CudaBlas,
        cfg: StridedBatchedConfig<Self>,
        a: &A,
        b: &B,
        c: &mut C,
    ) -> Result<(), CublasError>;
}

macro_rules! element {
    ($t:ty, $suffix:literal, $dtype:expr, $from:expr, $to:expr) => {
        impl CudaElement for $t {
            const SUFFIX: &'static str = $suffix;
            const DTYPE: DType = $dtype;
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            fn to_f32(self) -> f32 {
                $to(self)
            }
            unsafe fn gemm<A: DevicePtr<Self>, B: DevicePtr<Self>, C: DevicePtrMut<Self>>(
                blas: &CudaBlas,
                cfg: GemmConfig<Self>,
                a: &A,
                b: &B,
                c: &mut C,
            ) -> Result<(), CublasError> {
                // SAFETY: forwarded; the caller upholds `Gemm::gemm`'s contract.
                unsafe { <CudaBlas as Gemm<$t>>::gemm(blas, cfg, a, b, c) }
            }
            unsafe fn gemm_strided_batched<
                A: DevicePtr<Self>,
                B: DevicePtr<Self>,
                C: DevicePtrMut<Self>,
            >(
                blas: &CudaBlas,
                cfg: StridedBatchedConfig<Self>,
                a: &A,
                b: &B,
                c: &mut C,
            ) -> Result<(), CublasError> {
                // SAFETY: forwarded; the caller upholds the contract.
                unsafe { <CudaBlas as Gemm<$t>>::gemm_strided_batched(blas, cfg, a, b, c) }
            }
        }
    };
}

element!(f32, "f32", DType::F32, |v| v, |v| v);
element!(f16, "f16", DType::F16, f16::from_f32, f16::to_f32);
element!(bf16, "bf16", DType::BF16, bf16::from_f32, bf16::to_f32);
