//! Expert parallelism's one communication interface: [`AllToAll`] carries each device's share
//! of a layer's (token, expert) pairs to it (dispatch), runs the device's experts on them, and
//! brings the outputs back (combine). [`InProcessAllToAll`] is the CPU implementation: one
//! rayon pool per device worker, `max(1, threads / N)` threads each; a NCCL implementation can
//! replace it without the model code changing.
//!
//! Work is per device: the gathered input rows and their segments, one per (physical slot,
//! spill pass), each computed as one GEMM per expert matrix.

use std::time::Instant;

use moeserve_backend::cpu;
use moeserve_core::ExpertId;

use super::experts::Expert;
use crate::{ModelError, Result};

/// A contiguous run of rows of a device's work that one physical slot computes in one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The logical expert the slot holds.
    pub expert: ExpertId,
    pub slot: usize,
    /// 0 for the main pass; spilled pairs run in later passes, each at most the capacity.
    pub pass: u32,
    pub num_rows: usize,
}

/// What one device computes for one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceWork {
    pub hidden: usize,
    /// `[num_rows, hidden]`: the rows of every segment, in segment order.
    pub input: Vec<f32>,
    pub segments: Vec<Segment>,
}

impl DeviceWork {
    pub fn num_rows(&self) -> usize {
        self.segments.iter().map(|s| s.num_rows).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}

/// What one device sends back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceOutput {
    /// `[num_rows, hidden]`: expert outputs, row for row with the work's input.
    pub output: Vec<f32>,
    /// Wall time of the device's expert compute.
    pub compute_seconds: f64,
}

/// Runs one device's work on that device: `(device index, work) -> output`.
pub type DeviceCompute<'a> = dyn Fn(usize, &DeviceWork) -> DeviceOutput + Sync + 'a;

/// Dispatch to and combine from the devices of one expert-parallel group.
pub trait AllToAll: Send + Sync {
    fn num_devices(&self) -> usize;

    /// Sends `work[d]` to device `d`, runs `compute(d, &work[d])` there, every device at once,
    /// and returns the outputs indexed by device.
    ///
    /// # Panics
    /// If `work` does not have one entry per device (a wiring bug).
    fn run(&self, work: Vec<DeviceWork>, compute: &DeviceCompute<'_>) -> Vec<DeviceOutput>;
}

/// Device workers in this process, each a rayon pool of its own.
pub struct InProcessAllToAll {
    pools: Vec<rayon::ThreadPool>,
}

impl InProcessAllToAll {
    /// `num_devices` workers sharing `total_threads`: `max(1, total_threads / num_devices)`
    /// threads each.
    pub fn new(num_devices: usize, total_threads: usize) -> Result<Self> {
        if num_devices == 0 {
            return Err(ModelError::ExpertParallel {
                message: "at least one device is needed".to_string(),
            });
        }
        let threads = (total_threads / num_devices).max(1);
        let pools = (0..num_devices)
            .map(|d| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("moeserve-ep{d}-{i}"))
                    .build()
                    .map_err(|e| ModelError::ExpertParallel {
                        message: format!("cannot start the threads of device {d}: {e}"),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(InProcessAllToAll { pools })
    }

    pub fn threads_per_device(&self) -> usize {
        self.pools[0].current_num_threads()
    }
}

impl AllToAll for InProcessAllToAll {
    fn num_devices(&self) -> usize {
        self.pools.len()
    }

    fn run(&self, work: Vec<DeviceWork>, compute: &DeviceCompute<'_>) -> Vec<DeviceOutput> {
        assert_eq!(work.len(), self.pools.len(), "one work item per device");
        let mut outputs: Vec<DeviceOutput> = vec![DeviceOutput::default(); work.len()];
        spawn_on_each(
            &self.pools,
            Jobs {
                first_device: 0,
                work: &work,
                outputs: &mut outputs,
                compute,
            },
        );
        outputs
    }
}

/// The devices' jobs not yet spawned.
struct Jobs<'a, 'c> {
    first_device: usize,
    work: &'a [DeviceWork],
    outputs: &'a mut [DeviceOutput],
    compute: &'a DeviceCompute<'c>,
}

/// Spawns device `d`'s job on pool `d` inside nested in-place scopes, so every device runs at
/// once and the caller returns when all are done; idle devices get no job. Inside a job,
/// the GEMMs' parallel loops run on that device's pool.
fn spawn_on_each(pools: &[rayon::ThreadPool], jobs: Jobs<'_, '_>) {
    let (Some((pool, other_pools)), Some((work, other_work))) =
        (pools.split_first(), jobs.work.split_first())
    else {
        return;
    };
    let (output, other_outputs) = jobs
        .outputs
        .split_first_mut()
        .expect("one output per work item");
    let (device, compute) = (jobs.first_device, jobs.compute);
    pool.in_place_scope(|scope| {
        if !work.is_empty() {
            scope.spawn(move |_| *output = compute(device, work));
        }
        let rest = Jobs {
            first_device: device + 1,
            work: other_work,
            outputs: other_outputs,
            compute,
        };
        spawn_on_each(other_pools, rest);
    });
}

/// Runs every segment of `work` through its expert (`expert_for`): all segments as one
/// grouped SwiGLU, each expert matrix read once.
pub fn compute_segments<'e>(
    work: &DeviceWork,
    expert_for: impl Fn(&Segment) -> &'e Expert + Sync,
) -> DeviceOutput {
    let mut out = DeviceOutput::default();
    // The device workers' threads keep the grouped SwiGLU's buffers in their thread-locals.
    compute_segments_into(work, expert_for, &mut out, None);
    out
}

/// [`compute_segments`] into `out`, with the grouped SwiGLU's buffers in `scratch` when the
/// caller keeps them (a forward's workspace), else in the thread's own.
pub(crate) fn compute_segments_into<'e>(
    work: &DeviceWork,
    expert_for: impl Fn(&Segment) -> &'e Expert + Sync,
    out: &mut DeviceOutput,
    scratch: Option<&mut cpu::GroupedScratch>,
) {
    let started = Instant::now();
    out.output.clear();
    out.output.resize(work.input.len(), 0.0);
    let experts = SegmentExperts {
        segments: &work.segments,
        expert_for,
        experts: std::marker::PhantomData,
    };
    match scratch {
        Some(scratch) => cpu::grouped_swiglu_in(&work.input, &experts, &mut out.output, scratch),
        None => cpu::grouped_swiglu(&work.input, &experts, &mut out.output),
    }
    out.compute_seconds = started.elapsed().as_secs_f64();
}

/// The segments of a device's work as the experts of a grouped SwiGLU.
struct SegmentExperts<'w, 'e, F> {
    segments: &'w [Segment],
    expert_for: F,
    /// The experts outlive the view (so a borrow of it can hand them out).
    experts: std::marker::PhantomData<&'e Expert>,
}

impl<'e, F: Fn(&Segment) -> &'e Expert + Sync> cpu::ExpertGroup for SegmentExperts<'_, 'e, F> {
    fn num_experts(&self) -> usize {
        self.segments.len()
    }

    fn expert(&self, i: usize) -> cpu::ExpertRows<'_> {
        let segment = &self.segments[i];
        (self.expert_for)(segment).rows(segment.num_rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(rows: &[f32]) -> DeviceWork {
        DeviceWork {
            hidden: 1,
            input: rows.to_vec(),
            segments: vec![Segment {
                expert: ExpertId(0),
                slot: 0,
                pass: 0,
                num_rows: rows.len(),
            }],
        }
    }

    #[test]
    fn every_device_gets_its_own_work_and_idle_devices_return_nothing() {
        let all = InProcessAllToAll::new(3, 6).unwrap();
        assert_eq!((all.num_devices(), all.threads_per_device()), (3, 2));
        let compute = |d: usize, w: &DeviceWork| DeviceOutput {
            output: w.input.iter().map(|x| x * 10.0 + d as f32).collect(),
            compute_seconds: 0.0,
        };
        let out = all.run(
            vec![work(&[1.0, 2.0]), DeviceWork::default(), work(&[3.0])],
            &compute,
        );
        assert_eq!(out[0].output, vec![10.0, 20.0]);
        assert!(out[1].output.is_empty());
        assert_eq!(out[2].output, vec![32.0]);
    }

    #[test]
    fn device_jobs_run_on_their_own_pools() {
        let all = InProcessAllToAll::new(2, 1).unwrap();
        assert_eq!(all.threads_per_device(), 1);
        let compute = |d: usize, _: &DeviceWork| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            assert!(name.starts_with(&format!("moeserve-ep{d}-")), "{name}");
            DeviceOutput {
                output: vec![rayon::current_num_threads() as f32],
                compute_seconds: 0.0,
            }
        };
        let out = all.run(vec![work(&[0.0]), work(&[0.0])], &compute);
        assert_eq!(out[0].output, vec![1.0]);
        assert_eq!(out[1].output, vec![1.0]);
    }

    #[test]
    fn zero_devices_are_refused() {
        assert!(matches!(
            InProcessAllToAll::new(0, 4),
            Err(ModelError::ExpertParallel { .. })
        ));
    }
}
