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
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hyper::body::Incoming;
use hyper::{Request, Response};

use super::super::core::Core;
use super::conn::{self, ConnLimits, Gate};
pub use super::transport::TlsFiles;
use super::transport::{tls_acceptor, Listen, Listener, Out, TransportError};
use state::E2b;

pub use wire::{DEFAULT_TIMEOUT_S, ENVD_PORT, ENVD_VERSION, ENV_VARS_KEY};

/// `rollbox serve --e2b-*` options.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// The E2B listener's TCP address (loopback, or any with `tls`), if any.
    pub listen: Option<SocketAddr>,
    /// A Unix socket for the same API (`--e2b-socket`), if any: what a `rollbox lease` in a
    /// pod reaches through a hostPath.
    pub socket: Option<PathBuf>,
    /// The `domain` sandboxes report: the SDK sends data-plane traffic to
    /// `https://{port}-{id}.{domain}` unless `E2B_SANDBOX_URL` is set.
    pub domain: String,
    /// Serve TLS on the TCP listener with this certificate chain and private key (PEM files).
    pub tls: Option<TlsFiles>,
}

/// The bound E2B listeners, the TCP one with its TLS acceptor when it serves TLS.
pub struct E2bListener {
    bound: Vec<(Listener, Option<tokio_rustls::TlsAcceptor>)>,
}

impl E2bListener {
    pub fn describe(&self) -> String {
        let names: Vec<String> = self
            .bound
            .iter()
            .map(|(listener, tls)| {
                let plain = listener.describe();
                match tls {
                    Some(_) => plain.replacen("http://", "https://", 1),
                    None => plain,
                }
            })
            .collect();
        names.join(" and ")
    }
}

/// Binds the E2B listeners (a loopback address, or any with TLS; a Unix socket) and loads
/// the TLS files.
pub fn bind(options: &E2bOptions) -> Result<E2bListener, TransportError> {
    let flags = ("--e2b-tls-cert", "--e2b-tls-key");
    let tls = options
        .tls
        .as_ref()
        .map(|files| tls_acceptor(files, flags))
        .transpose()?;
    let mut bound = Vec::new();
    if let Some(addr) = options.listen {
        let listener = Listener::bind(
            &Listen::Tcp(addr),
            tls.is_some(),
            "--e2b-tls-cert and --e2b-tls-key",
        )?;
        bound.push((listener, tls));
    }
    if let Some(path) = &options.socket {
        bound.push((
            Listener::bind(&Listen::Unix(path.clone()), false, "")?,
            None,
        ));
    }
    Ok(E2bListener { bound })
}

/// Serves E2B connections on every listener until the task is aborted, each held to
/// `limits` (see [`conn`]); the listeners share one state and one connection gate.
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
    let gate = Gate::new(limits.max_connections);
    let handle = move |request| {
        let e2b = Arc::clone(&e2b);
        async move { respond(&e2b, request).await }
    };
    let loops = listener.bound.into_iter().map(|(listener, tls)| {
        let gate = Arc::clone(&gate);
        let handle = handle.clone();
        async move {
            loop {
                conn::serve_next(&listener, tls.as_ref(), &gate, limits, handle.clone()).await;
            }
        }
    });
    futures_util::future::join_all(loops).await;
}

async fn respond(e2b: &Arc<E2b>, request: Request<Incoming>) -> Response<Out> {
    match envd::data_plane_target(&request, &e2b.domain) {
        Some(target) => envd::respond(e2b, target, request).await,
        None => control::respond(e2b, request).await,
    }
}
