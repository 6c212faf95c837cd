//! Online expert re-placement (EPLB) in the step loop. After a step: if the windowed imbalance
//! exceeds `--rebalance-threshold`, the last re-placement is at least `--rebalance-interval`
//! steps old and `RebalancePolicy` finds the predicted gain worth the copies, plan a placement
//! (`eplb::plan`) and build its device arenas on a background thread (the weight copies). The
//! loop only polls a channel: a finished build is swapped in between two steps, so serving
//! never waits for a copy. Each re-placement is recorded, and its realised imbalance measured
//! over the window after the swap.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, TryRecvError};

use moeserve_core::{ExpertPlacement, MoeConfig};
use moeserve_model::moe::ExpertParallel;

use crate::assets::ModelAssets;
use crate::placement::{
    Decision, LoadTracker, RebalanceCandidate, RebalancePolicy, RebalanceRecord, bytes_to_move,
    plan, step_imbalance,
};

/// Re-placements kept for reports.
const KEPT_RECORDS: usize = 16;

/// The slots a plan must fill.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotShape {
    pub(crate) num_devices: usize,
    /// Slots per layer: experts + redundant.
    pub(crate) num_physical: usize,
    /// Bytes of one expert's weights.
    pub(crate) expert_bytes: u64,
}

/// A re-placement whose arenas are being built.
struct Pending {
    built: Receiver<moeserve_model::Result<ExpertParallel>>,
    record: RebalanceRecord,
}

/// What one finished step shows the rebalancer.
pub(crate) struct StepView<'a> {
    pub(crate) step: u64,
    pub(crate) tracker: &'a LoadTracker,
    /// Measured expert seconds per step (slowest device, summed over layers).
    pub(crate) expert_seconds_per_step: f64,
}

pub(crate) struct Rebalancer {
    policy: RebalancePolicy,
    shape: SlotShape,
    window: usize,
    /// Step of the last swap; 0 before the first.
    last_swap: u64,
    pending: Option<Pending>,
    records: VecDeque<RebalanceRecord>,
    /// The step at which the newest record's realised imbalance is measured.
    realise_at: Option<u64>,
    pub(crate) num_rebalances: u64,
    pub(crate) num_failures: u64,
    pub(crate) last_error: Option<String>,
}

impl Rebalancer {
    pub(crate) fn new(config: &MoeConfig, shape: SlotShape) -> Self {
        Rebalancer {
            policy: RebalancePolicy {
                threshold: config.rebalance_threshold,
                interval_steps: config.rebalance_interval,
                min_gain: config.rebalance_min_gain,
                copy_bytes_per_second: config.expert_copy_bytes_per_second,
            },
            shape,
            window: config.load_window,
            last_swap: 0,
            pending: None,
            records: VecDeque::new(),
            realise_at: None,
            num_rebalances: 0,
            num_failures: 0,
            last_error: None,
        }
    }

    pub(crate) fn in_progress(&self) -> bool {
        self.pending.is_some()
    }

    pub(crate) fn records(&self) -> Vec<RebalanceRecord> {
        self.records.iter().copied().collect()
    }

    /// The finished re-placement, if one is ready: the caller swaps it in before `step + 1`.
    pub(crate) fn poll(&mut self, step: u64) -> Option<ExpertParallel> {
        let pending = self.pending.as_ref()?;
        let built = match pending.built.try_recv() {
            Err(TryRecvError::Empty) => return None,
            Ok(built) => built.map_err(|e| e.to_string()),
            Err(TryRecvError::Disconnected) => Err("the re-placement thread stopped".to_string()),
        };
        let mut record = self.pending.take().expect("checked above").record;
        match built {
            Ok(experts) => {
                record.step = step;
                record.bytes_moved = experts.bytes_copied();
                self.push_record(record);
                self.num_rebalances += 1;
                self.last_swap = step;
                self.realise_at = Some(step + self.window as u64);
                Some(experts)
            }
            Err(message) => {
                self.fail(message);
                None
            }
        }
    }

    /// Fills in the realised imbalance once a whole window ran under the new placement.
    pub(crate) fn observe(
        &mut self,
        step: u64,
        tracker: &LoadTracker,
        placement: &ExpertPlacement,
    ) {
        if self.realise_at.is_some_and(|at| step >= at) {
            self.realise_at = None;
            if let Some(last) = self.records.back_mut() {
                last.realised_imbalance = Some(step_imbalance(&tracker.windowed(), placement));
            }
        }
    }

    /// Starts a background re-placement when the policy says it pays off.
    pub(crate) fn consider(
        &mut self,
        view: &StepView<'_>,
        current: &Arc<ExpertParallel>,
        assets: &Arc<ModelAssets>,
    ) {
        if self.pending.is_some() {
            return;
        }
        let windowed = view.tracker.windowed();
        if windowed.num_steps < self.window {
            return;
        }
        let placement = current.placement();
        let current_imbalance = step_imbalance(&windowed, placement);
        let steps_since_last = view.step.saturating_sub(self.last_swap);
        if current_imbalance <= self.policy.threshold
            || steps_since_last < self.policy.interval_steps
        {
            return;
        }
        let planned = match plan(&windowed, self.shape.num_devices, self.shape.num_physical) {
            Ok(planned) => planned,
            Err(e) => return self.fail(e.to_string()),
        };
        let candidate = RebalanceCandidate {
            current_imbalance,
            predicted_imbalance: step_imbalance(&windowed, &planned),
            steps_since_last,
            bytes_to_move: bytes_to_move(placement, &planned, self.shape.expert_bytes),
            expert_seconds_per_step: view.expert_seconds_per_step,
        };
        if let Decision::Rebalance { .. } = self.policy.should_rebalance(&candidate) {
            let record = RebalanceRecord {
                step: view.step,
                imbalance_before: current_imbalance,
                predicted_imbalance: candidate.predicted_imbalance,
                realised_imbalance: None,
                bytes_moved: candidate.bytes_to_move,
            };
            self.start(current.clone(), assets.clone(), planned, record);
        }
    }

    /// Builds the new arenas layer by layer on a thread of their own.
    fn start(
        &mut self,
        current: Arc<ExpertParallel>,
        assets: Arc<ModelAssets>,
        planned: ExpertPlacement,
        record: RebalanceRecord,
    ) {
        let (send, built) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("moeserve-eplb".into())
            .spawn(move || {
                let layers = assets.model.moe_layers();
                // The step loop may have stopped listening; nothing is lost then.
                let _ = send.send(current.replace(&layers, planned));
            });
        match spawned {
            Ok(_) => self.pending = Some(Pending { built, record }),
            Err(e) => self.fail(format!("cannot start the re-placement thread: {e}")),
        }
    }

    fn fail(&mut self, message: String) {
        self.num_failures += 1;
        self.last_error = Some(message);
    }

    fn push_record(&mut self, record: RebalanceRecord) {
        if self.records.len() == KEPT_RECORDS {
            self.records.pop_front();
        }
        self.records.push_back(record);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use moeserve_model::ModelError;
    use moeserve_model::models::MoeModel;
    use moeserve_model::moe::InProcessAllToAll;

    use super::*;

    fn rebalancer() -> Rebalancer {
        let config = MoeConfig {
            expert_parallel_size: 2,
            load_window: 3,
            ..Default::default()
        };
        let shape = SlotShape {
            num_devices: 2,
            num_physical: 8,
            expert_bytes: 100,
        };
        Rebalancer::new(&config, shape)
    }

    fn record(step: u64) -> RebalanceRecord {
        RebalanceRecord {
            step,
            imbalance_before: 1.5,
            predicted_imbalance: 1.1,
            realised_imbalance: None,
            bytes_moved: 0,
        }
    }

    /// A pending build whose result is already `built`.
    fn pending(r: &mut Rebalancer, built: moeserve_model::Result<ExpertParallel>) {
        let (send, receive) = mpsc::channel();
        send.send(built).unwrap();
        r.pending = Some(Pending {
            built: receive,
            record: record(3),
        });
    }

    #[test]
    fn a_finished_build_is_swapped_in_and_its_window_measured() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mixtral-swa");
        let model = MoeModel::load(&dir).unwrap();
        let placement = ExpertPlacement::round_robin(2, 8, 2, 0).unwrap();
        let exchange = Arc::new(InProcessAllToAll::new(2, 2).unwrap());
        let experts =
            ExpertParallel::new(&model.moe_layers(), placement.clone(), exchange).unwrap();
        let mut r = rebalancer();
        pending(&mut r, Ok(experts));
        assert!(r.in_progress());
        let swapped = r.poll(7).expect("the build is done");
        assert_eq!(swapped.placement(), &placement);
        assert!(!r.in_progress());
        assert_eq!((r.num_rebalances, r.records()[0].step), (1, 7));
        let mut tracker = LoadTracker::new(2, 8, 3);
        for _ in 0..3 {
            tracker.record_step(0, &[4, 0, 0, 0, 0, 0, 0, 0]);
            tracker.record_step(1, &[1; 8]);
        }
        r.observe(9, &tracker, &placement);
        assert_eq!(
            r.records()[0].realised_imbalance,
            None,
            "the window is not over"
        );
        r.observe(10, &tracker, &placement);
        let realised = r.records()[0].realised_imbalance.unwrap();
        assert!(realised > 1.0, "{realised}");
    }

    #[test]
    fn a_failed_build_is_counted_and_nothing_is_swapped() {
        let mut r = rebalancer();
        let error = ModelError::ExpertParallel {
            message: "out of memory".to_string(),
        };
        pending(&mut r, Err(error));
        assert!(r.poll(5).is_none());
        assert_eq!((r.num_rebalances, r.num_failures), (0, 1));
        assert!(r.last_error.as_deref().unwrap().contains("out of memory"));
        assert!(r.poll(6).is_none(), "nothing pending any more");
    }

    #[test]
    fn only_the_latest_records_are_kept() {
        let mut r = rebalancer();
        for step in 0..20 {
            r.push_record(record(step));
        }
        let steps: Vec<u64> = r.records().iter().map(|r| r.step).collect();
        assert_eq!(steps, (4..20).collect::<Vec<_>>());
    }
}
