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

pub mod connect;
mod control;
mod envd;
mod forward;
mod watch;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};

use super::core::Core;
use super::http::{Listener, Out};
use super::{DaemonError, Listen};

/// The envd version rollbox reports: the newest whose features the façade implements
/// (octet-stream and gzip uploads, CloseStdin: 0.5.7; file metadata xattrs, 0.6.2, are not).
pub const ENVD_VERSION: &str = "0.5.7";
/// envd's port in E2B sandboxes, served here; other ports go to the guest through the agent.
pub const ENVD_PORT: u16 = 49983;
/// Sandbox TTL when a create gives no `timeout` (the SDK's own default).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The native metadata key where sandboxes made by the first E2B slice kept their `envVars`
/// (JSON); sandboxes made since keep them as the daemon's sandbox `env`.
pub const ENV_VARS_KEY: &str = "e2b.envVars";

/// `rollbox serve --e2b-*` options.
#[derive(Debug, Clone)]
pub struct E2bOptions {
    /// Loopback address of the E2B listener.
    pub listen: SocketAddr,
    /// The `domain` sandboxes report: the SDK sends data-plane traffic to
    /// `https://{port}-{id}.{domain}` unless `E2B_SANDBOX_URL` is set.
    pub domain: String,
    /// Serve TLS with this certificate chain and private key (PEM files).
    pub tls: Option<TlsFiles>,
}

/// `--e2b-tls-cert` and `--e2b-tls-key`.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
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

/// The TLS acceptor for `files` (HTTP/1.1 only in ALPN; the SDK's clients accept that).
fn tls_acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor, DaemonError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let fail = |what: &str, path: &std::path::Path, e: String| DaemonError::Listen {
        what: format!("E2B TLS ({what} {})", path.display()),
        source: std::io::Error::other(e),
    };
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| fail("--e2b-tls-cert", &files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(fail(
            "--e2b-tls-cert",
            &files.cert,
            "no CERTIFICATE in the file".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| fail("--e2b-tls-key", &files.key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail("--e2b-tls-cert", &files.cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| fail("--e2b-tls-key", &files.key, e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// The E2B server's state: the daemon, and processes started through envd.
pub(crate) struct E2b {
    core: Arc<Core>,
    /// The daemon's API key: E2B's `X-API-KEY`, and where envd access tokens come from.
    api_key: String,
    options: E2bOptions,
    processes: Mutex<envd::Processes>,
    /// `CreateWatcher` watchers, by id.
    watchers: Mutex<watch::Watchers>,
    /// Numbers watcher ids.
    next_watcher: std::sync::atomic::AtomicU64,
}

impl E2b {
    fn processes(&self) -> MutexGuard<'_, envd::Processes> {
        self.processes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn watchers(&self) -> MutexGuard<'_, watch::Watchers> {
        self.watchers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The envd access token of sandbox `id`: derived from the API key, so it survives a
    /// daemon restart and needs no storage.
    fn access_token(&self, id: &str) -> String {
        use sha2::Digest as _;
        let mut hash = sha2::Sha256::new();
        hash.update(b"rollbox-e2b-envd\0");
        hash.update(self.api_key.trim().as_bytes());
        hash.update(b"\0");
        hash.update(id.as_bytes());
        hash.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Binds the E2B listener (loopback only, like the native API) and loads its TLS files.
pub fn bind(options: &E2bOptions) -> Result<E2bListener, DaemonError> {
    let tls = options.tls.as_ref().map(tls_acceptor).transpose()?;
    Ok(E2bListener {
        listener: Listener::bind(&Listen::Tcp(options.listen))?,
        tls,
    })
}

/// Serves E2B connections until the task is aborted.
pub async fn run(listener: E2bListener, core: Arc<Core>, api_key: String, options: E2bOptions) {
    let e2b = Arc::new(E2b {
        core,
        api_key,
        options,
        processes: Mutex::new(HashMap::new()),
        watchers: Mutex::new(HashMap::new()),
        next_watcher: std::sync::atomic::AtomicU64::new(1),
    });
    let E2bListener {
        listener: Listener::Tcp(listener),
        tls,
    } = listener
    else {
        return;
    };
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                log::warn!("e2b accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let e2b = Arc::clone(&e2b);
        let tls = tls.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let e2b = Arc::clone(&e2b);
                async move { Ok::<_, Infallible>(respond(&e2b, request).await) }
            });
            let http = hyper::server::conn::http1::Builder::new();
            match tls {
                None => {
                    let _ = http
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                }
                Some(acceptor) => {
                    // A failed handshake (a plain-HTTP client, an unknown CA) ends the connection.
                    if let Ok(stream) = acceptor.accept(stream).await {
                        let _ = http
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await;
                    }
                }
            }
        });
    }
}

async fn respond(e2b: &Arc<E2b>, request: Request<Incoming>) -> Response<Out> {
    match data_plane_target(&request, &e2b.options.domain) {
        Some(target) => envd::respond(e2b, target, request).await,
        None => control::respond(e2b, request).await,
    }
}

/// The sandbox and port a data-plane request is for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    id: String,
    port: Option<u16>,
}

fn header<'a>(request: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    request.headers().get(name).and_then(|v| v.to_str().ok())
}

fn data_plane_target(request: &Request<Incoming>, domain: &str) -> Option<Target> {
    if let Some(id) = header(request, "e2b-sandbox-id").filter(|id| !id.is_empty()) {
        let port = header(request, "e2b-sandbox-port").and_then(|p| p.trim().parse().ok());
        return Some(Target {
            id: id.to_string(),
            port: port.or(Some(ENVD_PORT)),
        });
    }
    let host = header(request, "host").or_else(|| request.uri().host())?;
    host_target(host, domain)
}

/// `{port}-{id}.{domain}[:p]` → the target.
fn host_target(host: &str, domain: &str) -> Option<Target> {
    let host = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    Some(Target {
        id: id.to_string(),
        port: Some(port.parse().ok()?),
    })
}

/// A JSON response.
fn json(status: u16, value: &serde_json::Value) -> Response<Out> {
    with_body(status, "application/json", Bytes::from(value.to_string()))
}

fn with_body(status: u16, content_type: &'static str, body: Bytes) -> Response<Out> {
    let mut response = Response::new(Out::Full(Some(body)));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

fn no_content() -> Response<Out> {
    let mut response = Response::new(Out::Full(None));
    *response.status_mut() = hyper::StatusCode::NO_CONTENT;
    response
}

/// Milliseconds since the epoch as RFC 3339 UTC (`2026-12-01T02:12:26.123Z`).
fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Decodes `%XX` and `+` of a URL query component.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(high), Some(low)) => {
                        out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A query string as decoded (name, value) pairs.
fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(name), percent_decode(value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_port_and_sandbox() {
        assert_eq!(
            host_target("49983-sb-0123.e2b.local:8443", "e2b.local"),
            Some(Target {
                id: "sb-0123".into(),
                port: Some(49983)
            })
        );
        assert_eq!(host_target("api.e2b.local", "e2b.local"), None);
        assert_eq!(host_target("127.0.0.1:3000", "e2b.local"), None);
        assert_eq!(host_target("x.49983-sb-1.e2b.local", "e2b.local"), None);
    }

    #[test]
    fn times_and_queries_decode() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_091_146_123), "2026-12-01T02:12:26.123Z");
        assert_eq!(
            query_pairs("metadata=a%3Db%26c%3Dd&state=running%2Cpaused&x"),
            vec![
                ("metadata".to_string(), "a=b&c=d".to_string()),
                ("state".to_string(), "running,paused".to_string()),
                ("x".to_string(), String::new()),
            ]
        );
        assert_eq!(percent_decode("50%"), "50%");
        assert_eq!(percent_decode("a+b%2"), "a b%2");
    }
}
