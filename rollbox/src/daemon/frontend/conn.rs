//! What every API connection is held to, on each listener (the Unix socket, the native TCP
//! address, the E2B one): a cap on open connections, a header-read timeout that also ends idle
//! keep-alive connections, and a TLS-handshake timeout. Then hyper serves the connection.
//!
//! The cap, and what happens past it: a new connection is always accepted, and when the
//! listener is full the oldest connection with no request in progress is closed to make room
//! (one still sending its headers, idle between requests, or in its TLS handshake). Only when
//! every connection has a request in progress is the new one closed at once. So idle or
//! slow connections (slowloris) cannot lock real clients out, however many there are, and the
//! descriptors stay bounded by the cap. Clients whose idle keep-alive connection is closed open
//! a new one, as they do after any idle close.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::oneshot;

use super::transport::{accept, Io, Listener, Out};

/// The default `--http-header-timeout`.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// The default `--tls-handshake-timeout`.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The default `--max-connections` (per listener).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// `rollbox serve --http-header-timeout`, `--tls-handshake-timeout` and `--max-connections`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// How long a client may take to send a request's headers, counted from when the server
    /// waits for them: from the connection's start, and after each response (so it is also
    /// the idle keep-alive timeout; hyper starts it when it polls for the next request head).
    pub header_timeout: Duration,
    /// How long a TLS handshake may take (the E2B listener with `--e2b-tls-cert`).
    pub tls_handshake_timeout: Duration,
    /// Open connections per listener (see the module doc for what happens past it).
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            tls_handshake_timeout: DEFAULT_TLS_HANDSHAKE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// One open connection as the gate sees it.
struct Slot {
    /// Requests in progress (a response body still being sent counts).
    busy: Arc<AtomicUsize>,
    /// Closes the connection.
    evict: Option<oneshot::Sender<()>>,
}

/// The connections of one listener, oldest first.
pub struct Gate {
    max: usize,
    next: AtomicU64,
    slots: Mutex<BTreeMap<u64, Slot>>,
}

/// An admitted connection; dropping it frees its place.
pub struct Ticket {
    gate: Arc<Gate>,
    id: u64,
    busy: Arc<AtomicUsize>,
    evicted: oneshot::Receiver<()>,
}

impl Gate {
    pub fn new(max: usize) -> Arc<Gate> {
        Arc::new(Gate {
            max: max.max(1),
            next: AtomicU64::new(0),
            slots: Mutex::new(BTreeMap::new()),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Slot>> {
        // A poisoned lock only means a panic mid-update of a plain map.
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a new connection, closing the oldest idle one when full; None when full of busy
    /// connections (the caller closes the new one).
    pub fn admit(self: &Arc<Self>) -> Option<Ticket> {
        let mut slots = self.slots();
        if slots.len() >= self.max {
            let idle = slots
                .iter()
                .find(|(_, slot)| slot.busy.load(Ordering::Acquire) == 0)
                .map(|(id, _)| *id)?;
            if let Some(mut slot) = slots.remove(&idle) {
                if let Some(evict) = slot.evict.take() {
                    let _ = evict.send(());
                }
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let busy = Arc::new(AtomicUsize::new(0));
        let (evict, evicted) = oneshot::channel();
        slots.insert(
            id,
            Slot {
                busy: Arc::clone(&busy),
                evict: Some(evict),
            },
        );
        Some(Ticket {
            gate: Arc::clone(self),
            id,
            busy,
            evicted,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.slots().len()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.slots().remove(&self.id);
    }
}

impl Ticket {
    /// Completes when the gate closes this connection to make room.
    pub async fn evicted(&mut self) {
        // A dropped sender (the slot went another way) is an eviction too.
        let _ = (&mut self.evicted).await;
    }
}

/// Counts a request as in progress until its response body is sent or dropped.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(count: &Arc<AtomicUsize>) -> Busy {
        count.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(count))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in progress.
pub struct Tracked {
    body: Out,
    _busy: Busy,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Serves one admitted connection with HTTP/1.1 (upgrades allowed) under `limits`, until it
/// ends or the gate closes it.
pub async fn serve<I, F, Fut>(io: I, mut ticket: Ticket, limits: ConnLimits, handle: F)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Out>> + Send + 'static,
{
    let busy = Arc::clone(&ticket.busy);
    let service = hyper::service::service_fn(move |request| {
        let guard = Busy::enter(&busy);
        let handle = handle.clone();
        async move {
            let response = handle(request).await;
            Ok::<_, Infallible>(response.map(|body| Tracked { body, _busy: guard }))
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let connection = http.serve_connection(io, service).with_upgrades();
    tokio::select! {
        _ = connection => {}
        () = ticket.evicted() => {}
    }
}

/// Accepts the next connection on `listener` and serves it on its own task (TCP through `tls`
/// when given). A connection past the gate's cap closes at once; a failed accept (EMFILE and
/// friends) backs off instead of spinning. Cancel-safe: nothing is awaited once a connection
/// is accepted.
pub async fn serve_next<F, Fut>(
    listener: &Listener,
    tls: Option<&tokio_rustls::TlsAcceptor>,
    gate: &Arc<Gate>,
    limits: ConnLimits,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Out>> + Send + 'static,
{
    let io = match accept(listener).await {
        Ok(io) => io,
        Err(e) => {
            log::warn!("accept on {}: {e}", listener.describe());
            tokio::time::sleep(Duration::from_millis(50)).await;
            return;
        }
    };
    // Full of connections that all have a request in progress: this one closes at once.
    let Some(ticket) = gate.admit() else {
        return;
    };
    match io {
        Io::Tcp(stream) => {
            tokio::spawn(serve_tcp(
                stream.into_inner(),
                tls.cloned(),
                ticket,
                limits,
                handle,
            ));
        }
        io => {
            tokio::spawn(serve(io, ticket, limits, handle));
        }
    }
}

/// Serves one admitted TCP connection, through `tls` when given (a failed or slow handshake:
/// a plain-HTTP client, an unknown CA, a client that sends nothing, ends the connection).
pub async fn serve_tcp<F, Fut>(
    stream: tokio::net::TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut ticket: Ticket,
    limits: ConnLimits,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Out>> + Send + 'static,
{
    match tls {
        None => serve(TokioIo::new(stream), ticket, limits, handle).await,
        Some(acceptor) => {
            if let Some(stream) = tls_handshake(&acceptor, stream, &mut ticket, limits).await {
                serve(TokioIo::new(stream), ticket, limits, handle).await;
            }
        }
    }
}

/// Runs a TLS handshake within the handshake timeout, unless the gate closes the connection
/// first; None when it fails, times out or is closed.
pub async fn tls_handshake<S>(
    acceptor: &tokio_rustls::TlsAcceptor,
    stream: S,
    ticket: &mut Ticket,
    limits: ConnLimits,
) -> Option<tokio_rustls::server::TlsStream<S>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    tokio::select! {
        accepted = tokio::time::timeout(limits.tls_handshake_timeout, acceptor.accept(stream)) => {
            accepted.ok()?.ok()
        }
        () = ticket.evicted() => None,
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, so the connection caps, not the
/// descriptor limit, decide; returns the soft limit now in force.
pub fn raise_nofile() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit from a struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_gate_closes_the_oldest_idle_connection() {
        let gate = Gate::new(2);
        let mut first = gate.admit().expect("room");
        let second = gate.admit().expect("room");
        let _busy = Busy::enter(&second.busy);
        let _third = gate.admit().expect("the idle first one makes room");
        assert_eq!(gate.open(), 2);
        assert!(first.evicted.try_recv().is_ok(), "the first was not closed");
        drop(first);
        assert_eq!(gate.open(), 2);
    }

    #[test]
    fn a_gate_full_of_busy_connections_refuses() {
        let gate = Gate::new(1);
        let only = gate.admit().expect("room");
        let _busy = Busy::enter(&only.busy);
        assert!(gate.admit().is_none());
        drop(_busy);
        assert!(gate.admit().is_some());
    }
}
