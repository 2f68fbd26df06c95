//! E2B compatibility: the stock `e2b` SDK's control plane (REST, `X-API-KEY`) and envd's data
//! plane (Connect RPCs with the JSON codec, `/files`, `/health`, `/envs`) on their own listener
//! (`rollbox serve --e2b-listen`), because E2B's `POST /sandboxes` means something else than the
//! native API's. Every call maps onto the daemon's own actions: its sandboxes, templates, TTLs
//! and store; the only state kept here is the table of processes started through envd and the
//! polled directory watchers (`CreateWatcher`).
//!
//! The data plane is translated here rather than served by the guest agent: the agent's
//! protocol already has every operation envd needs (exec with stdin, signals and PTYs, stat,
//! list, mkdir, move, remove, file streams, inotify watches), one translator serves every guest image and agent
//! version, and envd's processes must outlive the HTTP stream that started them while the agent
//! ends a connection's processes with the connection: the daemon owns those connections.
//!
//! A request is for the data plane when it names a sandbox: an `E2b-Sandbox-Id` header (SDK
//! 2.10+) or a host `{port}-{id}.{domain}`; everything else is the control plane. Ports other
//! than envd's are the guest's own services, reached as HTTP/1.1 over the agent's
//! `tcp_connect` (forward.rs). Wire facts: `shared/docs/e2b-compat.md`.
//!
//! The files: `control.rs` (the control plane; `list.rs` its sandbox list, `refusal.rs` its
//! refusals), `envd.rs` (the data plane's routes, with `process.rs`, `filesystem.rs`, `files.rs`
//! and `watch.rs` behind it, `call.rs` what a data-plane request carries, `entry.rs` envd's file
//! entries, `signature.rs` signed `/files` URLs and derived tokens, `multipart.rs` streamed
//! upload bodies),
//! `connect.rs` (the Connect protocol), `forward.rs` (other guest ports), `state.rs` (what
//! lives between requests), `volumes.rs` (E2B volumes and their content API, on the daemon's
//! volumes) and `wire.rs` (E2B's constants and HTTP helpers).

mod call;
pub mod connect;
mod control;
mod entry;
mod envd;
mod files;
mod filesystem;
mod forward;
mod list;
mod multipart;
mod network;
mod process;
mod refusal;
mod signature;
mod state;
mod volumes;
mod watch;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::{Request, Response};

use super::super::core::Core;
use super::conn::{self, ConnLimits, Gate};
pub use super::transport::TlsFiles;
use super::transport::{accept_tcp, tls_acceptor, Listen, Listener, Out, TransportError};
use state::E2b;

pub use wire::{DEFAULT_TIMEOUT_S, ENVD_PORT, ENVD_VERSION, ENV_VARS_KEY};

/// `rollbox serve --e2b-*` options.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// The E2B listener's address (loopback, or any with `tls`).
    pub listen: SocketAddr,
    /// The `domain` sandboxes report: the SDK sends data-plane traffic to
    /// `https://{port}-{id}.{domain}` unless `E2B_SANDBOX_URL` is set.
    pub domain: String,
    /// Serve TLS with this certificate chain and private key (PEM files).
    pub tls: Option<TlsFiles>,
}

/// The bound E2B listener, with its TLS acceptor when it serves TLS.
pub struct E2bListener {
    listener: Listener,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl E2bListener {
    pub fn describe(&self) -> String {
        let plain = self.listener.describe();
        match self.tls {
            Some(_) => plain.replacen("http://", "https://", 1),
            None => plain,
        }
    }
}

/// Binds the E2B listener (a loopback address, or any with TLS) and loads its TLS files.
pub fn bind(options: &E2bOptions) -> Result<E2bListener, TransportError> {
    let flags = ("--e2b-tls-cert", "--e2b-tls-key");
    let tls = options
        .tls
        .as_ref()
        .map(|files| tls_acceptor(files, flags))
        .transpose()?;
    Ok(E2bListener {
        listener: Listener::bind(
            &Listen::Tcp(options.listen),
            tls.is_some(),
            "--e2b-tls-cert and --e2b-tls-key",
        )?,
        tls,
    })
}

/// Serves E2B connections until the task is aborted, each held to `limits` (see [`conn`]).
pub async fn run(
    listener: E2bListener,
    core: Arc<Core>,
    api_key: String,
    options: E2bOptions,
    limits: ConnLimits,
) {
    let e2b = Arc::new(E2b {
        core,
        api_key,
        domain: options.domain,
        processes: Mutex::new(HashMap::new()),
        watchers: Mutex::new(HashMap::new()),
        next_watcher: std::sync::atomic::AtomicU64::new(1),
        accounts: Mutex::new(HashMap::new()),
    });
    let E2bListener {
        listener: Listener::Tcp(listener),
        tls,
    } = listener
    else {
        return;
    };
    let gate = Gate::new(limits.max_connections);
    loop {
        let stream = match accept_tcp(&listener).await {
            Ok(stream) => stream,
            Err(e) => {
                log::warn!("e2b accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // Full of connections that all have a request in progress: this one closes at once.
        let Some(ticket) = gate.admit() else {
            continue;
        };
        let e2b = Arc::clone(&e2b);
        let tls = tls.clone();
        let handle = move |request| {
            let e2b = Arc::clone(&e2b);
            async move { respond(&e2b, request).await }
        };
        tokio::spawn(conn::serve_tcp(stream, tls, ticket, limits, handle));
    }
}

async fn respond(e2b: &Arc<E2b>, request: Request<Incoming>) -> Response<Out> {
    match envd::data_plane_target(&request, &e2b.domain) {
        Some(target) => envd::respond(e2b, target, request).await,
        None => control::respond(e2b, request).await,
    }
}
