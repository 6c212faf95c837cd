//! Where the engine's forward runs: the CPU forward over a paged KV cache in host memory, or
//! the model on a CUDA device (sized for the engine's largest step at start-up).

use moeserve_backend::device::Device;
use moeserve_core::MoeConfig;
use moeserve_model::batch::ForwardBatch;
use moeserve_model::kv_cache::{KvCacheLayout, KvDtype, PagedKvCache};
use moeserve_model::models::{CudaMoeModel, ForwardOptions, ForwardWorkspace, MoeModel};

use crate::kv_cache::BlockCopy;
use crate::scheduler::SchedulerLimits;
use crate::{EngineError, Result};

/// The forward pass and the KV storage it reads and writes.
pub(crate) enum Executor {
    /// The CPU forward of the loaded model; keys and values in host memory, the step's
    /// buffers reused from step to step.
    Cpu {
        kv: PagedKvCache,
        workspace: Box<ForwardWorkspace>,
    },
    /// The model's weights and KV cache on a CUDA device.
    Cuda(Box<CudaMoeModel>),
}

impl Executor {
    pub(crate) fn new(
        model: &MoeModel,
        device: &Device,
        (layout, kv_dtype): (KvCacheLayout, KvDtype),
        moe: &MoeConfig,
        limits: &SchedulerLimits,
    ) -> Result<Self> {
        match device {
            Device::Cpu => {
                // Sized once for the largest step, so steps allocate nothing in the kernels.
                model.reserve_task_scratch(limits.max_num_batched_tokens, limits.max_model_len);
                Ok(Executor::Cpu {
                    kv: PagedKvCache::with_dtype(layout, kv_dtype),
                    workspace: Box::default(),
                })
            }
            Device::Cuda(info) => {
                // Expert parallelism puts device d's experts on GPU d.
                if moe.expert_parallel_size > info.num_devices {
                    return Err(EngineError::InvalidRequest {
                        field: "expert_parallel_size",
                        message: format!(
                            "{} GPUs asked for, this machine has {} ({info})",
                            moe.expert_parallel_size, info.num_devices
                        ),
                    });
                }
                // Refused here, at start-up, rather than at the first step.
                if moe.uses_expert_parallelism() && model.config().experts.bias {
                    return Err(EngineError::InvalidRequest {
                        field: "expert_parallel_size",
                        message: format!(
                            "{}: experts with biases (GPT-OSS) run on one GPU on CUDA so far; \
                             expert parallelism for them runs on the CPU (--device cpu)",
                            model.config().architecture
                        ),
                    });
                }
                // With expert parallelism each GPU holds only the experts placed on it.
                let mut gpu = if moe.uses_expert_parallelism() {
                    CudaMoeModel::expert_parallel(model, layout, info.ordinal)?
                } else {
                    CudaMoeModel::new(model, layout, info.ordinal)?
                };
                // Sized once for the largest step, so steps allocate nothing on the device.
                gpu.reserve(
                    limits.max_num_batched_tokens,
                    limits.max_num_seqs,
                    limits.max_model_len,
                )?;
                Ok(Executor::Cuda(Box::new(gpu)))
            }
        }
    }

    /// Copies a block's keys and values into another (a forked choice's partial block).
    pub(crate) fn copy_block(&mut self, copy: BlockCopy) -> Result<()> {
        let (src, dst) = (copy.src.0 as usize, copy.dst.0 as usize);
        match self {
            Executor::Cpu { kv, .. } => kv.copy_block(src, dst),
            Executor::Cuda(gpu) => gpu.copy_block(src, dst)?,
        }
        Ok(())
    }

    pub(crate) fn is_cuda(&self) -> bool {
        matches!(self, Executor::Cuda(_))
    }

    /// One forward pass of `model` over `batch`; its logits go to `logits` (the CPU's buffer
    /// swapped in, the GPU's copied back).
    pub(crate) fn forward(
        &mut self,
        model: &MoeModel,
        batch: &ForwardBatch<'_>,
        opts: ForwardOptions<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        match self {
            Executor::Cpu { kv, workspace } => {
                model.forward_in(batch, kv, opts, workspace)?;
                workspace.swap_logits(logits);
            }
            Executor::Cuda(gpu) => *logits = gpu.forward(batch, opts)?,
        }
        Ok(())
    }
}
