//! Greedy sampling on the device.

use cudarc::driver::PushKernelArg;

use super::{check, check_len, per_row, typed};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// Greedy token and its log-probability per logits row: `[num_rows]` each.
pub fn argmax_logprob<T: CudaElement>(
    b: &CudaBackend,
    logits: CudaView<'_, T>,
    mut token_ids: CudaViewMut<'_, i32>,
    mut logprobs: CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    let rows = token_ids.len();
    check_len("argmax_logprob", "logprobs", logprobs.len(), rows)?;
    check(
        "argmax_logprob",
        rows > 0 && logits.len().is_multiple_of(rows),
        || "logits are not [num_rows, vocab]".into(),
    )?;
    let vocab = (logits.len() / rows) as i32;
    let f = typed(b, KernelFile::Sampling, "argmax_logprob", T::SUFFIX)?;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&logits)
        .arg(&mut token_ids)
        .arg(&mut logprobs)
        .arg(&vocab);
    // SAFETY: lengths checked.
    unsafe { l.launch(per_row(rows, 1024)) }?;
    Ok(())
}
