//! The Kubernetes API from inside a pod, as its service account: just enough to publish this
//! node's sandbox slots as the extended resource `rollbox.dev/slots` on its Node (one JSON
//! patch of the Node's status over HTTPS, the API server's certificate checked against the
//! service account's `ca.crt`).

use std::io::Read as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};

use rollbox::daemon::client::{request_on, ClientError};

/// Longest answer read back from the API server.
const MAX_ANSWER: u64 = 1 << 20;

/// The extended resource the slots are published as.
pub const SLOTS_RESOURCE: &str = "rollbox.dev/slots";

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("not in a Kubernetes pod: {0} is not set")]
    NoEnv(&'static str),
    #[error("{name} {value:?}: {why}")]
    Bad {
        name: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}: no PEM certificate in it")]
    NoCert(PathBuf),
    #[error("TLS to the API server: {0}")]
    Tls(#[from] rustls::Error),
    #[error("the API server at {addr}: {source}")]
    Io {
        addr: String,
        source: std::io::Error,
    },
    #[error("PATCH {path}: {status} {body}")]
    Refused {
        path: String,
        status: u16,
        body: String,
    },
    #[error(transparent)]
    Http(#[from] ClientError),
}

/// The API server and the service account's credentials.
pub struct InCluster {
    host: String,
    port: u16,
    token: String,
    tls: Arc<rustls::ClientConfig>,
}

impl InCluster {
    /// From the pod's environment (`KUBERNETES_SERVICE_HOST` and `_PORT`) and the service
    /// account's directory (`token`, `ca.crt`).
    pub fn from_env(account: &Path) -> Result<InCluster, KubeError> {
        let var = |name: &'static str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .ok_or(KubeError::NoEnv(name))
        };
        let host = var("KUBERNETES_SERVICE_HOST")?;
        let port_text = var("KUBERNETES_SERVICE_PORT")?;
        let port = port_text.parse().map_err(|_| KubeError::Bad {
            name: "KUBERNETES_SERVICE_PORT",
            value: port_text.clone(),
            why: "not a port",
        })?;
        let read = |name: &str| {
            let path = account.join(name);
            std::fs::read(&path).map_err(|source| KubeError::File { path, source })
        };
        let token = String::from_utf8_lossy(&read("token")?).trim().to_string();
        let ca_path = account.join("ca.crt");
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&read("ca.crt")?) {
            let cert = cert.map_err(|_| KubeError::NoCert(ca_path.clone()))?;
            roots.add(cert)?;
        }
        if roots.is_empty() {
            return Err(KubeError::NoCert(ca_path));
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(InCluster {
            host,
            port,
            token,
            tls: Arc::new(tls),
        })
    }

    /// Sets the Node's capacity of [`SLOTS_RESOURCE`] to `slots` (the scheduler copies it to
    /// allocatable), so pods that request `rollbox.dev/slots` land where there is room.
    pub fn publish_slots(&self, node: &str, slots: u64) -> Result<(), KubeError> {
        check_node_name(node)?;
        let path = format!("/api/v1/nodes/{node}/status");
        let key = SLOTS_RESOURCE.replace('/', "~1");
        let body = serde_json::json!([
            {"op": "add", "path": format!("/status/capacity/{key}"), "value": slots.to_string()}
        ])
        .to_string();
        let (status, answer) = self.request("PATCH", &path, &body)?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(KubeError::Refused {
            path,
            status,
            body: answer.chars().take(500).collect(),
        })
    }

    /// One request on its own TLS connection: the status and the body.
    fn request(&self, method: &str, path: &str, body: &str) -> Result<(u16, String), KubeError> {
        let addr = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        let io = |source| KubeError::Io {
            addr: addr.clone(),
            source,
        };
        let name = ServerName::try_from(self.host.clone()).map_err(|_| KubeError::Bad {
            name: "KUBERNETES_SERVICE_HOST",
            value: self.host.clone(),
            why: "not a host name or address",
        })?;
        let tcp = TcpStream::connect(&addr).map_err(io)?;
        tcp.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        tcp.set_write_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        let conn = rustls::ClientConnection::new(Arc::clone(&self.tls), name)?;
        let auth = format!("Bearer {}", self.token);
        let mut response = request_on(
            rustls::StreamOwned::new(conn, tcp),
            &format!("https://{addr}"),
            method,
            path,
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json-patch+json"),
                ("Accept", "application/json"),
            ],
            body.as_bytes(),
        )?;
        let mut answer = Vec::new();
        // A server that closes without TLS close_notify still gave its whole answer here.
        if let Err(e) = (&mut response).take(MAX_ANSWER).read_to_end(&mut answer) {
            if e.kind() != std::io::ErrorKind::UnexpectedEof || answer.is_empty() {
                return Err(io(e));
            }
        }
        Ok((
            response.status,
            String::from_utf8_lossy(&answer).to_string(),
        ))
    }
}

/// A Node's name is a DNS subdomain: 1-253 of a-z 0-9 . -, never a path.
fn check_node_name(node: &str) -> Result<(), KubeError> {
    let fine = !node.is_empty()
        && node.len() <= 253
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && !node.starts_with(['.', '-']);
    if fine {
        Ok(())
    } else {
        Err(KubeError::Bad {
            name: "node name",
            value: node.to_string(),
            why: "a Node's name is a DNS subdomain (a-z, 0-9, '.', '-')",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_dns_subdomains_never_paths() {
        assert!(check_node_name("gpu-node-3.cluster.local").is_ok());
        for bad in ["", "../nodes", "a/b", "Node1", "-x", "a?b=1"] {
            assert!(check_node_name(bad).is_err(), "{bad:?}");
        }
    }
}
