//! `rollbox lease`: one sandbox for the life of one process, for agent-sandbox's pods. It
//! creates (or restores) a sandbox on its node's daemon, labelled with the pod's UID; once the
//! guest agent answers it serves that sandbox's E2B/envd API on the pod's address
//! ([`proxy`]); on SIGTERM or SIGINT it deletes the sandbox and exits. Should the lease die
//! without deleting, the daemon's `--kubelet-pods-dir` reaper ends the sandbox once its pod is
//! gone. If the sandbox ends on its own (a kill through the API, its TTL), the lease exits 1,
//! as a container whose process ended.

mod proxy;
mod route;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::daemon::api::{ExecResult, Sandbox, POD_UID_LABEL};
use crate::daemon::client::{ClientError, Endpoint};

pub use route::ALIAS;

/// What a lease holds to, and how.
#[derive(Debug, Clone)]
pub struct LeaseOptions {
    /// The daemon's native API.
    pub daemon: Endpoint,
    pub api_key: String,
    /// The daemon's E2B socket (`rollbox serve --e2b-socket`).
    pub e2b_socket: PathBuf,
    /// Where clients reach the sandbox (the pod's address and envd's port).
    pub listen: SocketAddr,
    /// The `POST /sandboxes` body: a template or a snapshot, and its options.
    pub create: Value,
    /// The pod the sandbox belongs to (its `rollbox.dev/pod-uid` label).
    pub pod_uid: Option<String>,
    /// How long the guest agent may take to answer after the create.
    pub ready_timeout: Duration,
    /// How often the lease checks that its sandbox still exists.
    pub watch_interval: Duration,
}

/// A lease that could not start, or whose sandbox went away.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("the daemon at {endpoint}: {source}")]
    Daemon {
        endpoint: String,
        source: ClientError,
    },
    #[error("the daemon refused {what}: {message} ({status})")]
    Refused {
        what: String,
        status: u16,
        message: String,
    },
    #[error("the daemon's answer to {what} is not what this lease expects: {detail}")]
    Answer { what: String, detail: String },
    #[error("sandbox {id}'s agent did not answer within {seconds} s (last: {last}); the sandbox was deleted")]
    NotReady {
        id: String,
        seconds: u64,
        last: String,
    },
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("sandbox {id} ended ({reason}); the lease ends with it")]
    Gone { id: String, reason: String },
    #[error("cannot handle signals: {0}")]
    Signals(std::io::Error),
}

/// The blocking half: the daemon's native and E2B APIs, one request at a time.
struct Daemon {
    native: Endpoint,
    e2b: Endpoint,
    key: String,
}

impl Daemon {
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<(u16, Value), LeaseError> {
        let response = self
            .native
            .request_json(method, path, &self.key, body, timeout)
            .map_err(|source| LeaseError::Daemon {
                endpoint: self.native.to_string(),
                source,
            })?;
        let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        if !(200..300).contains(&response.status) {
            return Err(LeaseError::Refused {
                what: format!("{method} {path}"),
                status: response.status,
                message: response.error_message(),
            });
        }
        Ok((response.status, value))
    }

    fn create(&self, body: &Value) -> Result<Sandbox, LeaseError> {
        let (_, value) = self.call("POST", "/sandboxes", Some(body), Duration::from_secs(300))?;
        serde_json::from_value(value).map_err(|e| LeaseError::Answer {
            what: "POST /sandboxes".into(),
            detail: e.to_string(),
        })
    }

    /// Waits until an exec of `true` in the sandbox succeeds.
    fn wait_ready(&self, id: &str, timeout: Duration) -> Result<(), LeaseError> {
        let deadline = Instant::now() + timeout;
        let exec = json!({ "cmd": ["true"], "timeout_s": 10 });
        loop {
            let last = match self.call(
                "POST",
                &format!("/sandboxes/{id}/exec"),
                Some(&exec),
                Duration::from_secs(15),
            ) {
                Ok((_, answer)) => match serde_json::from_value::<ExecResult>(answer) {
                    Ok(result) if result.exit.exit_code == Some(0) => return Ok(()),
                    Ok(result) => format!("`true` ended with {:?}", result.exit),
                    Err(e) => format!("an exec answer that is not one: {e}"),
                },
                // A request the daemon will never take (a wrong key, a sandbox gone).
                Err(
                    e @ LeaseError::Refused {
                        status: 400..=404, ..
                    },
                ) => return Err(e),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(LeaseError::NotReady {
                    id: id.to_string(),
                    seconds: timeout.as_secs(),
                    last,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// envd's access token of sandbox `id`, from the E2B control plane.
    fn access_token(&self, id: &str) -> Result<String, LeaseError> {
        let what = format!("GET /sandboxes/{id} (E2B)");
        let response = self
            .e2b
            .request(
                "GET",
                &format!("/sandboxes/{id}"),
                &[("X-API-KEY", &self.key)],
                None,
                Duration::from_secs(30),
            )
            .map_err(|source| LeaseError::Daemon {
                endpoint: self.e2b.to_string(),
                source,
            })?;
        if response.status != 200 {
            return Err(LeaseError::Refused {
                what,
                status: response.status,
                message: response.error_message(),
            });
        }
        let value: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        value["envdAccessToken"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| LeaseError::Answer {
                what,
                detail: "no envdAccessToken".into(),
            })
    }

    fn delete(&self, id: &str) -> Result<(), LeaseError> {
        match self.call(
            "DELETE",
            &format!("/sandboxes/{id}"),
            None,
            Duration::from_secs(60),
        ) {
            Ok(_) | Err(LeaseError::Refused { status: 404, .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// None while the sandbox runs (or the daemon cannot be asked: a restarting daemon keeps
    /// its sandboxes), else why it is gone.
    fn ended(&self, id: &str) -> Option<String> {
        match self.call(
            "GET",
            &format!("/sandboxes/{id}"),
            None,
            Duration::from_secs(10),
        ) {
            Ok((_, value)) => match serde_json::from_value::<Sandbox>(value) {
                Ok(sandbox) if sandbox.ended_at_ms.is_some() => Some(
                    sandbox
                        .end_reason
                        .unwrap_or_else(|| format!("{:?}", sandbox.state)),
                ),
                _ => None,
            },
            Err(LeaseError::Refused { status: 404, .. }) => Some("not found".into()),
            Err(_) => None,
        }
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, LeaseError> + Send + 'static,
) -> Result<T, LeaseError> {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(LeaseError::Answer {
            what: "a blocking call".into(),
            detail: e.to_string(),
        })
    })
}

/// Runs a lease until SIGTERM or SIGINT (Ok, the sandbox deleted) or until its sandbox ends.
pub async fn run(options: LeaseOptions) -> Result<(), LeaseError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(LeaseError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(LeaseError::Signals)?;
    let daemon = Arc::new(Daemon {
        native: options.daemon.clone(),
        e2b: Endpoint::Unix(options.e2b_socket.clone()),
        key: options.api_key.clone(),
    });
    let mut body = options.create.clone();
    if let Some(uid) = &options.pod_uid {
        body["labels"][POD_UID_LABEL] = json!(uid);
    }
    let source = body["template"]
        .as_str()
        .or(body["snapshot"].as_str())
        .unwrap_or_default()
        .to_string();
    // The start is blocking work: a signal meanwhile ends the lease once it is done, and
    // deletes what it made.
    let starting = {
        let daemon = Arc::clone(&daemon);
        let ready_timeout = options.ready_timeout;
        tokio::task::spawn_blocking(move || {
            let sandbox = daemon.create(&body)?;
            let id = sandbox.id;
            let ready = daemon
                .wait_ready(&id, ready_timeout)
                .and_then(|()| daemon.access_token(&id));
            match ready {
                Ok(token) => Ok((id, token)),
                Err(e) => {
                    if let Err(deleted) = daemon.delete(&id) {
                        log::warn!("lease: delete {id}: {deleted}");
                    }
                    Err(e)
                }
            }
        })
    };
    tokio::pin!(starting);
    let started = tokio::select! {
        started = &mut starting => started,
        _ = term.recv() => return stop_while_starting(&daemon, starting).await,
        _ = interrupt.recv() => return stop_while_starting(&daemon, starting).await,
    };
    let (id, access_token) = started.unwrap_or_else(|e| {
        Err(LeaseError::Answer {
            what: "the start".into(),
            detail: e.to_string(),
        })
    })?;
    let listener = match tokio::net::TcpListener::bind(options.listen).await {
        Ok(listener) => listener,
        Err(source) => {
            let daemon = Arc::clone(&daemon);
            let delete_id = id.clone();
            let _ = blocking(move || daemon.delete(&delete_id)).await;
            return Err(LeaseError::Listen {
                address: options.listen,
                source,
            });
        }
    };
    let address = listener.local_addr().unwrap_or(options.listen);
    log::info!("sandbox {id} ready; its E2B/envd API is on http://{address}");
    {
        // The id on stdout for whoever started the lease; not println!, which panics when
        // stdout is closed.
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{id}").and_then(|()| stdout.flush());
    }
    let pin = Arc::new(proxy::Pin {
        id: id.clone(),
        access_token,
        api_key: options.api_key.clone(),
        e2b_socket: options.e2b_socket.clone(),
        source,
        pod_uid: options.pod_uid.clone(),
    });
    let mut watch = tokio::time::interval(options.watch_interval);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(proxy::serve(Arc::clone(&pin), stream));
                }
                Err(e) => {
                    log::warn!("lease: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = watch.tick() => {
                let daemon = Arc::clone(&daemon);
                let watched = id.clone();
                let ended = tokio::task::spawn_blocking(move || daemon.ended(&watched))
                    .await
                    .ok()
                    .flatten();
                if let Some(reason) = ended {
                    return Err(LeaseError::Gone { id, reason });
                }
            }
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    log::info!("stopping: deleting sandbox {id}");
    drop(listener);
    blocking(move || daemon.delete(&id)).await
}

/// A signal came during the start: let the start finish, delete what it made, end.
async fn stop_while_starting(
    daemon: &Arc<Daemon>,
    starting: std::pin::Pin<&mut tokio::task::JoinHandle<Result<(String, String), LeaseError>>>,
) -> Result<(), LeaseError> {
    log::info!("stopping while the sandbox starts: it is deleted once made");
    if let Ok(Ok((id, _))) = starting.await {
        let daemon = Arc::clone(daemon);
        return blocking(move || daemon.delete(&id)).await;
    }
    Ok(())
}
