//! Talking to the daemon: the connection flags (`--socket`, `--url`, `--api-key-file`,
//! `--json`), one request with its refusal turned into an error with a hint, and the small
//! helpers every subcommand shares (KEY=VALUE flags, query encoding, printing).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::Value;

use rollbox::daemon::client::{ClientError, Endpoint, Response, Streaming};

/// A CLI command that failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("cannot read the API key from {path}: {source}")]
    KeyFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no API key: pass --api-key-file FILE or set ROLLBOX_API_KEY")]
    NoKey,
    #[error("{flag}: {source}")]
    Url {
        flag: &'static str,
        source: ClientError,
    },
    #[error("{0}\nhint: is `rollbox serve` running? start it with `rollbox serve --socket PATH --api-key-file FILE`, and point --socket or --url at it")]
    NotRunning(ClientError),
    #[error(transparent)]
    Request(ClientError),
    #[error("{message} ({status}){hint}")]
    Refused {
        status: u16,
        message: String,
        hint: &'static str,
    },
    #[error("the daemon's answer is not what this CLI expects: {0}")]
    Answer(serde_json::Error),
    #[error("--{flag} {pair:?}: expected KEY=VALUE")]
    KeyValue { flag: &'static str, pair: String },
    #[error("{path}: {source}")]
    Local {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the daemon's stream broke off: {0}")]
    Stream(String),
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Kube(#[from] super::kube::KubeError),
    #[error(transparent)]
    Lease(#[from] rollbox::lease::LeaseError),
    #[error(transparent)]
    Untar(#[from] super::untar::UntarError),
    #[error("--registry-auth: {0}")]
    RegistryAuth(#[from] rollbox::images::auth::AuthError),
}

/// Where `rollbox serve` listens, and the CLI connects, without --socket or --url.
pub const DEFAULT_SOCKET: &str = "/run/rollbox/rollbox.sock";

#[derive(Args)]
pub struct ConnArgs {
    /// The daemon's Unix socket [default: $ROLLBOX_URL or $ROLLBOX_SOCKET, else
    /// /run/rollbox/rollbox.sock].
    #[arg(long, value_name = "PATH", global = true, conflicts_with = "url")]
    socket: Option<PathBuf>,
    /// The daemon's loopback URL, e.g. http://127.0.0.1:7070.
    #[arg(long, value_name = "URL", global = true)]
    url: Option<String>,
    /// A file holding the API key [default: $ROLLBOX_API_KEY].
    #[arg(long, value_name = "FILE", global = true)]
    api_key_file: Option<PathBuf>,
    /// Print the daemon's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `$ROLLBOX_SOCKET`, else [`DEFAULT_SOCKET`].
pub fn default_socket() -> PathBuf {
    PathBuf::from(env("ROLLBOX_SOCKET").unwrap_or_else(|| DEFAULT_SOCKET.to_string()))
}

pub fn read_key(file: Option<&PathBuf>) -> Result<String, CliError> {
    match file {
        Some(path) => std::fs::read_to_string(path)
            .map(|k| k.trim().to_string())
            .map_err(|source| CliError::KeyFile {
                path: path.clone(),
                source,
            }),
        None => env("ROLLBOX_API_KEY")
            .map(|k| k.trim().to_string())
            .ok_or(CliError::NoKey),
    }
}

pub fn absolute(path: PathBuf) -> PathBuf {
    std::path::absolute(&path).unwrap_or(path)
}

pub struct Conn {
    pub endpoint: Endpoint,
    pub key: String,
    pub json: bool,
}

impl Conn {
    pub fn new(args: &ConnArgs) -> Result<Conn, CliError> {
        let mut conn = Conn::keyless(args)?;
        conn.key = read_key(args.api_key_file.as_ref())?;
        Ok(conn)
    }

    /// The endpoint alone, for the routes that take no key (`/livez`, `/readyz`).
    pub fn keyless(args: &ConnArgs) -> Result<Conn, CliError> {
        let endpoint = match (&args.url, &args.socket) {
            (Some(url), _) => Endpoint::from_url(url).map_err(|source| CliError::Url {
                flag: "--url",
                source,
            })?,
            (None, Some(path)) => Endpoint::Unix(path.clone()),
            (None, None) => match env("ROLLBOX_URL") {
                Some(url) => Endpoint::from_url(&url).map_err(|source| CliError::Url {
                    flag: "ROLLBOX_URL",
                    source,
                })?,
                None => Endpoint::Unix(default_socket()),
            },
        };
        Ok(Conn {
            endpoint,
            key: String::new(),
            json: args.json,
        })
    }

    /// One request; a non-2xx answer becomes an error with a hint.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Response, CliError> {
        self.call_within(method, path, body, Duration::from_secs(120))
    }

    /// [`Conn::call`] for long work (a template build), waiting up to `timeout`.
    pub fn call_within(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<Response, CliError> {
        let response = self
            .endpoint
            .request_json(method, path, &self.key, body.as_ref(), timeout)
            .map_err(transport_error)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        Err(refused(response.status, response.error_message()))
    }
}

/// A request that did not get an answer: the daemon not listening, or the transport failing.
fn transport_error(e: ClientError) -> CliError {
    if e.is_connect() {
        CliError::NotRunning(e)
    } else {
        CliError::Request(e)
    }
}

/// A non-2xx answer, with what to do next where the status says it.
fn refused(status: u16, message: String) -> CliError {
    let hint = match status {
        401 => "\nhint: the key must be one the daemon knows (its --api-key-file key, or one `rollbox key add` made and nobody revoked): check --api-key-file or ROLLBOX_API_KEY",
        // Other 403s (a template path or registry the daemon refuses) say what to do.
        403 if message.contains("admin key") => {
            "\nhint: this needs an admin key (a tenant key may not manage templates or keys)"
        }
        429 => {
            "\nhint: the daemon has too many creates in flight; retry shortly (it said Retry-After)"
        }
        _ => "",
    };
    CliError::Refused {
        status,
        message,
        hint,
    }
}

impl Conn {
    /// One request whose answer is read as it comes; a non-2xx answer becomes an error.
    pub fn open(
        &self,
        method: &str,
        path: &str,
        body: Option<(&mut dyn std::io::Read, u64)>,
        content_type: &str,
    ) -> Result<Streaming, CliError> {
        let auth = format!("Bearer {}", self.key);
        let response = self
            .endpoint
            .open(
                method,
                path,
                &[("Authorization", &auth), ("Content-Type", content_type)],
                body,
                Duration::from_secs(3600),
            )
            .map_err(transport_error)?;
        if (200..300).contains(&response.status) {
            return Ok(response);
        }
        let response = response.into_response().map_err(CliError::Request)?;
        Err(refused(response.status, response.error_message()))
    }
}

pub fn key_values(
    pairs: &[String],
    flag: &'static str,
) -> Result<serde_json::Map<String, Value>, CliError> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .ok_or_else(|| CliError::KeyValue {
                    flag,
                    pair: pair.clone(),
                })
        })
        .collect()
}

/// Percent-encodes a query value.
pub fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub fn parse<T: serde::de::DeserializeOwned>(response: &Response) -> Result<T, CliError> {
    serde_json::from_slice(&response.body).map_err(CliError::Answer)
}

/// The error of an I/O failure on a host file at `path`.
pub fn local_error(path: &std::path::Path) -> impl Fn(std::io::Error) -> CliError + '_ {
    move |source| CliError::Local {
        path: path.to_path_buf(),
        source,
    }
}

pub fn print_json(response: &Response) {
    println!("{}", String::from_utf8_lossy(&response.body).trim());
}

pub fn seconds_left(at_ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let left = (u128::from(at_ms).saturating_sub(now)) / 1000;
    format!("{left}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_flags_and_query_encoding() {
        let map = key_values(&["a=1".into(), "b=x=y".into()], "label").expect("parse");
        assert_eq!(map["a"], "1");
        assert_eq!(map["b"], "x=y");
        let error = key_values(&["novalue".into()], "label")
            .expect_err("no =")
            .to_string();
        assert!(
            error.contains("--label") && error.contains("KEY=VALUE"),
            "{error}"
        );
        assert_eq!(encode("run=a b/c"), "run%3Da%20b%2Fc");
    }
}
