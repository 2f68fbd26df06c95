//! Shell commands in a Linux guest through its agent (`Run` on a fresh vsock connection), for
//! the benchmarks that drive a guest: `rollbox-bench linux-net` and `linux-fs`.

use std::io::{Read, Write};
use std::time::Duration;

use rollbox_agent_protocol::frame;
use rollbox_agent_protocol::{ClientFrame, ClientMessage, ExecRequest, ServerMessage};

use crate::linux::{
    connect_agent_port, read_frame, set_timeval, unix_connect, vsock_connect, AgentAddr,
    LinuxBenchError, AGENT_PORT, ATTEMPT_TIMEOUT,
};

/// A connected agent stream of either kind.
trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// What a guest command printed, and its exit code.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs shell scripts in one guest.
pub struct GuestShell {
    /// The VM's label, for errors.
    pub vm: String,
    pub addr: AgentAddr,
}

impl GuestShell {
    pub fn new(vm: &str, addr: AgentAddr) -> Self {
        Self {
            vm: vm.to_string(),
            addr,
        }
    }

    fn error(&self, script: &str, detail: String) -> LinuxBenchError {
        LinuxBenchError::Guest {
            vm: self.vm.clone(),
            script: script.chars().take(200).collect(),
            detail,
        }
    }

    fn connect(&self, timeout: Duration) -> Result<Box<dyn Stream>, String> {
        match &self.addr {
            AgentAddr::Unix(path) => {
                let mut stream = unix_connect(path, ATTEMPT_TIMEOUT)?;
                connect_agent_port(&mut stream)?;
                set_timeval(&stream, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
                Ok(Box::new(stream))
            }
            AgentAddr::Vsock(cid) => {
                let stream = vsock_connect(*cid, AGENT_PORT, ATTEMPT_TIMEOUT)?;
                set_timeval(&stream, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout)?;
                Ok(Box::new(stream))
            }
        }
    }

    /// Runs `script` with `sh -c` and waits at most `timeout` for it (the agent kills it then).
    pub fn run(&self, script: &str, timeout: Duration) -> Result<RunOutput, LinuxBenchError> {
        let mut stream = self
            .connect(timeout + Duration::from_secs(30))
            .map_err(|e| self.error(script, e))?;
        let mut request = ExecRequest::shell(script);
        request.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        let bytes = frame::encode(&ClientFrame {
            id: 1,
            body: ClientMessage::Run(request),
        })
        .map_err(|e| self.error(script, e.to_string()))?;
        stream
            .write_all(&bytes)
            .map_err(|e| self.error(script, format!("sending the request: {e}")))?;
        loop {
            let reply = read_frame(&mut stream).map_err(|e| self.error(script, e))?;
            match reply.body {
                ServerMessage::RunResult {
                    stdout,
                    stderr,
                    status,
                } => {
                    return Ok(RunOutput {
                        code: status.code,
                        stdout: String::from_utf8_lossy(&stdout).into_owned(),
                        stderr: String::from_utf8_lossy(&stderr).into_owned(),
                    })
                }
                ServerMessage::Error(info) => {
                    return Err(self.error(script, format!("the agent answered {info:?}")))
                }
                _ => continue,
            }
        }
    }

    /// Runs `script`, which must exit 0; returns its stdout, trimmed.
    pub fn sh(&self, script: &str, timeout: Duration) -> Result<String, LinuxBenchError> {
        let out = self.run(script, timeout)?;
        if out.code == Some(0) {
            Ok(out.stdout.trim().to_string())
        } else {
            Err(self.error(
                script,
                format!(
                    "exit {:?}; stdout {:?}; stderr {:?}",
                    out.code,
                    out.stdout.trim(),
                    out.stderr.trim()
                ),
            ))
        }
    }
}

/// `read a _ < /proc/uptime` before and after `body`, so the guest times it (10 ms steps)
/// without the agent's round trip; the script prints the seconds it took, last.
pub fn timed(body: &str) -> String {
    format!("read t0 _ < /proc/uptime\n{body}\nread t1 _ < /proc/uptime\necho \"elapsed $t0 $t1\"")
}

/// Seconds from the `elapsed T0 T1` line that [`timed`] prints.
pub fn parse_elapsed(stdout: &str) -> Option<f64> {
    let line = stdout.lines().rev().find(|l| l.starts_with("elapsed "))?;
    let mut parts = line.split_whitespace().skip(1);
    let t0: f64 = parts.next()?.parse().ok()?;
    let t1: f64 = parts.next()?.parse().ok()?;
    Some(t1 - t0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elapsed_from_uptime() {
        let script = timed("busybox true");
        assert!(script.starts_with("read t0 _ < /proc/uptime\nbusybox true\n"));
        let got = parse_elapsed("noise\nelapsed 12.34 15.84\n").expect("parsed");
        assert!((got - 3.5).abs() < 1e-9);
        assert_eq!(parse_elapsed("elapsed x 1"), None);
        assert_eq!(parse_elapsed(""), None);
    }
}
