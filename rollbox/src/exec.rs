//! `rollbox exec`: runs a command in a sandbox through its agent, over the sandbox's vsock
//! Unix socket (`CONNECT <port>`), streaming its output; exits with its status.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use rollbox_agent_protocol::client::{AgentClient, ClientOptions, ExecEvent};
use rollbox_agent_protocol::messages::{ExecRequest, OutputStream};

/// Errors of `rollbox exec`.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The agent could not be reached.
    #[error("cannot reach the agent on {path} port {port}: {detail}")]
    Connect {
        /// The vsock Unix socket.
        path: PathBuf,
        /// The vsock port.
        port: u32,
        /// Why.
        detail: String,
    },
    /// The command could not run.
    #[error("{0}")]
    Agent(String),
    /// A `--env` value without `=`.
    #[error("--env {0:?}: expected NAME=VALUE")]
    Env(String),
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// The sandbox's vsock Unix socket.
    pub uds: PathBuf,
    /// The agent's vsock port.
    pub port: u32,
    /// argv.
    pub argv: Vec<String>,
    /// Working directory.
    pub cwd: Option<String>,
    /// NAME=VALUE pairs.
    pub env: Vec<String>,
    /// User name or uid.
    pub user: Option<String>,
    /// Hard timeout.
    pub timeout: Option<Duration>,
    /// How long to keep retrying the connection (the guest may still be booting).
    pub wait: Duration,
}

/// Runs the command; returns the exit status for the `rollbox` process (the command's code,
/// 128 + signal, or 124 on timeout).
pub fn run(options: &ExecOptions) -> Result<u8, ExecError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ExecError::Runtime)?;
    runtime.block_on(run_async(options))
}

async fn connect(options: &ExecOptions) -> Result<AgentClient, ExecError> {
    let deadline = tokio::time::Instant::now() + options.wait;
    loop {
        // One exec on its own connection: wait for a slow stdout however long (no stall
        // timeout), and give up on a socket that never completes the handshake.
        let client_options = ClientOptions {
            connect_timeout: Some(Duration::from_secs(5)),
            call_timeout: None,
            stall_timeout: None,
        };
        match AgentClient::connect_unix_with(&options.uds, options.port, client_options).await {
            Ok(client) => return Ok(client),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(ExecError::Connect {
                    path: options.uds.clone(),
                    port: options.port,
                    detail: e.to_string(),
                })
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn run_async(options: &ExecOptions) -> Result<u8, ExecError> {
    let mut env = BTreeMap::new();
    for pair in &options.env {
        let (name, value) = pair
            .split_once('=')
            .ok_or_else(|| ExecError::Env(pair.clone()))?;
        env.insert(name.to_string(), value.to_string());
    }
    let client = connect(options).await?;
    let mut request = ExecRequest::argv(options.argv.clone());
    request.cwd = options.cwd.clone();
    request.env = env;
    request.user = options.user.clone();
    request.timeout_ms = options.timeout.map(|t| t.as_millis() as u64);
    let mut handle = client
        .exec(request)
        .await
        .map_err(|e| ExecError::Agent(e.to_string()))?;
    let mut code = 1u8;
    while let Some(event) = handle
        .next_event()
        .await
        .map_err(|e| ExecError::Agent(e.to_string()))?
    {
        match event {
            ExecEvent::Output {
                stream: OutputStream::Stdout,
                data,
                ..
            } => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(&data).and_then(|()| out.flush());
            }
            ExecEvent::Output { data, .. } => {
                let mut err = std::io::stderr().lock();
                let _ = err.write_all(&data).and_then(|()| err.flush());
            }
            ExecEvent::Exited(status) => {
                code = if status.timed_out {
                    eprintln!("rollbox exec: timed out; the process group was killed");
                    124
                } else if let Some(signal) = status.signal {
                    128u8.saturating_add(signal as u8)
                } else {
                    status.code.unwrap_or(1) as u8
                };
                if status.oom_killed {
                    eprintln!("rollbox exec: killed by the OOM killer");
                }
            }
            ExecEvent::Started { .. } => {}
            ExecEvent::Notice(message) => eprintln!("rollbox exec: {message}"),
        }
    }
    let _ = client.close().await;
    Ok(code)
}
