//! The CPU forward's kernel pool kept awake through a pass (see [`with_workers_awake`]).

/// `f` on a kernel pool thread while the pool's other workers are kept running: each spins,
/// taking `f`'s parallel work as soon as it is queued, instead of falling asleep between two
/// kernels and being woken for the next — a futex wake per kernel, which in a VM costs tens
/// of microseconds (a decode step forks about 100 times; batch-1 decode was 5–8 % faster for
/// it, bench/RESULTS.md). Joins, not spawned jobs, so that a step allocates nothing.
pub(crate) fn with_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Ends the spinning when `f` returns or unwinds.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    rayon::scope(|_| {
        let pass = rayon::current_thread_index();
        let done = AtomicBool::new(false);
        let spin = || spin_until(&done, pass);
        let spinners = rayon::current_num_threads() - 1;
        with_spinners(spinners, &spin, || {
            let _done = Done(&done);
            f()
        })
    })
}

/// `f` after queueing `spinners` jobs of `spin`, so that they are the oldest in this thread's
/// queue: the first jobs any other worker steals from it.
fn with_spinners<R: Send>(
    spinners: usize,
    spin: &(impl Fn() + Sync),
    f: impl FnOnce() -> R + Send,
) -> R {
    match spinners {
        0 => f(),
        n => rayon::join(|| with_spinners(n - 1, spin, f), spin).0,
    }
}

/// How long a spinner waits for work before it leaves: longer than the serial stretches
/// between a step's kernels, short enough that a job it interrupted (a worker that took the
/// spinner while waiting inside one of the pass's own jobs) is not held up for long.
const SPIN_IDLE: std::time::Duration = std::time::Duration::from_millis(2);

/// Runs whatever work the pool queues until `done`, or until [`SPIN_IDLE`] passes without
/// any. On the thread running the pass (`pass`, which takes queued jobs back while it waits
/// for its own), it leaves at once: the pass never waits for a spinner.
fn spin_until(done: &std::sync::atomic::AtomicBool, pass: Option<usize>) {
    use std::sync::atomic::Ordering;
    if rayon::current_thread_index() == pass {
        return;
    }
    let mut idle_since = std::time::Instant::now();
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = std::time::Instant::now();
        } else if idle_since.elapsed() > SPIN_IDLE {
            return;
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::with_workers_awake;
    use rayon::prelude::*;

    /// Kernels forked while the workers are kept awake run and give their results, whichever
    /// thread takes them (the pass's own thread included), and the pass ends: the spinners
    /// leave when it does. From inside and outside a pool, with 1 to 5 threads.
    #[test]
    fn workers_kept_awake_run_the_pass_and_leave_with_it() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pass = || -> Vec<u64> {
                with_workers_awake(|| {
                    (0..50u64)
                        .map(|step| (0..10_000u64).into_par_iter().map(|i| i * step).sum())
                        .collect()
                })
            };
            let mut all = Vec::new();
            for threads in 1..=5 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                all.push(pool.install(pass));
                all.push(pool.install(|| rayon::join(pass, pass).0));
            }
            all.push(pass());
            tx.send(all).unwrap();
        });
        let all = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("every pass ended");
        let want: Vec<u64> = (0..50u64).map(|step| step * 49_995_000).collect();
        assert_eq!(all.len(), 11);
        assert!(all.iter().all(|sums| *sums == want));
    }
}
