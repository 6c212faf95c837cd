//! [`CudaMixtral`] when the `cuda` feature is off (as the backend's `cuda_stub.rs`): the type
//! exists so the engine compiles unchanged, and [`CudaMixtral::new`] says how to get CUDA.

use moeserve_backend::BackendError;
use moeserve_backend::cuda::CudaError;
use moeserve_backend::device::CudaDeviceInfo;
use moeserve_core::DType;

use super::mixtral::{ForwardOptions, MixtralModel};
use crate::batch::ForwardBatch;
use crate::kv_cache::KvCacheLayout;
use crate::{ModelError, Result};

/// A Mixtral model on a CUDA device; never constructed without the feature.
pub struct CudaMixtral {
    never: std::convert::Infallible,
}

impl CudaMixtral {
    pub fn new(_model: &MixtralModel, _layout: KvCacheLayout, _ordinal: usize) -> Result<Self> {
        Err(ModelError::Backend(BackendError::Cuda(
            CudaError::NotCompiled,
        )))
    }

    pub fn with_dtype(
        model: &MixtralModel,
        layout: KvCacheLayout,
        ordinal: usize,
        _dtype: DType,
    ) -> Result<Self> {
        Self::new(model, layout, ordinal)
    }

    pub fn device(&self) -> &CudaDeviceInfo {
        match self.never {}
    }

    pub fn dtype(&self) -> DType {
        match self.never {}
    }

    pub fn forward(
        &mut self,
        _batch: &ForwardBatch<'_>,
        _opts: ForwardOptions<'_>,
    ) -> Result<Vec<f32>> {
        match self.never {}
    }
}
