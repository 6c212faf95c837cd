//! Graceful drain: the generation requests in flight are counted, so that shutdown can wait for
//! them to finish (`--shutdown-timeout`) and then cancel those still running.
//!
//! Each request holds an [`InFlight`] guard from the moment it is accepted until its response
//! is complete (a streamed body holds it until `[DONE]` or the client goes away).

use std::sync::Arc;

use tokio::sync::watch;

/// The in-flight count and the cancel signal, shared by the server and every request.
#[derive(Clone)]
pub struct Drain(Arc<Channels>);

struct Channels {
    in_flight: watch::Sender<usize>,
    cancelled: watch::Sender<bool>,
}

impl Default for Drain {
    fn default() -> Self {
        Drain(Arc::new(Channels {
            in_flight: watch::Sender::new(0),
            cancelled: watch::Sender::new(false),
        }))
    }
}

impl Drain {
    /// Counts one more request until the guard is dropped.
    pub fn enter(&self) -> InFlight {
        self.0.in_flight.send_modify(|n| *n += 1);
        InFlight(self.clone())
    }

    pub fn num_in_flight(&self) -> usize {
        *self.0.in_flight.borrow()
    }

    /// Resolves once no request is in flight.
    pub async fn wait_idle(&self) {
        let mut count = self.0.in_flight.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = count.wait_for(|&n| n == 0).await;
    }

    /// Tells every request in flight to stop now (they answer 503).
    pub fn cancel_all(&self) {
        self.0.cancelled.send_replace(true);
    }

    /// A receiver that turns `true` when [`Drain::cancel_all`] is called.
    pub fn cancelled(&self) -> watch::Receiver<bool> {
        self.0.cancelled.subscribe()
    }
}

/// One request in flight; dropping it counts the request out.
pub struct InFlight(Drain);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.0.in_flight.send_modify(|n| *n -= 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waits_until_every_guard_is_dropped() {
        let drain = Drain::default();
        let a = drain.enter();
        let b = drain.enter();
        assert_eq!(drain.num_in_flight(), 2);
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.wait_idle().await }
        });
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("idle once both are gone")
            .unwrap();
        assert_eq!(drain.num_in_flight(), 0);
    }

    #[tokio::test]
    async fn cancel_reaches_receivers_taken_before_and_after() {
        let drain = Drain::default();
        let mut before = drain.cancelled();
        drain.cancel_all();
        assert!(*before.wait_for(|&c| c).await.unwrap());
        assert!(*drain.cancelled().borrow());
    }
}
