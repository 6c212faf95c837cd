//! [`CudaMoeModel`] when the `cuda` feature is off (as the backend's `cuda_stub.rs`): the type
//! exists so the engine compiles unchanged, and [`CudaMoeModel::new`] says how to get CUDA.

use moeserve_backend::BackendError;
use moeserve_backend::cuda::CudaError;
use moeserve_backend::device::CudaDeviceInfo;
use moeserve_core::DType;

use super::decoder::{ForwardOptions, MoeModel};
use crate::batch::ForwardBatch;
use crate::kv_cache::KvCacheLayout;
use crate::{ModelError, Result};

/// A model on a CUDA device; never constructed without the feature.
pub struct CudaMoeModel {
    never: std::convert::Infallible,
}

impl CudaMoeModel {
    pub fn new(_model: &MoeModel, _layout: KvCacheLayout, _ordinal: usize) -> Result<Self> {
        Err(ModelError::Backend(BackendError::Cuda(
            CudaError::NotCompiled,
        )))
    }

    pub fn expert_parallel(
        model: &MoeModel,
        layout: KvCacheLayout,
        ordinal: usize,
    ) -> Result<Self> {
        Self::new(model, layout, ordinal)
    }

    pub fn with_dtype(
        model: &MoeModel,
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

    pub fn reserve(
        &mut self,
        _max_tokens: usize,
        _max_sequences: usize,
        _max_context: usize,
    ) -> Result<()> {
        match self.never {}
    }

    pub fn copy_block(&mut self, _src: usize, _dst: usize) -> Result<()> {
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
