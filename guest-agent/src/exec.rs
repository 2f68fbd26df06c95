//! Running processes: spawn (user, cwd, env, cgroup), stream or collect
//! output under a cap, stdin, signals, a hard timeout that kills the whole
//! process group, and the exit status with OOM evidence. With `pty` the
//! process runs on a new terminal instead of pipes (see pty.rs).

use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{
    Command, ErrorInfo, ExecRequest, ExitStatus, OomDetection, OutputStream, PtySize, ServerFrame,
    ServerMessage, CHUNK_BYTES,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};

use crate::agent::Agent;
use crate::cgroup::{self, ExecCgroup};
use crate::errors::{internal, SysError};
use crate::pty::{self, Master};
use crate::reaper::{reaper, WaitStatus};
use crate::users;

/// PATH for processes when neither the request nor the agent has one
/// (as PID 1 the agent starts with an empty environment).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const DEFAULT_KILL_GRACE: Duration = Duration::from_millis(2000);
/// After the process exits, how long to keep reading pipes that its
/// background children still hold open.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);
/// At most this much more is taken from each pipe when that wait ends (a background child
/// may write without end).
const FINAL_DRAIN_BYTES: usize = 1 << 20;
/// Highest valid signal number on Linux (SIGRTMAX).
const MAX_SIGNAL: i32 = 64;

/// Stream input for a running process.
#[derive(Debug)]
pub enum ExecInput {
    Stdin(Vec<u8>),
    StdinClose,
    Signal { signal: i32, group: bool },
    Resize(PtySize),
    Cancel,
}

/// Where output goes: streamed as frames, or collected for `Run`.
pub enum Sink {
    Stream {
        id: u64,
        out: mpsc::Sender<ServerFrame>,
        seq: u64,
    },
    Collect {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
    },
}

impl Sink {
    /// False once the connection is gone.
    async fn send(&mut self, body: ServerMessage) -> bool {
        match self {
            Sink::Stream { id, out, .. } => out.send(ServerFrame { id: *id, body }).await.is_ok(),
            Sink::Collect { .. } => true,
        }
    }

    async fn output(&mut self, stream: OutputStream, data: &[u8]) -> bool {
        match self {
            Sink::Stream { id, out, seq } => {
                let body = ServerMessage::Output {
                    stream,
                    seq: *seq,
                    data: data.to_vec(),
                };
                *seq += 1;
                out.send(ServerFrame { id: *id, body }).await.is_ok()
            }
            Sink::Collect { stdout, stderr } => {
                match stream {
                    OutputStream::Stdout | OutputStream::Pty => stdout.extend_from_slice(data),
                    OutputStream::Stderr => stderr.extend_from_slice(data),
                }
                true
            }
        }
    }
}

/// A command ready to spawn.
struct Prepared {
    command: std::process::Command,
    program: String,
    cgroup: Option<Arc<ExecCgroup>>,
    stdin: bool,
    /// The agent's end of the process's terminal (`pty` execs).
    master: Option<OwnedFd>,
}

fn prepare(agent: &Agent, req: &ExecRequest) -> Result<Prepared, ErrorInfo> {
    let (program, args): (String, Vec<String>) = match &req.command {
        Command::Argv(argv) => {
            let Some((first, rest)) = argv.split_first() else {
                return Err(ErrorInfo::bad_request("exec: argv is empty"));
            };
            if first.is_empty() {
                return Err(ErrorInfo::bad_request("exec: argv[0] is empty"));
            }
            (first.clone(), rest.to_vec())
        }
        Command::Shell(script) => ("/bin/sh".to_owned(), vec!["-c".to_owned(), script.clone()]),
    };
    let user = match &req.user {
        Some(name) => {
            Some(
                users::lookup(&agent.config.etc_dir, name).map_err(|err| ErrorInfo {
                    code: "bad_request".into(),
                    errno: None,
                    message: format!("exec {program}: {err}"),
                })?,
            )
        }
        None => None,
    };
    let cwd = match (&req.cwd, &user) {
        (Some(cwd), _) => cwd.clone(),
        (None, Some(user)) if std::path::Path::new(&user.home).is_dir() => user.home.clone(),
        _ => "/".to_owned(),
    };
    match std::fs::metadata(&cwd) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(SysError::new(
                "chdir",
                &cwd,
                std::io::Error::from_raw_os_error(libc::ENOTDIR),
            )
            .to_info())
        }
        Err(err) => return Err(SysError::new("chdir", &cwd, err).to_info()),
    }

    let mut command = std::process::Command::new(&program);
    command.args(&args).current_dir(&cwd);
    if req.clear_env {
        command.env_clear();
    }
    let has_path =
        req.env.contains_key("PATH") || (!req.clear_env && std::env::var_os("PATH").is_some());
    if !has_path {
        command.env("PATH", DEFAULT_PATH);
    }
    if let Some(user) = &user {
        for (key, value) in [
            ("HOME", &user.home),
            ("USER", &user.name),
            ("LOGNAME", &user.name),
        ] {
            if !req.env.contains_key(key) {
                command.env(key, value);
            }
        }
    }
    if req.pty.is_some() && !req.env.contains_key("TERM") {
        command.env("TERM", "xterm-256color");
    }
    command.envs(&req.env);

    let cgroup = match (&agent.cgroups, req.memory_limit_bytes) {
        (Some(base), limit) => match ExecCgroup::create(base, limit) {
            Ok(cgroup) => Some(Arc::new(cgroup)),
            Err(err) if limit.is_some() => return Err(err.to_info()),
            Err(err) => {
                log::warn!("running without a cgroup: {err}");
                None
            }
        },
        (None, Some(_)) => {
            return Err(ErrorInfo::bad_request(format!(
            "exec {program}: memory_limit_bytes needs a memory cgroup, and none is available here"
        )))
        }
        (None, None) => None,
    };

    // The terminal is opened before the fork: its slave becomes stdin, stdout and stderr.
    let terminal = match req.pty {
        Some(size) => Some(
            pty::open(size)
                .map_err(|err| ErrorInfo::bad_request(format!("exec {program}: {err}")))?,
        ),
        None => None,
    };
    let on_terminal = terminal.is_some();
    let procs_fd: Option<RawFd> = cgroup.as_ref().map(|c| c.procs_fd());
    let ids = user.as_ref().map(|u| (u.uid, u.gid, u.groups.clone()));
    // SAFETY: the closure runs in the child between fork and exec. It only
    // makes async-signal-safe system calls on data prepared before the fork
    // and does not allocate.
    unsafe {
        command.pre_exec(move || {
            // A new session: the process leads its own group, killed as one.
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if on_terminal {
                pty::take_controlling_terminal()?;
            }
            if let Some(fd) = procs_fd {
                if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some((uid, gid, groups)) = &ids {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(*gid) != 0
                    || libc::setuid(*uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let (stdin, master) = match terminal {
        Some((master, slave)) => {
            let dup = |fd: &OwnedFd| {
                fd.try_clone()
                    .map_err(|err| SysError::new("dup the terminal for", &program, err).to_info())
            };
            command
                .stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
            (true, Some(master))
        }
        None => {
            let stdin = req.stdin || req.stdin_data.is_some();
            command
                .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            (stdin, None)
        }
    };
    Ok(Prepared {
        command,
        program,
        cgroup,
        stdin,
        master,
    })
}

/// Counts output against the cap.
struct OutputCap {
    limit: Option<u64>,
    kept: u64,
    truncated: bool,
    stdout_bytes: u64,
    stderr_bytes: u64,
}

impl OutputCap {
    /// How many of `n` new bytes may be kept.
    fn admit(&mut self, stream: OutputStream, n: usize) -> usize {
        match stream {
            OutputStream::Stdout | OutputStream::Pty => self.stdout_bytes += n as u64,
            OutputStream::Stderr => self.stderr_bytes += n as u64,
        }
        let Some(limit) = self.limit else { return n };
        let room = limit.saturating_sub(self.kept);
        let take = (n as u64).min(room);
        if take < n as u64 {
            self.truncated = true;
        }
        self.kept += take;
        // take <= n, which is a usize.
        usize::try_from(take).unwrap_or(n)
    }
}

fn kill(pid: i32, signal: i32) -> std::io::Result<()> {
    // SAFETY: kill has no memory effects.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn kill_everything(pid: i32, cgroup: Option<&ExecCgroup>) {
    // The group may be gone already (ESRCH): nothing left to kill.
    let _ = kill(-pid, libc::SIGKILL);
    if let Some(cgroup) = cgroup {
        cgroup.kill_all();
    }
}

async fn read_opt(pipe: &mut Option<pipe::Receiver>, buf: &mut [u8]) -> std::io::Result<usize> {
    match pipe {
        Some(pipe) => pipe.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn read_terminal(master: &Option<Arc<Master>>, buf: &mut [u8]) -> std::io::Result<usize> {
    match master {
        Some(master) => master.read(buf).await,
        None => std::future::pending().await,
    }
}

/// A read that never waits: what is in the pipe or terminal now (0 when it is empty, closed
/// or failed). `fd` must be non-blocking.
fn read_now(fd: RawFd, buf: &mut [u8]) -> usize {
    // SAFETY: reads at most `buf.len()` bytes into `buf` from a descriptor its owner keeps
    // open for the call; it is non-blocking (tokio's pipes, pty::open's master), so the call
    // returns at once.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    usize::try_from(n).unwrap_or(0)
}

async fn wait_opt(rx: &mut Option<oneshot::Receiver<WaitStatus>>) -> Option<WaitStatus> {
    match rx {
        Some(rx) => rx.await.ok(),
        None => std::future::pending().await,
    }
}

async fn sleep_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn write_stdin(mut pipe: pipe::Sender, mut rx: mpsc::UnboundedReceiver<Option<Vec<u8>>>) {
    while let Some(Some(data)) = rx.recv().await {
        if pipe.write_all(&data).await.is_err() {
            // The process closed its stdin; later input has nowhere to go.
            return;
        }
    }
}

async fn write_terminal(master: Arc<Master>, mut rx: mpsc::UnboundedReceiver<Option<Vec<u8>>>) {
    while let Some(Some(data)) = rx.recv().await {
        if master.write_all(&data).await.is_err() {
            // Nobody holds the terminal any more; later input has nowhere to go.
            return;
        }
    }
}

/// Run one process to the end. Output goes to `sink`; `inputs` carries
/// stdin and signals (its closing means the client is gone: kill).
/// `cleanup` runs after a kill (e.g. `docker rm -f` of a container).
pub async fn run(
    agent: &Agent,
    req: ExecRequest,
    sink: &mut Sink,
    mut inputs: mpsc::UnboundedReceiver<ExecInput>,
    cleanup: Option<Vec<String>>,
) -> Result<ExitStatus, ErrorInfo> {
    if req.pty.is_some() && matches!(sink, Sink::Collect { .. }) {
        return Err(ErrorInfo::bad_request(
            "run: pty needs exec (a terminal's output is streamed)",
        ));
    }
    let Prepared {
        mut command,
        program,
        cgroup,
        stdin,
        master,
    } = prepare(agent, &req)?;
    let oom_before = if cgroup.is_none() {
        cgroup::system_oom_kills()
    } else {
        None
    };
    let started = Instant::now();
    let (mut child, exit_rx) = reaper()
        .spawn(&mut command)
        .map_err(|err| SysError::new("exec", &program, err).to_info())?;
    // The command holds the parent's copies of the terminal's slave: close them, so the master
    // reads end-of-file once the process and its children are gone.
    drop(command);
    let pid = i32::try_from(child.id()).map_err(|_| internal("child pid out of range"))?;
    let mut take_pipes = || -> std::io::Result<_> {
        let stdout = child
            .stdout
            .take()
            .map(|p| pipe::Receiver::from_owned_fd(OwnedFd::from(p)))
            .transpose()?;
        let stderr = child
            .stderr
            .take()
            .map(|p| pipe::Receiver::from_owned_fd(OwnedFd::from(p)))
            .transpose()?;
        let stdin = child
            .stdin
            .take()
            .map(|p| pipe::Sender::from_owned_fd(OwnedFd::from(p)))
            .transpose()?;
        Ok((stdout, stderr, stdin))
    };
    let pipes = take_pipes();
    drop(child);
    let (mut stdout, mut stderr, stdin_pipe) = match pipes {
        Ok(pipes) => pipes,
        Err(err) => {
            kill_everything(pid, cgroup.as_deref());
            return Err(SysError::new("set up pipes for", &program, err).to_info());
        }
    };
    let mut terminal = match master.map(Master::new).transpose() {
        Ok(master) => master.map(Arc::new),
        Err(err) => {
            kill_everything(pid, cgroup.as_deref());
            return Err(SysError::new("set up the terminal of", &program, err).to_info());
        }
    };
    let terminal_fd = terminal.as_ref().map(|t| t.raw_fd());

    let mut connected = sink.send(ServerMessage::Started { pid: pid as u32 }).await;

    let (stdin_tx, stdin_rx) = mpsc::unbounded_channel::<Option<Vec<u8>>>();
    let mut stdin_tx = Some(stdin_tx);
    if let Some(pipe) = stdin_pipe {
        tokio::spawn(write_stdin(pipe, stdin_rx));
    } else if let Some(master) = &terminal {
        tokio::spawn(write_terminal(Arc::clone(master), stdin_rx));
    }
    if let Some(data) = req.stdin_data.clone() {
        if let Some(tx) = stdin_tx.take() {
            let _ = tx.send(Some(data));
        }
    }

    let timed_out = Arc::new(AtomicBool::new(false));
    let killer = req.timeout_ms.map(|ms| {
        let timed_out = Arc::clone(&timed_out);
        let cgroup = cgroup.clone();
        let grace = req
            .kill_grace_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_KILL_GRACE);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            timed_out.store(true, Ordering::SeqCst);
            let _ = kill(-pid, libc::SIGTERM);
            tokio::time::sleep(grace).await;
            kill_everything(pid, cgroup.as_deref());
        })
    });

    let mut cap = OutputCap {
        limit: req.output_limit_bytes,
        kept: 0,
        truncated: false,
        stdout_bytes: 0,
        stderr_bytes: 0,
    };
    let mut exit_rx = Some(exit_rx);
    let mut wait_status: Option<WaitStatus> = None;
    // Set when the reaper's channel closed without a status, or a pipe read failed: the
    // answer is then an error, never an exit with output silently missing.
    let mut lost: Option<String> = None;
    let mut drain_deadline = None;
    let mut inputs_open = true;
    let mut cancelled = false;
    let mut out_buf = vec![0u8; CHUNK_BYTES];
    let mut err_buf = vec![0u8; CHUNK_BYTES];
    let mut term_buf = vec![0u8; if terminal.is_some() { CHUNK_BYTES } else { 0 }];

    while (wait_status.is_none() && exit_rx.is_some())
        || stdout.is_some()
        || stderr.is_some()
        || terminal.is_some()
    {
        tokio::select! {
            read = read_opt(&mut stdout, &mut out_buf) => match read {
                Ok(n) if n > 0 => {
                    let keep = cap.admit(OutputStream::Stdout, n);
                    if keep > 0 && connected {
                        connected = sink.output(OutputStream::Stdout, &out_buf[..keep]).await;
                    }
                }
                Ok(_) => stdout = None,
                Err(err) => {
                    stdout = None;
                    lost.get_or_insert(format!("reading its stdout: {err}"));
                }
            },
            read = read_opt(&mut stderr, &mut err_buf) => match read {
                Ok(n) if n > 0 => {
                    let keep = cap.admit(OutputStream::Stderr, n);
                    if keep > 0 && connected {
                        connected = sink.output(OutputStream::Stderr, &err_buf[..keep]).await;
                    }
                }
                Ok(_) => stderr = None,
                Err(err) => {
                    stderr = None;
                    lost.get_or_insert(format!("reading its stderr: {err}"));
                }
            },
            read = read_terminal(&terminal, &mut term_buf) => match read {
                Ok(n) if n > 0 => {
                    let keep = cap.admit(OutputStream::Pty, n);
                    if keep > 0 && connected {
                        connected = sink.output(OutputStream::Pty, &term_buf[..keep]).await;
                    }
                }
                _ => terminal = None,
            },
            status = wait_opt(&mut exit_rx) => {
                exit_rx = None;
                match status {
                    Some(status) => {
                        wait_status = Some(status);
                        drain_deadline = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
                    }
                    // No status: the process may still run. Not an exit (it once read as exit
                    // 0, and the drain cut off output not written yet); the pipes' end is
                    // awaited instead.
                    None => {
                        lost.get_or_insert("its exit status was lost".to_owned());
                    }
                }
            }
            input = inputs.recv(), if inputs_open => match input {
                None => {
                    inputs_open = false;
                    connected = false;
                }
                Some(input) => {
                    if let Some(notice) = handle_input(input, pid, wait_status.is_some(), stdin, terminal_fd, &mut stdin_tx, &mut cancelled, cgroup.as_deref()) {
                        if connected {
                            connected = sink.send(ServerMessage::Notice { message: notice }).await;
                        }
                    }
                }
            },
            () = sleep_opt(drain_deadline) => {
                // Background processes keep the pipes open; stop waiting for them. What the
                // process wrote before it exited is in the pipes already: take it without
                // waiting first (a starved loop may not have seen the pipes' readiness yet, and
                // select! may pick this branch over a ready read).
                drain_deadline = None;
                use std::os::fd::AsRawFd as _;
                let (stdout, stderr, terminal) = (stdout.take(), stderr.take(), terminal.take());
                let sources = [
                    (stdout.as_ref().map(|p| p.as_raw_fd()), OutputStream::Stdout),
                    (stderr.as_ref().map(|p| p.as_raw_fd()), OutputStream::Stderr),
                    (terminal.as_ref().map(|t| t.raw_fd()), OutputStream::Pty),
                ];
                for (fd, stream) in sources {
                    let Some(fd) = fd else { continue };
                    let mut taken = 0;
                    while taken < FINAL_DRAIN_BYTES {
                        let n = read_now(fd, &mut out_buf);
                        if n == 0 {
                            break;
                        }
                        taken += n;
                        let keep = cap.admit(stream, n);
                        if keep > 0 && connected {
                            connected = sink.output(stream, &out_buf[..keep]).await;
                        }
                    }
                }
            }
        }
        if !connected && !cancelled {
            // Nobody is listening any more: do not leave the process behind.
            cancelled = true;
            kill_everything(pid, cgroup.as_deref());
        }
    }
    if let Some(killer) = killer {
        killer.abort();
    }
    let timed_out = timed_out.load(Ordering::SeqCst);
    let killed = timed_out || cancelled;
    if killed {
        kill_everything(pid, cgroup.as_deref());
        if let Some(argv) = cleanup {
            run_cleanup(argv).await;
        }
    }
    let Some(wait_status) = wait_status else {
        // Whatever is left of the process is in its cgroup (its pid may be reused by now).
        if let Some(cgroup) = &cgroup {
            cgroup.kill_all();
            cgroup.remove().await;
        }
        if let Some(why) = lost {
            return Err(internal(format!("exec {program}: {why}")));
        }
        return Err(internal(format!("exec {program}: no exit status")));
    };
    let (oom_killed, oom_detection) = match (&cgroup, oom_before) {
        (Some(cgroup), _) => (cgroup.oom_kills() > 0, cgroup.detection()),
        (None, Some(before)) => {
            let after = cgroup::system_oom_kills().unwrap_or(before);
            (
                wait_status.signal() == Some(libc::SIGKILL) && after > before,
                OomDetection::KernelCounter,
            )
        }
        (None, None) => (false, OomDetection::None),
    };
    if let Some(cgroup) = &cgroup {
        cgroup.remove().await;
    }
    if let Some(why) = lost {
        return Err(internal(format!("exec {program}: {why}")));
    }
    Ok(ExitStatus {
        code: wait_status.code(),
        signal: wait_status.signal(),
        timed_out,
        oom_killed,
        oom_detection,
        truncated: cap.truncated,
        stdout_bytes: cap.stdout_bytes,
        stderr_bytes: cap.stderr_bytes,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    })
}

/// Apply one stream input; returns a notice when it was refused.
#[allow(clippy::too_many_arguments)]
fn handle_input(
    input: ExecInput,
    pid: i32,
    exited: bool,
    has_stdin: bool,
    terminal: Option<RawFd>,
    stdin_tx: &mut Option<mpsc::UnboundedSender<Option<Vec<u8>>>>,
    cancelled: &mut bool,
    cgroup: Option<&ExecCgroup>,
) -> Option<String> {
    match input {
        ExecInput::Stdin(data) => match (has_stdin, stdin_tx.as_ref()) {
            (false, _) => Some(
                "stdin refused: the process was started without stdin (set \"stdin\": true)".into(),
            ),
            (true, None) => Some("stdin refused: stdin is already closed".into()),
            (true, Some(tx)) => tx
                .send(Some(data))
                .err()
                .map(|_| "stdin refused: the process closed its stdin".into()),
        },
        ExecInput::StdinClose if terminal.is_some() => Some(
            "stdin_close refused: the process runs on a terminal, which cannot be closed alone (send \\x04 for end-of-file)".into(),
        ),
        ExecInput::StdinClose => {
            // Dropping the sender ends the writer task, which closes the pipe.
            stdin_tx.take();
            None
        }
        ExecInput::Resize(size) => match terminal {
            None => Some(format!(
                "resize to {}x{} refused: the process has no terminal (start it with \"pty\")",
                size.rows, size.cols
            )),
            Some(fd) => pty::resize(fd, size).err().map(|err| err.to_string()),
        },
        ExecInput::Signal { signal, group } => {
            if !(1..=MAX_SIGNAL).contains(&signal) {
                return Some(format!(
                    "signal {signal} refused: not a signal number (1..={MAX_SIGNAL})"
                ));
            }
            if exited && !group {
                return Some(format!(
                    "signal {signal} not sent: process {pid} already exited"
                ));
            }
            let target = if group { -pid } else { pid };
            kill(target, signal).err().map(|err| {
                format!(
                    "kill {target} with signal {signal}: {}",
                    crate::errors::describe(&err)
                )
            })
        }
        ExecInput::Cancel => {
            *cancelled = true;
            kill_everything(pid, cgroup);
            None
        }
    }
}

/// Run a cleanup command (bounded to 30 s), logging failures.
async fn run_cleanup(argv: Vec<String>) {
    let Some((program, args)) = argv.split_first() else {
        return;
    };
    let mut command = std::process::Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match reaper().spawn(&mut command) {
        Ok((_child, rx)) => {
            if tokio::time::timeout(Duration::from_secs(30), rx)
                .await
                .is_err()
            {
                log::warn!("cleanup {argv:?} did not finish within 30 s");
            }
        }
        Err(err) => log::warn!("cleanup {argv:?}: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_cap_counts_both_streams() {
        let mut cap = OutputCap {
            limit: Some(10),
            kept: 0,
            truncated: false,
            stdout_bytes: 0,
            stderr_bytes: 0,
        };
        assert_eq!(cap.admit(OutputStream::Stdout, 6), 6);
        assert!(!cap.truncated);
        assert_eq!(cap.admit(OutputStream::Stderr, 6), 4);
        assert!(cap.truncated);
        assert_eq!(cap.admit(OutputStream::Stdout, 5), 0);
        assert_eq!((cap.stdout_bytes, cap.stderr_bytes), (11, 6));
    }

    #[test]
    fn no_cap_keeps_everything() {
        let mut cap = OutputCap {
            limit: None,
            kept: 0,
            truncated: false,
            stdout_bytes: 0,
            stderr_bytes: 0,
        };
        assert_eq!(cap.admit(OutputStream::Stdout, 1 << 20), 1 << 20);
        assert!(!cap.truncated);
    }
}
