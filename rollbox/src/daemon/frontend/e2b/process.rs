//! envd's `process.Process`: Start and Connect (server streams of a process's events), List,
//! SendInput, StreamInput (a client stream), CloseStdin, SendSignal and Update (a PTY's size).
//!
//! Each process started through `Start` has its own agent connection, owned by a task here, so
//! it outlives the HTTP stream that started it (the agent ends a connection's processes with
//! the connection). Its events fan out to the `Start` stream and to any `Connect` stream; a
//! client that goes away only unsubscribes. Each stream's queue is bounded and the pump waits
//! for room, so a client that reads slowly holds the agent back (and, through vsock credit,
//! the guest) instead of growing the daemon's memory. An ended process keeps its end event for
//! [`KEEP_ENDED`], so a late `Connect` still gets start + end. A process started with `pty`
//! runs on a terminal in the agent: its output is `data.pty`, `SendInput`/`StreamInput` type
//! into it and `Update` resizes it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use http_body_util::BodyExt;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::client::ExecEvent;
use rollbox_agent_protocol::messages::{
    ClientMessage, ExecRequest, ExitStatus, OutputStream, PtySize,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::super::api::{Action, Chunk, Reply, MAX_BODY};
use super::super::transport::Out;
use super::call::{connect_stream_response, decode, keepalive_of, read_body, rpc_error, Call};
use super::connect::{self, Code, RpcError};
use super::state::{
    gone_event, E2b, Process, Subscribers, GONE_KEY, SUBSCRIBER_EVENTS, SUBSCRIBER_STALL,
};
use super::wire::header;

/// How long an ended process's end event stays for `Connect`.
const KEEP_ENDED: Duration = Duration::from_secs(600);

#[derive(Clone, Copy)]
pub enum Stream {
    Start,
    Connect,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ProcessConfig {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// envd's `PTY` message.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Pty {
    size: Option<TermSize>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TermSize {
    rows: u32,
    cols: u32,
}

impl Pty {
    /// The agent's terminal size; envd's `size` is required and each side 1..=65535.
    fn size(&self) -> Result<PtySize, RpcError> {
        let Some(size) = &self.size else {
            return Err(RpcError::new(Code::InvalidArgument, "pty.size: required"));
        };
        match (u16::try_from(size.rows), u16::try_from(size.cols)) {
            (Ok(rows @ 1..), Ok(cols @ 1..)) => Ok(PtySize { rows, cols }),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "pty.size: rows {} and cols {} must each be 1..=65535",
                    size.rows, size.cols
                ),
            )),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize)]
struct SelectorRequest {
    #[serde(default)]
    process: Selector,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    signal: Option<Value>,
    #[serde(default)]
    pty: Option<Pty>,
}

impl Call {
    fn find(&self, selector: &Selector) -> Result<Arc<Process>, RpcError> {
        let processes = self.e2b.processes();
        let found = match (selector.pid, &selector.tag) {
            (Some(pid), _) => processes.get(&(self.id().to_string(), pid)).cloned(),
            (None, Some(tag)) => processes
                .iter()
                .find(|((sandbox, _), p)| sandbox == self.id() && p.tag.as_ref() == Some(tag))
                .map(|(_, p)| Arc::clone(p)),
            (None, None) => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "process: give a pid or a tag",
                ))
            }
        };
        found.ok_or_else(|| {
            RpcError::new(
                Code::NotFound,
                format!(
                    "process {}: not found in sandbox {} (only processes started through envd are known)",
                    selector.pid.map_or_else(|| format!("{:?}", selector.tag), |p| p.to_string()),
                    self.id()
                ),
            )
        })
    }

    /// A running process (stdin and signals need one).
    fn running(&self, selector: &Selector) -> Result<Arc<Process>, RpcError> {
        let process = self.find(selector)?;
        if process.subscribers().ended.is_some() {
            return Err(RpcError::new(
                Code::NotFound,
                format!("process {:?}: it has ended", selector.pid),
            ));
        }
        Ok(process)
    }

    pub async fn process_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        match method {
            "List" => {
                let processes: Vec<Value> = self
                    .e2b
                    .processes()
                    .iter()
                    .filter(|((sandbox, _), p)| {
                        sandbox == self.id() && p.subscribers().ended.is_none()
                    })
                    .map(|((_, pid), p)| json!({ "config": p.config, "pid": pid, "tag": p.tag }))
                    .collect();
                Ok(json!({ "processes": processes }))
            }
            "Update" => {
                let request: SelectorRequest = decode(body, method)?;
                let process = self.running(&request.process)?;
                // Nothing but the terminal size can be updated; without one there is nothing to do.
                let Some(pty) = &request.pty else {
                    return Ok(json!({}));
                };
                let size = pty.size()?;
                if !process.pty {
                    return Err(RpcError::new(
                        Code::FailedPrecondition,
                        format!("pty: process {:?} was started without a PTY, so it has no terminal to resize", request.process.pid),
                    ));
                }
                process
                    .client
                    .send(process.request, ClientMessage::Resize(size))
                    .await
                    .map_err(|e| rpc_error(self.id(), e))?;
                Ok(json!({}))
            }
            "SendInput" | "CloseStdin" | "SendSignal" => {
                let request: SelectorRequest = decode(body, method)?;
                let process = self.running(&request.process)?;
                let message = match method {
                    "SendInput" => input_message(&process, request.input.as_ref())?,
                    "CloseStdin" if process.pty => {
                        return Err(RpcError::new(
                            Code::FailedPrecondition,
                            "process runs on a PTY, whose input cannot be closed alone: send \\x04 (Ctrl-D) for end-of-file",
                        ))
                    }
                    "CloseStdin" => ClientMessage::StdinClose,
                    _ => ClientMessage::Signal {
                        signal: signal_number(request.signal.as_ref())?,
                        group: true,
                    },
                };
                process
                    .client
                    .send(process.request, message)
                    .await
                    .map_err(|e| rpc_error(self.id(), e))?;
                Ok(json!({}))
            }
            "StreamInput" => Err(RpcError::new(
                Code::InvalidArgument,
                "process.Process/StreamInput is a client stream: send it as application/connect+json",
            )),
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("process.Process/{other}: no such method"),
            )),
        }
    }

    /// `Start` and `Connect`: a stream of envelopes, errors in the end envelope.
    pub async fn streaming(&self, request: Request<Incoming>, kind: Stream) -> Response<Out> {
        let keepalive = keepalive_of(&request);
        let timeout_ms = connect::timeout_ms(header(&request, "connect-timeout-ms"));
        let (tx, rx) = mpsc::channel::<Chunk>(16);
        let subscribed = match read_body(request, MAX_BODY).await {
            Err(e) => Err(RpcError::new(Code::InvalidArgument, e)),
            Ok(body) => match connect::first_message(&body) {
                Err(e) => Err(RpcError::new(Code::InvalidArgument, e.to_string())),
                Ok(message) => match kind {
                    Stream::Start => self.start(message, timeout_ms).await,
                    Stream::Connect => self.connect(message),
                },
            },
        };
        match subscribed {
            Ok((pid, events)) => {
                tokio::spawn(forward(pid, events, tx, keepalive));
            }
            Err(error) => {
                let _ = tx.try_send(Ok(Bytes::from(connect::end_stream(Some(&error)))));
            }
        }
        connect_stream_response(Out::Stream(rx))
    }

    async fn start(
        &self,
        message: &[u8],
        timeout_ms: Option<u64>,
    ) -> Result<(u32, mpsc::Receiver<Value>), RpcError> {
        let request: StartRequest = decode(message, "StartRequest")?;
        let pty = request.pty.as_ref().map(Pty::size).transpose()?;
        let config = &request.process;
        if config.cmd.is_empty() {
            return Err(RpcError::new(Code::InvalidArgument, "process.cmd: empty"));
        }
        // A terminal always takes input.
        let stdin = pty.is_some() || request.stdin.unwrap_or(true);
        let mut argv = vec![config.cmd.clone()];
        argv.extend(config.args.iter().cloned());
        let mut exec = ExecRequest::argv(argv);
        let mut env = self.env_vars();
        env.extend(config.envs.clone());
        exec.env = env;
        exec.cwd = config
            .cwd
            .as_deref()
            .filter(|c| !c.is_empty())
            .map(|c| self.resolve(c));
        exec.user = self.user.clone();
        exec.timeout_ms = timeout_ms;
        exec.stdin = stdin;
        exec.pty = pty;
        let client = self.agent().await?;
        let mut handle = client
            .exec(exec)
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let pid = handle
            .started()
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let (tx, rx) = mpsc::channel(SUBSCRIBER_EVENTS);
        let process = Arc::new(Process {
            config: json!({ "cmd": config.cmd, "args": config.args, "envs": config.envs, "cwd": config.cwd }),
            tag: request.tag,
            stdin,
            pty: pty.is_some(),
            client: client.clone(),
            request: handle.id(),
            state: Mutex::new(Subscribers {
                subscribers: vec![tx],
                ended: None,
            }),
        });
        let key = (self.id().to_string(), pid);
        {
            let mut processes = self.e2b.processes();
            processes.retain(|_, p| {
                p.subscribers()
                    .ended
                    .as_ref()
                    .is_none_or(|(_, at)| at.elapsed() < KEEP_ENDED)
            });
            processes.insert(key, Arc::clone(&process));
        }
        // The pump: owns the agent connection until the process ends, whoever listens.
        let e2b = Arc::clone(&self.e2b);
        let sandbox = self.id().to_string();
        tokio::spawn(async move {
            loop {
                let (event, last) = match handle.next_event().await {
                    Ok(Some(ExecEvent::Output { stream, data, .. })) => {
                        let data = base64::engine::general_purpose::STANDARD.encode(&data);
                        let field = match stream {
                            OutputStream::Stdout => "stdout",
                            OutputStream::Stderr => "stderr",
                            OutputStream::Pty => "pty",
                        };
                        (json!({ "data": { field: data } }), false)
                    }
                    Ok(Some(ExecEvent::Exited(status))) => (end_event(&status), true),
                    Ok(Some(ExecEvent::Started { .. } | ExecEvent::Notice(_))) => continue,
                    Ok(None) => (
                        lost_or_gone(&e2b, &sandbox, "the agent ended the stream without an exit")
                            .await,
                        true,
                    ),
                    Err(e) => (
                        lost_or_gone(&e2b, &sandbox, &format!("the agent connection broke: {e}"))
                            .await,
                        true,
                    ),
                };
                let listening = process.subscribers().subscribers.clone();
                let dropped = deliver(&listening, &event).await;
                let mut subscribers = process.subscribers();
                subscribers
                    .subscribers
                    .retain(|s| !dropped.iter().any(|d| d.same_channel(s)));
                if last {
                    subscribers.ended = Some((event, Instant::now()));
                    subscribers.subscribers.clear();
                    break;
                }
            }
            let _ = client.close().await;
        });
        Ok((pid, rx))
    }

    fn connect(&self, message: &[u8]) -> Result<(u32, mpsc::Receiver<Value>), RpcError> {
        #[derive(Deserialize)]
        struct ConnectRequest {
            #[serde(default)]
            process: Selector,
        }
        let request: ConnectRequest = decode(message, "ConnectRequest")?;
        let process = self.find(&request.process)?;
        let pid = self
            .e2b
            .processes()
            .iter()
            .find(|(_, p)| Arc::ptr_eq(p, &process))
            .map(|((_, pid), _)| *pid)
            .unwrap_or_default();
        let (tx, rx) = mpsc::channel(SUBSCRIBER_EVENTS);
        let mut subscribers = process.subscribers();
        match &subscribers.ended {
            Some((end, _)) => {
                let _ = tx.try_send(end.clone());
            }
            None => subscribers.subscribers.push(tx),
        }
        Ok((pid, rx))
    }

    /// `StreamInput`, a client stream: a `start` naming the process, then `data` inputs (and
    /// `keepalive`s), each passed to the agent as it arrives; answered when the body ends.
    pub async fn stream_input(&self, request: Request<Incoming>) -> Response<Out> {
        let body = match self.take_input_stream(request.into_body()).await {
            Ok(()) => [connect::message(&json!({})), connect::end_stream(None)].concat(),
            Err(error) => connect::end_stream(Some(&error)),
        };
        connect_stream_response(Out::Full(Some(Bytes::from(body))))
    }

    async fn take_input_stream(&self, mut body: Incoming) -> Result<(), RpcError> {
        #[derive(Deserialize)]
        struct StreamInputRequest {
            #[serde(default)]
            start: Option<StartEvent>,
            #[serde(default)]
            data: Option<DataEvent>,
            #[serde(default)]
            keepalive: Option<Value>,
        }
        #[derive(Deserialize)]
        struct StartEvent {
            #[serde(default)]
            process: Selector,
        }
        #[derive(Deserialize)]
        struct DataEvent {
            #[serde(default)]
            input: Option<Value>,
        }
        let mut buffer: Vec<u8> = Vec::new();
        let mut process: Option<Arc<Process>> = None;
        let mut body_done = false;
        loop {
            while let Some(envelope) = connect::next_envelope(&buffer)
                .map_err(|e| RpcError::new(Code::InvalidArgument, e.to_string()))?
            {
                let event: StreamInputRequest = decode(envelope.payload, "StreamInputRequest")?;
                let taken = envelope.taken;
                match (event.start, event.data, &process) {
                    (Some(start), None, None) => process = Some(self.running(&start.process)?),
                    (Some(_), _, Some(_)) => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: a second start event (one stream feeds one process)",
                        ))
                    }
                    (None, Some(data), Some(process)) => {
                        let message = input_message(process, data.input.as_ref())?;
                        process
                            .client
                            .send(process.request, message)
                            .await
                            .map_err(|e| rpc_error(self.id(), e))?;
                    }
                    (None, Some(_), None) => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: data before the start event that names the process",
                        ))
                    }
                    (None, None, _) if event.keepalive.is_some() => {}
                    _ => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "StreamInput: an event is none of start, data or keepalive",
                        ))
                    }
                }
                buffer.drain(..taken);
            }
            if body_done {
                break;
            }
            match body.frame().await {
                None => body_done = true,
                Some(Err(e)) => {
                    return Err(RpcError::new(
                        Code::InvalidArgument,
                        format!("StreamInput: cannot read the request body: {e}"),
                    ))
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buffer.extend_from_slice(&data);
                    }
                    if buffer.len() > MAX_BODY {
                        return Err(RpcError::new(
                            Code::ResourceExhausted,
                            format!("StreamInput: one envelope is over {MAX_BODY} bytes"),
                        ));
                    }
                }
            }
        }
        if !buffer.is_empty() {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!(
                    "StreamInput: the body ends inside a Connect envelope ({} bytes left over)",
                    buffer.len()
                ),
            ));
        }
        match process {
            Some(_) => Ok(()),
            None => Err(RpcError::new(
                Code::InvalidArgument,
                "StreamInput: the stream has no start event naming the process",
            )),
        }
    }
}

/// The agent input of a `ProcessInput` (`{stdin}` or `{pty}`, base64) for `process`.
fn input_message(process: &Process, input: Option<&Value>) -> Result<ClientMessage, RpcError> {
    let input = input.unwrap_or(&Value::Null);
    let (field, data) = match (input.get("stdin"), input.get("pty")) {
        (Some(data), None) => ("stdin", data),
        (None, Some(data)) => ("pty", data),
        _ => {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "input: give exactly one of stdin or pty",
            ))
        }
    };
    if field == "pty" && !process.pty {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "input.pty: the process was started without a PTY (send input.stdin)",
        ));
    }
    if !process.stdin {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            "process was started with stdin=false: its stdin is /dev/null",
        ));
    }
    let data = data.as_str().ok_or_else(|| {
        RpcError::new(
            Code::InvalidArgument,
            format!("input.{field}: not a base64 string"),
        )
    })?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("input.{field}: {e}")))?;
    Ok(ClientMessage::Stdin { data })
}

/// The signal of a `SendSignal` request (enum name or number).
fn signal_number(signal: Option<&Value>) -> Result<i32, RpcError> {
    match signal {
        Some(Value::String(name)) => match name.as_str() {
            "SIGNAL_SIGKILL" => Ok(9),
            "SIGNAL_SIGTERM" => Ok(15),
            other => Err(RpcError::new(
                Code::InvalidArgument,
                format!("signal: {other:?} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
            )),
        },
        Some(Value::Number(n)) => match n.as_i64() {
            Some(9) => Ok(9),
            Some(15) => Ok(15),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("signal: {n} is not 9 (SIGKILL) or 15 (SIGTERM)"),
            )),
        },
        _ => Err(RpcError::new(Code::InvalidArgument, "signal: required")),
    }
}

/// envd's `EndEvent` for an agent exit status (Go's ProcessState wording).
fn end_event(status: &ExitStatus) -> Value {
    let (exit_code, exited, text) = match (status.code, status.signal) {
        (Some(code), _) => (code, true, format!("exit status {code}")),
        (None, Some(9)) => (-1, false, "signal: killed".to_string()),
        (None, Some(signal)) => (-1, false, format!("signal: {signal}")),
        (None, None) => (-1, false, "unknown".to_string()),
    };
    let mut end = json!({ "exitCode": exit_code, "exited": exited, "status": text });
    if status.timed_out {
        end["error"] = json!("the command's timeout expired: its process group was killed");
    }
    json!({ "end": end })
}

/// The end of a process whose agent stream broke: the sandbox's gone event when it was
/// killed (the agent's connection breaks before the kill is recorded, so this waits a
/// little for it), else an end saying why the exit status was lost.
async fn lost_or_gone(e2b: &E2b, id: &str, why: &str) -> Value {
    for _ in 0..20 {
        let live = matches!(
            e2b.core.handle(Action::GetSandbox(id.to_string())).await,
            Ok(Reply::Sandbox { sandbox, .. }) if sandbox.state.is_live()
        );
        if !live {
            return gone_event(id);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lost_event(why)
}

fn lost_event(message: &str) -> Value {
    json!({ "end": { "exitCode": -1, "exited": false, "status": "unknown", "error": message } })
}

/// Sends `event` to every stream, waiting while a queue is full; returns the streams that are
/// gone or took nothing for [`SUBSCRIBER_STALL`], for the pump to drop.
async fn deliver(subscribers: &[mpsc::Sender<Value>], event: &Value) -> Vec<mpsc::Sender<Value>> {
    let sends = subscribers
        .iter()
        .map(|s| tokio::time::timeout(SUBSCRIBER_STALL, s.send(event.clone())));
    let sent = futures_util::future::join_all(sends).await;
    subscribers
        .iter()
        .zip(sent)
        .filter(|(_, sent)| !matches!(sent, Ok(Ok(()))))
        .map(|(s, _)| s.clone())
        .collect()
}

/// Writes a process's events to one stream: `start`, then the events, `keepalive` after
/// `keepalive` of silence, and the end-of-stream envelope after `end`.
async fn forward(
    pid: u32,
    mut events: mpsc::Receiver<Value>,
    tx: mpsc::Sender<Chunk>,
    keepalive: Duration,
) {
    let send = |event: Value| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Bytes::from(connect::message(
                &json!({ "event": event }),
            ))))
            .await
            .is_ok()
        }
    };
    if !send(json!({ "start": { "pid": pid } })).await {
        return;
    }
    loop {
        match tokio::time::timeout(keepalive, events.recv()).await {
            Err(_) => {
                if !send(json!({ "keepalive": {} })).await {
                    return;
                }
            }
            Ok(Some(event)) => {
                if let Some(message) = event.get(GONE_KEY).and_then(Value::as_str) {
                    let error = RpcError::new(Code::Unavailable, message);
                    let _ = tx
                        .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                        .await;
                    return;
                }
                let last = event.get("end").is_some();
                if !send(event).await {
                    return;
                }
                if last {
                    let _ = tx.send(Ok(Bytes::from(connect::end_stream(None)))).await;
                    return;
                }
            }
            Ok(None) => {
                let error = RpcError::new(Code::Unavailable, "the process's event stream ended");
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pty_sizes_are_checked_by_name() {
        let pty: Pty =
            serde_json::from_value(json!({"size": {"rows": 24, "cols": 80}})).expect("pty");
        assert_eq!(pty.size(), Ok(PtySize { rows: 24, cols: 80 }));
        let missing: Pty = serde_json::from_value(json!({})).expect("pty");
        assert_eq!(
            missing.size().map_err(|e| e.message),
            Err("pty.size: required".into())
        );
        // The SDK leaves zero values out: an absent cols is 0.
        let zero: Pty = serde_json::from_value(json!({"size": {"rows": 24}})).expect("pty");
        let huge: Pty =
            serde_json::from_value(json!({"size": {"rows": 70000, "cols": 1}})).expect("pty");
        for (pty, text) in [
            (zero, "rows 24 and cols 0"),
            (huge, "rows 70000 and cols 1"),
        ] {
            let err = pty.size().expect_err("refused");
            assert_eq!(err.code, Code::InvalidArgument);
            assert!(err.message.contains(text), "{err}");
        }
    }

    #[test]
    fn end_events_use_go_wording() {
        let mut status = ExitStatus {
            code: Some(3),
            signal: None,
            timed_out: false,
            oom_killed: false,
            oom_detection: rollbox_agent_protocol::messages::OomDetection::default(),
            truncated: false,
            stdout_bytes: 0,
            stderr_bytes: 0,
            duration_ms: 1,
        };
        assert_eq!(
            end_event(&status),
            json!({"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}})
        );
        status.code = None;
        status.signal = Some(9);
        assert_eq!(end_event(&status)["end"]["status"], "signal: killed");
        assert_eq!(signal_number(Some(&json!("SIGNAL_SIGKILL"))), Ok(9));
        assert_eq!(signal_number(Some(&json!(15))), Ok(15));
        assert!(signal_number(Some(&json!("SIGHUP"))).is_err());
    }
}
