//! The HTTP/1 accept loop, on hyper directly (axum's `serve-with-hyper` example), for the limits
//! `axum::serve` does not offer:
//!
//! - at most `--max-connections` open connections; more wait in the kernel's accept queue;
//! - the request head (request line and headers) at most `--max-header-bytes` (431 beyond) and
//!   received within `--request-read-timeout` (the connection is closed otherwise), so slow or
//!   idle clients cannot pin connections forever;
//! - `TCP_NODELAY`, so each streamed token leaves at once;
//! - half-closed connections served: a read-side EOF after a complete request is not a
//!   disconnect;
//! - a `Content-Length` hyper reserves (2^64 - 3 and up) answered 413 like any other body over
//!   the limit, not 431 ([`LengthGuard`]).
//!
//! [`accept`] runs until its stop future resolves and hands back the open connections, which
//! [`Connections::close`] lets finish their current response.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::length_guard::LengthGuard;

/// Connection limits of the listener.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub max_header_bytes: usize,
    pub header_read_timeout: Duration,
}

/// The connections open when the accept loop stopped.
pub struct Connections(GracefulShutdown);

impl Connections {
    /// Asks every connection to close after its current response (idle keep-alive ones close
    /// now) and waits for them, at most `grace`. Returns how many were still open then.
    pub async fn close(self, grace: Duration) -> usize {
        let count = self.0.count();
        match tokio::time::timeout(grace, self.0.shutdown()).await {
            Ok(()) => 0,
            Err(_) => count,
        }
    }
}

/// Accepts connections on `listener` and serves `app` on each until `stop` resolves.
pub async fn accept(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) -> Connections {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes)
        // A client that shuts down its write side after a complete request (`nc -N`, some
        // HTTP/1.0 scripts) still gets its answer: only a failed write or a reset cancels.
        .half_close(true);
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => {
                permit.expect("the connection semaphore is never closed")
            }
            () = &mut stop => break,
        };
        let socket = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => socket,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = socket.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let connection =
            graceful.watch(http.serve_connection(TokioIo::new(LengthGuard::new(socket)), service));
        tokio::spawn(async move {
            // Errors here are the client's (reset, timeout, malformed head): nothing to report.
            let _ = connection.await;
            drop(permit);
        });
    }
    Connections(graceful)
}
