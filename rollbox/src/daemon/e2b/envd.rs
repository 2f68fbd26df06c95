//! envd's data plane, translated to the rollbox agent: `process.Process` and
//! `filesystem.Filesystem` Connect RPCs (JSON codec), `/files`, `/health` and `/envs`.
//!
//! Each process started through `Start` has its own agent connection, owned by a task here, so
//! it outlives the HTTP stream that started it (the agent ends a connection's processes with
//! the connection). Its events fan out to the `Start` stream and to any `Connect` stream; a
//! client that goes away only unsubscribes. An ended process keeps its end event for
//! [`KEEP_ENDED`], so a late `Connect` still gets start + end.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use base64::Engine as _;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::client::{AgentClient, ClientError, ExecEvent};
use rollbox_agent_protocol::messages::{
    ClientMessage, ExecRequest, ExitStatus, FileInfo, FileKind, OutputStream,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::api::{Action, ApiError, FileOp, Sandbox, MAX_BODY, MAX_UPLOAD};
use super::super::guest::Chunk;
use super::super::http::Out;
use super::super::Reply;
use super::connect::{self, Code, RpcError};
use super::{json, no_content, query_pairs, rfc3339, E2b, Target, ENVD_PORT, ENV_VARS_KEY};

/// How long an ended process's end event stays for `Connect`.
const KEEP_ENDED: Duration = Duration::from_secs(600);
/// envd's default keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// Deepest `ListDir` recursion.
const MAX_DEPTH: u32 = 32;

/// Processes started through envd: (sandbox id, pid) → the process.
pub(super) type Processes = HashMap<(String, u32), Arc<Process>>;

pub(super) struct Process {
    /// `ProcessConfig` as `List` shows it.
    config: Value,
    tag: Option<String>,
    stdin: bool,
    client: AgentClient,
    /// The exec's request id on `client`: where the agent takes stdin and signals.
    request: u64,
    state: Mutex<Watchers>,
}

#[derive(Default)]
struct Watchers {
    subscribers: Vec<mpsc::UnboundedSender<Value>>,
    /// The `end` event, once the process ended, and when.
    ended: Option<(Value, Instant)>,
}

impl Process {
    fn watchers(&self) -> MutexGuard<'_, Watchers> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl E2b {
    /// Drops the process table entries of a sandbox that ended.
    pub(super) fn forget_processes(&self, id: &str) {
        self.processes().retain(|(sandbox, _), _| sandbox != id);
    }
}

/// A data-plane request for a sandbox that is not there (the texts the SDK keys on).
fn proxy_error(id: &str, message: String) -> Response<Out> {
    json(
        502,
        &json!({ "sandboxId": id, "message": message, "code": 502 }),
    )
}

pub(super) async fn respond(
    e2b: &Arc<E2b>,
    target: Target,
    request: Request<Incoming>,
) -> Response<Out> {
    let id = target.id.clone();
    let sandbox = match e2b.daemon.handle(Action::GetSandbox(id.clone())).await {
        Ok(Reply::Sandbox { sandbox, .. }) if sandbox.state.is_live() => sandbox,
        _ => return proxy_error(&id, format!("The sandbox {id} was not found")),
    };
    // Other ports are the guest's own services, reached through the agent: envd's access token
    // is not theirs to check (the code interpreter SDK sends it on /execute but not /contexts).
    match target.port {
        Some(ENVD_PORT) => {}
        Some(port) => return forward_port(e2b, &id, port, request).await,
        None => return proxy_error(&id, format!("sandbox {id}: port is not open (no port)")),
    }
    let path = request.uri().path().to_string();
    let method = request.method().as_str().to_string();
    if method == "GET" && path == "/health" {
        return no_content();
    }
    let token_ok = super::header(&request, "x-access-token")
        .is_some_and(|t| t.trim() == e2b.access_token(&id));
    let rpc = path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
    if !token_ok {
        let message = format!("sandbox {id}: missing or wrong X-Access-Token (the envdAccessToken of the create answer)");
        return if rpc {
            unary_error(&RpcError::new(Code::Unauthenticated, message))
        } else {
            json(401, &json!({ "code": 401, "message": message }))
        };
    }
    let user = basic_user(&request);
    let call = Call {
        e2b: Arc::clone(e2b),
        sandbox,
        user,
    };
    match (method.as_str(), path.as_str()) {
        ("GET", "/envs") => json(200, &json!(call.env_vars())),
        ("GET", "/files") => call.download(request).await,
        ("POST", "/files") => call.upload(request).await,
        ("POST", "/process.Process/Start") => call.streaming(request, Stream::Start).await,
        ("POST", "/process.Process/Connect") => call.streaming(request, Stream::Connect).await,
        ("POST", rpc_path) if rpc => call.unary(request, rpc_path).await,
        _ => json(
            404,
            &json!({ "code": 404, "message": format!("envd has no route {method} {path}") }),
        ),
    }
}

/// A request for guest `port`, forwarded through the agent; 502 "port is not open" when
/// nothing listens there (the text the SDK keys on).
async fn forward_port(
    e2b: &Arc<E2b>,
    id: &str,
    port: u16,
    request: Request<Incoming>,
) -> Response<Out> {
    let not_open = |why: String| proxy_error(id, format!("sandbox {id}: port is not open ({why})"));
    match e2b.daemon.guest_tcp(id, port).await {
        Ok(pipe) => super::forward::forward(pipe, port, request)
            .await
            .unwrap_or_else(not_open),
        Err(e) => not_open(e.to_string()),
    }
}

/// The user of `Authorization: Basic base64("user:")`.
fn basic_user(request: &Request<Incoming>) -> Option<String> {
    let encoded = super::header(request, "authorization")?.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split(':').next().unwrap_or("");
    (!user.is_empty()).then(|| user.to_string())
}

fn unary_error(error: &RpcError) -> Response<Out> {
    json(error.code.http_status(), &error.body())
}

/// An agent failure as a Connect error.
fn rpc_error(id: &str, error: ClientError) -> RpcError {
    match error {
        ClientError::Agent(info) => {
            let code = match info.code.as_str() {
                "ENOENT" => Code::NotFound,
                "EEXIST" | "ENOTEMPTY" => Code::AlreadyExists,
                "EACCES" | "EPERM" => Code::PermissionDenied,
                "bad_request" | "EINVAL" | "EISDIR" | "ENOTDIR" | "ENAMETOOLONG" | "ELOOP" => {
                    Code::InvalidArgument
                }
                _ => Code::Internal,
            };
            RpcError::new(code, info.message)
        }
        other => RpcError::new(
            Code::Unavailable,
            format!("sandbox {id}: the agent: {other}"),
        ),
    }
}

/// A daemon refusal as a Connect error.
fn api_rpc_error(error: ApiError) -> RpcError {
    let code = match error.status() {
        400 => Code::InvalidArgument,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    RpcError::new(code, error.to_string())
}

#[derive(Clone, Copy)]
enum Stream {
    Start,
    Connect,
}

/// One data-plane request: the sandbox and the envd user it runs as.
struct Call {
    e2b: Arc<E2b>,
    sandbox: Sandbox,
    user: Option<String>,
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
    pty: Option<Value>,
    tag: Option<String>,
    stdin: Option<bool>,
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
}

#[derive(Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

fn decode<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, RpcError> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    serde_json::from_slice(body)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("{what}: {e}")))
}

async fn read_body(request: Request<Incoming>, limit: usize) -> Result<Bytes, String> {
    Limited::new(request.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                format!("the request body is over {limit} bytes")
            } else {
                format!("cannot read the request body: {e}")
            }
        })
}

impl Call {
    fn id(&self) -> &str {
        &self.sandbox.id
    }

    /// The sandbox's env; sandboxes made before E2B envVars became the daemon's env kept
    /// them as JSON in metadata [`ENV_VARS_KEY`].
    fn env_vars(&self) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> = self
            .sandbox
            .metadata
            .get(ENV_VARS_KEY)
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        env.extend(self.sandbox.env.clone());
        env
    }

    /// The user's home: where relative paths and `~` resolve.
    fn home(&self) -> String {
        match self.user.as_deref() {
            None | Some("root") => "/root".to_string(),
            Some(user) => format!("/home/{user}"),
        }
    }

    fn resolve(&self, path: &str) -> String {
        let home = self.home();
        if path.is_empty() || path == "~" {
            home
        } else if let Some(rest) = path.strip_prefix("~/") {
            format!("{home}/{rest}")
        } else if path.starts_with('/') {
            path.to_string()
        } else {
            format!("{home}/{path}")
        }
    }

    async fn agent(&self) -> Result<AgentClient, RpcError> {
        self.e2b
            .daemon
            .agent(self.id())
            .await
            .map_err(api_rpc_error)
    }

    async fn unary(&self, request: Request<Incoming>, path: &str) -> Response<Out> {
        let body = match read_body(request, MAX_BODY).await {
            Ok(body) => body,
            Err(e) => return unary_error(&RpcError::new(Code::InvalidArgument, e)),
        };
        let method = path.rsplit('/').next().unwrap_or("");
        let result = if path.starts_with("/process.Process/") {
            self.process_call(method, &body).await
        } else {
            self.filesystem_call(method, &body).await
        };
        match result {
            Ok(value) => json(200, &value),
            Err(e) => unary_error(&e),
        }
    }

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
        if process.watchers().ended.is_some() {
            return Err(RpcError::new(
                Code::NotFound,
                format!("process {:?}: it has ended", selector.pid),
            ));
        }
        Ok(process)
    }

    async fn process_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        match method {
            "List" => {
                let processes: Vec<Value> = self
                    .e2b
                    .processes()
                    .iter()
                    .filter(|((sandbox, _), p)| {
                        sandbox == self.id() && p.watchers().ended.is_none()
                    })
                    .map(|((_, pid), p)| json!({ "config": p.config, "pid": pid, "tag": p.tag }))
                    .collect();
                Ok(json!({ "processes": processes }))
            }
            "SendInput" | "CloseStdin" | "SendSignal" => {
                let request: SelectorRequest = decode(body, method)?;
                let process = self.running(&request.process)?;
                let message = match method {
                    "SendInput" => {
                        if !process.stdin {
                            return Err(RpcError::new(
                                Code::FailedPrecondition,
                                "process was started with stdin=false: its stdin is /dev/null",
                            ));
                        }
                        let input = request.input.unwrap_or(Value::Null);
                        let Some(data) = input.get("stdin").and_then(Value::as_str) else {
                            return Err(RpcError::new(
                                Code::Unimplemented,
                                "input: only stdin is supported (rollbox has no PTY)",
                            ));
                        };
                        let data = base64::engine::general_purpose::STANDARD
                            .decode(data)
                            .map_err(|e| {
                                RpcError::new(Code::InvalidArgument, format!("input.stdin: {e}"))
                            })?;
                        ClientMessage::Stdin { data }
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
            "Update" | "StreamInput" => Err(RpcError::new(
                Code::Unimplemented,
                format!("process.Process/{method} is not supported by rollbox (no PTY, no client streams)"),
            )),
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("process.Process/{other}: no such method"),
            )),
        }
    }

    async fn filesystem_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        let request: PathRequest = decode(body, method)?;
        let client = self.agent().await?;
        let fail = |e| rpc_error(self.id(), e);
        let result = match method {
            "Stat" => {
                let info = client.lstat(&self.resolve(&request.path)).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "ListDir" => {
                let depth = request.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
                let mut entries = Vec::new();
                let mut dirs = vec![(self.resolve(&request.path), 1)];
                while let Some((dir, level)) = dirs.pop() {
                    for info in client.list(&dir).await.map_err(fail)? {
                        if info.kind == FileKind::Dir && level < depth {
                            dirs.push((info.path.clone(), level + 1));
                        }
                        entries.push(entry(&info));
                    }
                }
                Ok(json!({ "entries": entries }))
            }
            "MakeDir" => {
                let path = self.resolve(&request.path);
                if client.lstat(&path).await.is_ok() {
                    return Err(RpcError::new(
                        Code::AlreadyExists,
                        format!("path: {path} already exists"),
                    ));
                }
                client.mkdir(&path, true).await.map_err(fail)?;
                let info = client.lstat(&path).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Move" => {
                let (from, to) = (self.resolve(&request.source), self.resolve(&request.destination));
                client.rename(&from, &to).await.map_err(fail)?;
                let info = client.lstat(&to).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Remove" => {
                client
                    .remove(&self.resolve(&request.path), true)
                    .await
                    .map_err(fail)?;
                Ok(json!({}))
            }
            "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
                Err(RpcError::new(
                    Code::Unimplemented,
                    format!("filesystem.Filesystem/{method}: watching is not supported by rollbox (the agent has no inotify operation)"),
                ))
            }
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other}: no such method"),
            )),
        };
        let _ = client.close().await;
        result
    }

    /// `Start` and `Connect`: a stream of envelopes, errors in the end envelope.
    async fn streaming(&self, request: Request<Incoming>, kind: Stream) -> Response<Out> {
        let keepalive = super::header(&request, "keepalive-ping-interval")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|s| *s > 0)
            .map_or(DEFAULT_KEEPALIVE, Duration::from_secs);
        let timeout_ms = connect::timeout_ms(super::header(&request, "connect-timeout-ms"));
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
        let mut response = Response::new(Out::Stream(rx));
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/connect+json"),
        );
        response
    }

    async fn start(
        &self,
        message: &[u8],
        timeout_ms: Option<u64>,
    ) -> Result<(u32, mpsc::UnboundedReceiver<Value>), RpcError> {
        let request: StartRequest = decode(message, "StartRequest")?;
        if request.pty.is_some() {
            return Err(RpcError::new(
                Code::Unimplemented,
                "pty: terminals are not supported by rollbox; run without a PTY",
            ));
        }
        let config = &request.process;
        if config.cmd.is_empty() {
            return Err(RpcError::new(Code::InvalidArgument, "process.cmd: empty"));
        }
        let stdin = request.stdin.unwrap_or(true);
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
        let client = self.agent().await?;
        let mut handle = client
            .exec(exec)
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let pid = handle
            .started()
            .await
            .map_err(|e| rpc_error(self.id(), e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let process = Arc::new(Process {
            config: json!({ "cmd": config.cmd, "args": config.args, "envs": config.envs, "cwd": config.cwd }),
            tag: request.tag,
            stdin,
            client: client.clone(),
            request: handle.id(),
            state: Mutex::new(Watchers {
                subscribers: vec![tx],
                ended: None,
            }),
        });
        let key = (self.id().to_string(), pid);
        {
            let mut processes = self.e2b.processes();
            processes.retain(|_, p| {
                p.watchers()
                    .ended
                    .as_ref()
                    .is_none_or(|(_, at)| at.elapsed() < KEEP_ENDED)
            });
            processes.insert(key, Arc::clone(&process));
        }
        // The pump: owns the agent connection until the process ends, whoever listens.
        tokio::spawn(async move {
            loop {
                let (event, last) = match handle.next_event().await {
                    Ok(Some(ExecEvent::Output { stream, data, .. })) => {
                        let data = base64::engine::general_purpose::STANDARD.encode(&data);
                        let field = match stream {
                            OutputStream::Stdout => "stdout",
                            OutputStream::Stderr => "stderr",
                        };
                        (json!({ "data": { field: data } }), false)
                    }
                    Ok(Some(ExecEvent::Exited(status))) => (end_event(&status), true),
                    Ok(Some(ExecEvent::Started { .. } | ExecEvent::Notice(_))) => continue,
                    Ok(None) => (
                        lost_event("the agent ended the stream without an exit"),
                        true,
                    ),
                    Err(e) => (
                        lost_event(&format!("the agent connection broke: {e}")),
                        true,
                    ),
                };
                let mut watchers = process.watchers();
                watchers
                    .subscribers
                    .retain(|s| s.send(event.clone()).is_ok());
                if last {
                    watchers.ended = Some((event, Instant::now()));
                    watchers.subscribers.clear();
                    break;
                }
            }
            let _ = client.close().await;
        });
        Ok((pid, rx))
    }

    fn connect(&self, message: &[u8]) -> Result<(u32, mpsc::UnboundedReceiver<Value>), RpcError> {
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
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watchers = process.watchers();
        match &watchers.ended {
            Some((end, _)) => {
                let _ = tx.send(end.clone());
            }
            None => watchers.subscribers.push(tx),
        }
        Ok((pid, rx))
    }

    async fn download(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = self.with_query_user(&query);
        let Some(path) = query_value(&query, "path") else {
            return files_error(400, "path: required".to_string());
        };
        let path = call.resolve(&path);
        match self
            .e2b
            .daemon
            .file(self.id(), FileOp::Read { path: path.clone() })
            .await
        {
            Ok(Reply::Stream { body, .. }) => {
                let mut response = Response::new(Out::Stream(body));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                response
            }
            Ok(other) => files_error(500, format!("path {path}: the read answered {other:?}")),
            Err(e) => files_error(e.status(), format!("path {path}: {e}")),
        }
    }

    /// The same call as the `?username=` user, when the query names one.
    fn with_query_user(&self, query: &str) -> Call {
        Call {
            e2b: Arc::clone(&self.e2b),
            sandbox: self.sandbox.clone(),
            user: query_value(query, "username")
                .filter(|u| !u.is_empty())
                .or_else(|| self.user.clone()),
        }
    }

    async fn upload(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = self.with_query_user(&query);
        let content_type = super::header(&request, "content-type")
            .unwrap_or("")
            .to_string();
        let gzip = super::header(&request, "content-encoding")
            .is_some_and(|e| e.trim().eq_ignore_ascii_case("gzip"));
        let body = match read_body(request, MAX_UPLOAD).await {
            Ok(body) => body,
            Err(e) if e.contains("over") => return files_error(413, e),
            Err(e) => return files_error(400, e),
        };
        let body = if gzip {
            let mut out = Vec::new();
            let mut decoder = flate2::read::GzDecoder::new(&body[..]).take(MAX_UPLOAD as u64 + 1);
            if let Err(e) = std::io::Read::read_to_end(&mut decoder, &mut out) {
                return files_error(400, format!("the gzip body does not decode: {e}"));
            }
            if out.len() > MAX_UPLOAD {
                return files_error(413, format!("the decoded body is over {MAX_UPLOAD} bytes"));
            }
            Bytes::from(out)
        } else {
            body
        };
        let query_path = query_value(&query, "path").filter(|p| !p.is_empty());
        let files: Vec<(String, Bytes)> = if content_type.starts_with("multipart/form-data") {
            let parts = match multipart(&content_type, &body) {
                Ok(parts) => parts,
                Err(e) => return files_error(400, e),
            };
            let single = parts.len() == 1;
            let mut files = Vec::new();
            for (filename, data) in parts {
                let path = match (&query_path, filename) {
                    (Some(path), _) if single => path.clone(),
                    (_, Some(name)) if !name.is_empty() => name,
                    _ => {
                        return files_error(
                            400,
                            "path: a part has no filename and the query no path".to_string(),
                        )
                    }
                };
                files.push((path, data));
            }
            files
        } else {
            match query_path {
                Some(path) => vec![(path, body)],
                None => {
                    return files_error(400, "path: required for an octet-stream upload".into())
                }
            }
        };
        if files.is_empty() {
            return files_error(400, "the multipart body has no file part".into());
        }
        let mut written = Vec::new();
        for (path, data) in files {
            let path = call.resolve(&path);
            let op = FileOp::Write {
                path: path.clone(),
                mode: None,
                parents: true,
            };
            if let Err(e) = self.e2b.daemon.upload(self.id(), op, &data[..]).await {
                return files_error(e.status(), format!("path {path}: {e}"));
            }
            let name = path.rsplit('/').next().unwrap_or("").to_string();
            written.push(json!({ "path": path, "name": name, "type": "file" }));
        }
        json(200, &Value::Array(written))
    }
}

use std::io::Read as _;

/// envd's `/files` error body.
fn files_error(status: u16, message: String) -> Response<Out> {
    json(status, &json!({ "code": status, "message": message }))
}

fn query_value(query: &str, name: &str) -> Option<String> {
    query_pairs(query)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

/// The file parts of a multipart/form-data body: (filename, data).
fn multipart(content_type: &str, body: &[u8]) -> Result<Vec<(Option<String>, Bytes)>, String> {
    let boundary = content_type
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"').to_string())
        .ok_or_else(|| "content-type: multipart without a boundary".to_string())?;
    let delimiter = format!("--{boundary}").into_bytes();
    let mut parts = Vec::new();
    let mut rest = match find(body, &delimiter) {
        Some(at) => &body[at + delimiter.len()..],
        None => return Err("multipart: the body has no boundary line".into()),
    };
    loop {
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        let rest_after_crlf = rest.strip_prefix(b"\r\n").unwrap_or(rest);
        let headers_end = find(rest_after_crlf, b"\r\n\r\n")
            .ok_or_else(|| "multipart: a part's headers do not end".to_string())?;
        let headers = String::from_utf8_lossy(&rest_after_crlf[..headers_end]).to_string();
        let data_start = &rest_after_crlf[headers_end + 4..];
        let mut closing = b"\r\n".to_vec();
        closing.extend_from_slice(&delimiter);
        let data_end = find(data_start, &closing)
            .ok_or_else(|| "multipart: a part does not end with the boundary".to_string())?;
        let data = Bytes::copy_from_slice(&data_start[..data_end]);
        let disposition = headers
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or("");
        let filename = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("filename=")
                .map(|f| f.trim_matches('"').to_string())
        });
        let name = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("name=")
                .map(|f| f.trim_matches('"').to_string())
        });
        if name.as_deref() == Some("file") || filename.is_some() {
            parts.push((filename, data));
        }
        rest = &data_start[data_end + closing.len()..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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

fn lost_event(message: &str) -> Value {
    json!({ "end": { "exitCode": -1, "exited": false, "status": "unknown", "error": message } })
}

/// Writes a process's events to one stream: `start`, then the events, `keepalive` after
/// `keepalive` of silence, and the end-of-stream envelope after `end`.
async fn forward(
    pid: u32,
    mut events: mpsc::UnboundedReceiver<Value>,
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

/// envd's `EntryInfo`.
fn entry(info: &FileInfo) -> Value {
    let (kind, letter) = match info.kind {
        FileKind::File => ("FILE_TYPE_FILE", '-'),
        FileKind::Dir => ("FILE_TYPE_DIRECTORY", 'd'),
        FileKind::Symlink => ("FILE_TYPE_SYMLINK", 'l'),
        FileKind::Other => ("FILE_TYPE_UNSPECIFIED", '?'),
    };
    let mut permissions = String::from(letter);
    for shift in [6, 3, 0] {
        let bits = (info.mode >> shift) & 7;
        permissions.push(if bits & 4 != 0 { 'r' } else { '-' });
        permissions.push(if bits & 2 != 0 { 'w' } else { '-' });
        permissions.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let name_of = |id: u32| {
        if id == 0 {
            "root".to_string()
        } else {
            id.to_string()
        }
    };
    let mtime_ms = u64::try_from(info.mtime_ns / 1_000_000).unwrap_or(0);
    let mut value = json!({
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "permissions": permissions,
        "owner": name_of(info.uid),
        "group": name_of(info.gid),
        "modifiedTime": rfc3339(mtime_ms),
    });
    if let Some(target) = &info.link_target {
        value["symlinkTarget"] = json!(target);
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_parts_keep_full_path_filenames() {
        let body = b"--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/c\"\r\n\r\n\r\n--XY--\r\n";
        let parts = multipart("multipart/form-data; boundary=XY", body).expect("parts");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0.as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(parts[1].0.as_deref(), Some("rel/c"));
        assert!(parts[1].1.is_empty());
        assert!(multipart("multipart/form-data", body).is_err());
        assert!(multipart("multipart/form-data; boundary=XY", b"--XY\r\nno end").is_err());
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
