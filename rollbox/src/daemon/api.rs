//! The daemon's API: request and response types, the typed [`Action`] every request parses
//! into, and [`ApiError`], which carries the HTTP status of a refusal.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The largest request body the daemon reads.
pub const MAX_BODY: usize = 1 << 20;
/// The largest file or tar upload (streamed to the agent, never held whole).
pub const MAX_UPLOAD: usize = 256 << 20;
/// Default and largest stdout + stderr an exec keeps (the rest is dropped, `truncated` set).
pub const DEFAULT_OUTPUT_BYTES: u64 = 16 << 20;
pub const MAX_OUTPUT_BYTES: u64 = 64 << 20;
/// Longest exec timeout: one day.
pub const MAX_EXEC_TIMEOUT_S: f64 = 86_400.0;

/// Every route the daemon answers, as (method, path with `{name}` placeholders). The OpenAPI
/// document (docs/api/openapi.yaml) lists exactly these; a test checks both ways.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("GET", "/templates"),
    ("POST", "/templates"),
    ("GET", "/templates/{name}"),
    ("DELETE", "/templates/{name}"),
    ("GET", "/sandboxes"),
    ("POST", "/sandboxes"),
    ("DELETE", "/sandboxes"),
    ("POST", "/sandboxes/batch"),
    ("GET", "/sandboxes/{id}"),
    ("DELETE", "/sandboxes/{id}"),
    ("GET", "/sandboxes/{id}/usage"),
    ("POST", "/sandboxes/{id}/keepalive"),
    ("POST", "/sandboxes/{id}/pause"),
    ("POST", "/sandboxes/{id}/resume"),
    ("POST", "/sandboxes/{id}/exec"),
    ("POST", "/sandboxes/{id}/processes/{pid}/signal"),
    ("POST", "/sandboxes/{id}/processes/{pid}/stdin"),
    ("GET", "/sandboxes/{id}/files"),
    ("PUT", "/sandboxes/{id}/files"),
    ("DELETE", "/sandboxes/{id}/files"),
    ("GET", "/sandboxes/{id}/files/stat"),
    ("GET", "/sandboxes/{id}/files/list"),
    ("GET", "/sandboxes/{id}/tar"),
    ("PUT", "/sandboxes/{id}/tar"),
    ("POST", "/sandboxes/{id}/snapshots"),
    ("POST", "/sandboxes/{id}/fork"),
    ("POST", "/sandboxes/{id}/reset"),
    ("GET", "/snapshots"),
    ("GET", "/snapshots/{snapshot}"),
    ("DELETE", "/snapshots/{snapshot}"),
    ("GET", "/sandboxes/{id}/ports/{port}"),
];
/// Most sandboxes one fork makes.
pub const MAX_FORK: u32 = 64;
/// Most sandboxes one batch create makes.
pub const MAX_BATCH: u32 = 1000;
/// Most ids one `ids=` query names.
const MAX_IDS: usize = 1000;

/// Limits on what a request may ask for.
pub const MAX_VCPUS: u32 = 32;
/// Smallest `cpu_limit`, in cores.
pub const MIN_CPU_LIMIT: f64 = 0.01;
/// Largest guest memory in MiB.
pub const MAX_MEMORY_MIB: u32 = 256 * 1024;
/// Longest TTL (and idle TTL): 30 days.
pub const MAX_TTL_S: u64 = 30 * 24 * 3600;
const MAX_LABELS: usize = 32;
const MAX_METADATA: usize = 64;
const MAX_LIST_LIMIT: u32 = 1000;
const DEFAULT_LIST_LIMIT: u32 = 100;

/// A refused or failed request; [`ApiError::status`] is its HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing or wrong API key: send `Authorization: Bearer KEY`")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("{0}")]
    Conflict(String),
    #[error("request body is over {0} bytes")]
    TooLarge(usize),
    #[error("{0} creates are already in flight; retry later")]
    Overloaded(usize),
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Unavailable(String),
    /// A guest service the request is for did not answer (nothing listens on its port).
    #[error("{0}")]
    BadGateway(String),
}

impl ApiError {
    /// The HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::BadRequest(_) => 400,
            ApiError::Unauthorized => 401,
            ApiError::NotFound(_) => 404,
            ApiError::MethodNotAllowed { .. } => 405,
            ApiError::Conflict(_) => 409,
            ApiError::TooLarge(_) => 413,
            ApiError::Overloaded(_) => 429,
            ApiError::Internal(_) => 500,
            ApiError::Unavailable(_) => 503,
            ApiError::BadGateway(_) => 502,
        }
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// A sandbox's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Its VMM is being started.
    Creating,
    Running,
    Paused,
    /// Its VMM ended on its own (guest power-off, crash).
    Exited,
    /// The create did not finish (see `end_reason`).
    Failed,
    /// Ended by DELETE.
    Deleted,
    /// Ended by its TTL or idle TTL.
    Expired,
}

impl State {
    pub const ALL: [State; 7] = [
        State::Creating,
        State::Running,
        State::Paused,
        State::Exited,
        State::Failed,
        State::Deleted,
        State::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Creating => "creating",
            State::Running => "running",
            State::Paused => "paused",
            State::Exited => "exited",
            State::Failed => "failed",
            State::Deleted => "deleted",
            State::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Option<State> {
        State::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Whether a VMM process may belong to it.
    pub fn is_live(self) -> bool {
        matches!(self, State::Creating | State::Running | State::Paused)
    }
}

/// A registered template: what a sandbox boots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    pub kernel: PathBuf,
    pub rootfs: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub created_at_ms: u64,
    /// The image its rootfs was built from (`reference@digest`), when it was built by the daemon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The snapshot taken once it booted: creates from the template restore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_snapshot: Option<String>,
    /// Started in the background (`/bin/sh -c`) once the agent answers after a boot; with a
    /// boot snapshot, it runs before the snapshot, so restored sandboxes have it running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Run (`/bin/sh -c`) after the start command until it exits 0: the sandbox is ready then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// How long the ready command may take to first exit 0 [default 300 s].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_s: Option<u32>,
}

/// Where a template's rootfs image comes from: a registry reference, a `docker save` tarball
/// or an OCI layout directory.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageSource {
    /// Registry reference; with an archive or layout, picks one of several images.
    pub reference: Option<String>,
    pub docker_archive: Option<PathBuf>,
    pub oci_layout: Option<PathBuf>,
    /// Plain HTTP to the registry.
    #[serde(default)]
    pub insecure: bool,
    pub size_mib: Option<u64>,
}

/// POST /templates, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AddTemplate {
    pub template: Template,
    /// Build the rootfs from this image (instead of `template.rootfs`).
    pub image: Option<ImageSource>,
    /// Boot it once and keep a snapshot that creates restore.
    pub boot_snapshot: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateBody {
    name: String,
    kernel: PathBuf,
    rootfs: Option<PathBuf>,
    image: Option<ImageSource>,
    initrd: Option<PathBuf>,
    #[serde(default)]
    cmdline: Option<String>,
    vcpus: Option<i64>,
    memory_mib: Option<i64>,
    #[serde(default)]
    boot_snapshot: bool,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    ready_timeout_s: Option<i64>,
}

/// The kernel command line of templates built from images when the request gives none: our
/// rootfs images start the agent as init.
pub const IMAGE_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 loglevel=4 init=/.rollbox/rollbox-agent";

/// POST /sandboxes, validated: from a template (boot) or from a snapshot (restore).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CreateSandbox {
    /// The template's name; empty when `snapshot` is given (the snapshot names it).
    pub template: String,
    pub snapshot: Option<String>,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u32>,
    pub ttl_s: Option<u64>,
    pub idle_ttl_s: Option<u64>,
    pub labels: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub idempotency_key: Option<String>,
    /// Environment of every exec in the sandbox (an exec's own `env` wins).
    pub env: BTreeMap<String, String>,
    /// Cores of CPU time (a cgroup quota on the VMM process); None: no limit.
    pub cpu_limit: Option<f64>,
    /// A deterministic machine: booted without RDRAND/RDSEED, and every restore (create,
    /// reset) puts back the snapshot's guest time and generation exactly.
    pub deterministic: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    template: Option<String>,
    snapshot: Option<String>,
    vcpus: Option<i64>,
    memory_mib: Option<i64>,
    ttl_s: Option<i64>,
    idle_ttl_s: Option<i64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    idempotency_key: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cpu_limit: Option<f64>,
    #[serde(default)]
    deterministic: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeepaliveBody {
    ttl_s: i64,
}

/// GET /sandboxes query.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ListQuery {
    /// Only these sandboxes (any state, unless `state` is given).
    pub ids: Vec<String>,
    /// Every (key, value) must match.
    pub labels: Vec<(String, String)>,
    pub state: Option<State>,
    pub limit: u32,
    /// Only sandboxes after this position (from `next_page_token`).
    pub after: Option<i64>,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub state: State,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub labels: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub idempotency_key: Option<String>,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub idle_ttl_s: Option<u64>,
    pub last_active_at_ms: u64,
    pub pid: Option<u32>,
    /// The VMM's start time (/proc/PID/stat field 22), so a re-used pid is never taken for it.
    pub pid_start_time: Option<u64>,
    /// The sandbox's directory: `api.sock` (the VMM's Firecracker API), `vsock.sock`,
    /// `console.log`, `vmm.log`.
    pub dir: PathBuf,
    pub ended_at_ms: Option<u64>,
    pub end_reason: Option<String>,
    /// Environment of every exec (under the exec's own `env`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// CPU time limit in cores (0.5: half a core), enforced by the VMM's cgroup.
    #[serde(default)]
    pub cpu_limit: Option<f64>,
    /// Booted without RDRAND/RDSEED; its restores (reset) are exact (guest time, generation).
    #[serde(default)]
    pub deterministic: bool,
}

/// GET /sandboxes answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    pub next_page_token: Option<String>,
}

/// What to run: an argv, or a string for `/bin/sh -c`.
pub use rollbox_agent_protocol::messages::Command as ExecCommand;
pub use rollbox_agent_protocol::messages::FileInfo;

/// POST /sandboxes/{id}/exec, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Exec {
    pub command: ExecCommand,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// Written to the process's stdin, which is then closed (no stdin: /dev/null) unless
    /// `stdin_open`.
    pub stdin: Option<Vec<u8>>,
    /// Streaming only: stdin stays open for POST .../processes/{pid}/stdin.
    pub stdin_open: bool,
    pub timeout_ms: Option<u64>,
    pub max_output_bytes: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CmdBody {
    Argv(Vec<String>),
    Shell(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    cmd: CmdBody,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    user: Option<String>,
    stdin: Option<String>,
    #[serde(default)]
    stdin_open: bool,
    timeout_s: Option<f64>,
    max_output_bytes: Option<i64>,
}

/// POST /sandboxes/{id}/processes/{pid}/stdin.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinBody {
    #[serde(default)]
    data: String,
    encoding: Option<Encoding>,
    #[serde(default)]
    close: bool,
}

/// How a text field of an exec answer is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Encoding {
    #[serde(rename = "utf-8")]
    Utf8,
    #[serde(rename = "base64")]
    Base64,
}

/// Bytes as UTF-8 text when they are, else base64.
pub fn encode_bytes(bytes: &[u8]) -> (String, Encoding) {
    match std::str::from_utf8(bytes) {
        Ok(text) => (text.to_string(), Encoding::Utf8),
        Err(_) => {
            use base64::Engine as _;
            (
                base64::engine::general_purpose::STANDARD.encode(bytes),
                Encoding::Base64,
            )
        }
    }
}

/// The inverse of [`encode_bytes`].
pub fn decode_bytes(text: &str, encoding: Encoding) -> Option<Vec<u8>> {
    match encoding {
        Encoding::Utf8 => Some(text.as_bytes().to_vec()),
        Encoding::Base64 => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .ok()
        }
    }
}

/// How an exec ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// The exit code, when the process exited (not killed by a signal).
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// Its timeout fired and its process group was killed.
    pub timed_out: bool,
    /// The OOM killer killed a process of it.
    pub oom: bool,
    /// Output beyond `max_output_bytes` was dropped.
    pub truncated: bool,
    pub duration_ms: u64,
}

impl From<&rollbox_agent_protocol::messages::ExitStatus> for ExitInfo {
    fn from(status: &rollbox_agent_protocol::messages::ExitStatus) -> ExitInfo {
        ExitInfo {
            exit_code: status.code,
            signal: status.signal,
            timed_out: status.timed_out,
            oom: status.oom_killed,
            truncated: status.truncated,
            duration_ms: status.duration_ms,
        }
    }
}

/// The unary exec answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    #[serde(flatten)]
    pub exit: ExitInfo,
    pub stdout: String,
    pub stdout_encoding: Encoding,
    pub stderr: String,
    pub stderr_encoding: Encoding,
}

/// One line of a streaming exec (NDJSON); `seq` counts lines from 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecLine {
    pub seq: u64,
    #[serde(flatten)]
    pub record: ExecRecord,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecRecord {
    /// The process started: signal it through /sandboxes/{id}/processes/{pid}/signal.
    Started {
        pid: u32,
    },
    Stdout {
        data: String,
        encoding: Encoding,
    },
    Stderr {
        data: String,
        encoding: Encoding,
    },
    /// The last line when the process ended.
    Exit(ExitInfo),
    /// The last line when the exec failed after it started.
    Error {
        message: String,
    },
}

/// POST /sandboxes/{id}/processes/{pid}/signal.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    signal: SignalValue,
    #[serde(default)]
    group: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SignalValue {
    Number(i64),
    Name(String),
}

/// A file operation through the agent; every path is absolute in the sandbox.
#[derive(Debug, Clone, PartialEq)]
pub enum FileOp {
    Read {
        path: String,
    },
    Write {
        path: String,
        mode: Option<u32>,
        parents: bool,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Stat {
        path: String,
    },
    List {
        path: String,
    },
    TarDownload {
        path: String,
    },
    TarUpload {
        path: String,
    },
}

impl FileOp {
    /// Whether the request body is the data (streamed, up to [`MAX_UPLOAD`]).
    pub fn uploads(&self) -> bool {
        matches!(self, FileOp::Write { .. } | FileOp::TarUpload { .. })
    }
}

/// A memory snapshot of a sandbox (the VMM's Full snapshot, plus a copy of its rootfs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    /// The sandbox it was taken of.
    pub sandbox: String,
    /// The snapshot that sandbox was restored (or last reset) from: the parent chain.
    pub parent: Option<String>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// `vmstate`, `memory`, and `rootfs.img` when the template has a rootfs.
    pub dir: PathBuf,
    pub created_at_ms: u64,
    /// When retention removes it (its `ttl_s`), unless a live sandbox came from it.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// Taken of a deterministic sandbox (so deterministic sandboxes may restore it).
    #[serde(default)]
    pub deterministic: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    stop: bool,
    ttl_s: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    count: i64,
    ttl_s: Option<i64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    snapshot: Option<String>,
}

/// One sandbox of a fork: made, or why not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkResult {
    pub sandbox: Option<Sandbox>,
    pub error: Option<String>,
}

/// Snapshot ids: `snap-` and 16 lowercase hex digits.
pub fn check_snapshot_id(id: &str, field: &str) -> Result<String, ApiError> {
    let hex = id.strip_prefix("snap-").unwrap_or("");
    if hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(id.to_string())
    } else {
        Err(bad(format!(
            "{field}: {id:?} is not a snapshot id (snap- and 16 hex digits)"
        )))
    }
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Health,
    ListTemplates,
    AddTemplate(AddTemplate),
    GetTemplate(String),
    RemoveTemplate(String),
    ListSandboxes(ListQuery),
    CreateSandbox(CreateSandbox),
    /// `count` sandboxes of one spec; its idempotency key `K` gives item `i` the key `K/i`.
    CreateBatch {
        count: u32,
        create: CreateSandbox,
    },
    /// End every live sandbox the query matches (it names ids or labels, never nothing).
    DeleteSandboxes(ListQuery),
    /// Running time and CPU of a sandbox, live or ended.
    Usage(String),
    /// Prometheus text.
    Metrics,
    GetSandbox(String),
    DeleteSandbox(String),
    Keepalive {
        id: String,
        ttl_s: u64,
    },
    Pause(String),
    Resume(String),
    Exec {
        id: String,
        exec: Exec,
        /// Answer NDJSON lines as they come instead of one JSON object at the end.
        stream: bool,
    },
    Signal {
        id: String,
        pid: u32,
        signal: i32,
        group: bool,
    },
    /// Bytes for the stdin of a streaming exec started with `stdin_open`; `close` closes it.
    Stdin {
        id: String,
        pid: u32,
        data: Vec<u8>,
        close: bool,
    },
    File {
        id: String,
        op: FileOp,
    },
    /// Snapshot a sandbox; `stop` ends it afterwards; `ttl_s`: retention removes it then.
    Snapshot {
        id: String,
        stop: bool,
        ttl_s: Option<u64>,
    },
    ListSnapshots {
        sandbox: Option<String>,
    },
    GetSnapshot(String),
    DeleteSnapshot(String),
    Fork {
        id: String,
        count: u32,
        ttl_s: Option<u64>,
        labels: BTreeMap<String, String>,
    },
    /// Same id, fresh state: from `snapshot`, else the one it came from (else a fresh boot).
    Reset {
        id: String,
        snapshot: Option<String>,
    },
    /// A TCP connection to `port` on the guest's loopback, as the byte stream of an HTTP
    /// upgrade (`Upgrade: tcp`); only the HTTP layer can run it.
    PortConnect {
        id: String,
        port: u16,
    },
}

/// Whether `method path` is an upload, whose body [`parse`] does not read (it is streamed).
pub fn is_upload(method: &str, path: &str) -> bool {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    method == "PUT" && matches!(segments.as_slice(), ["sandboxes", _, "files" | "tar"])
}

/// Parses one request into an [`Action`] (the body is already capped at [`MAX_BODY`]).
pub fn parse(
    method: &str,
    path: &str,
    query: Option<&str>,
    body: &[u8],
) -> Result<Action, ApiError> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let no_query = || match query {
        Some(q) if !q.is_empty() => Err(bad(format!("{path} takes no query parameters"))),
        _ => Ok(()),
    };
    let action = match (method, segments.as_slice()) {
        ("GET", ["healthz"]) => Action::Health,
        ("GET", ["metrics"]) => Action::Metrics,
        ("GET", ["sandboxes", id, "usage"]) => Action::Usage(check_id(id)?),
        ("GET", ["sandboxes", id, "ports", port]) => Action::PortConnect {
            id: check_id(id)?,
            port: check_port(port)?,
        },
        ("GET", ["templates"]) => Action::ListTemplates,
        ("POST", ["templates"]) => Action::AddTemplate(parse_template(body)?),
        ("GET", ["templates", name]) => Action::GetTemplate(check_template_name(name, "name")?),
        ("DELETE", ["templates", name]) => {
            Action::RemoveTemplate(check_template_name(name, "name")?)
        }
        ("GET", ["sandboxes"]) => return Ok(Action::ListSandboxes(parse_query(query)?)),
        ("POST", ["sandboxes"]) => Action::CreateSandbox(parse_create(body)?),
        ("POST", ["sandboxes", "batch"]) => parse_batch(body)?,
        ("DELETE", ["sandboxes"]) => {
            let query = parse_query(query)?;
            if query.ids.is_empty() && query.labels.is_empty() {
                return Err(bad(
                    "ids, label: DELETE /sandboxes needs ids=ID,ID or label=KEY=VALUE (it never ends every sandbox)",
                ));
            }
            if query.state.is_some() || query.after.is_some() {
                return Err(bad(
                    "state, page_token: DELETE /sandboxes takes only ids and label",
                ));
            }
            return Ok(Action::DeleteSandboxes(query));
        }
        ("GET", ["sandboxes", id]) => Action::GetSandbox(check_id(id)?),
        ("DELETE", ["sandboxes", id]) => Action::DeleteSandbox(check_id(id)?),
        ("POST", ["sandboxes", id, "keepalive"]) => {
            let id = check_id(id)?;
            let body: KeepaliveBody = from_json(body)?;
            Action::Keepalive {
                id,
                ttl_s: ttl(body.ttl_s, "ttl_s")?,
            }
        }
        ("POST", ["sandboxes", id, "pause"]) => Action::Pause(check_id(id)?),
        ("POST", ["sandboxes", id, "resume"]) => Action::Resume(check_id(id)?),
        ("POST", ["sandboxes", id, "exec"]) => {
            let id = check_id(id)?;
            let stream = parse_stream_query(query)?;
            let exec = parse_exec(body)?;
            if exec.stdin_open && !stream {
                return Err(bad(
                    "stdin_open: only a streaming exec (?stream=true) keeps stdin open",
                ));
            }
            return Ok(Action::Exec { id, exec, stream });
        }
        ("POST", ["sandboxes", id, "processes", pid, "stdin"]) => {
            let id = check_id(id)?;
            let pid = check_pid(pid)?;
            let body: StdinBody = from_json(body)?;
            let encoding = body.encoding.unwrap_or(Encoding::Utf8);
            let data =
                decode_bytes(&body.data, encoding).ok_or_else(|| bad("data: not valid base64"))?;
            if data.is_empty() && !body.close {
                return Err(bad("data: empty, and close is not set: nothing to do"));
            }
            Action::Stdin {
                id,
                pid,
                data,
                close: body.close,
            }
        }
        ("POST", ["sandboxes", id, "processes", pid, "signal"]) => {
            let id = check_id(id)?;
            let pid = check_pid(pid)?;
            let body: SignalBody = from_json(body)?;
            Action::Signal {
                id,
                pid,
                signal: parse_signal(&body.signal)?,
                group: body.group,
            }
        }
        ("POST", ["sandboxes", id, "snapshots"]) => {
            let id = check_id(id)?;
            let body = if body.is_empty() {
                SnapshotBody {
                    stop: false,
                    ttl_s: None,
                }
            } else {
                from_json::<SnapshotBody>(body)?
            };
            Action::Snapshot {
                id,
                stop: body.stop,
                ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
            }
        }
        ("POST", ["sandboxes", id, "fork"]) => {
            let id = check_id(id)?;
            let body: ForkBody = from_json(body)?;
            check_labels(&body.labels)?;
            Action::Fork {
                id,
                count: in_range(Some(body.count), "count", 1, MAX_FORK)?.unwrap_or(1),
                ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
                labels: body.labels,
            }
        }
        ("POST", ["sandboxes", id, "reset"]) => {
            let id = check_id(id)?;
            let snapshot = if body.is_empty() {
                None
            } else {
                from_json::<ResetBody>(body)?.snapshot
            };
            Action::Reset {
                id,
                snapshot: snapshot
                    .map(|s| check_snapshot_id(&s, "snapshot"))
                    .transpose()?,
            }
        }
        ("GET", ["snapshots"]) => {
            let mut sandbox = None;
            for (name, value) in query_pairs(query)? {
                match name.as_str() {
                    "sandbox" => {
                        sandbox = Some(check_id(&value).map_err(|_| {
                            bad(format!(
                                "sandbox: {value:?} is not a sandbox id (sb- and 16 hex digits)"
                            ))
                        })?)
                    }
                    other => {
                        return Err(bad(format!("{other}: unknown query parameter (sandbox)")))
                    }
                }
            }
            return Ok(Action::ListSnapshots { sandbox });
        }
        ("GET", ["snapshots", snapshot]) => {
            Action::GetSnapshot(check_snapshot_id(snapshot, "snapshot")?)
        }
        ("DELETE", ["snapshots", snapshot]) => {
            Action::DeleteSnapshot(check_snapshot_id(snapshot, "snapshot")?)
        }
        (_, ["sandboxes", id, "files" | "tar", ..]) if file_route(method, &segments) => {
            let id = check_id(id)?;
            return Ok(Action::File {
                id,
                op: parse_file_op(method, &segments[2..], query)?,
            });
        }
        _ => {
            let known = ROUTES
                .iter()
                .any(|(_, pattern)| matches_pattern(pattern, &segments));
            return Err(if known {
                ApiError::MethodNotAllowed {
                    method: method.to_string(),
                    path: path.to_string(),
                }
            } else {
                ApiError::NotFound(format!("no route {method} {path}"))
            });
        }
    };
    no_query()?;
    Ok(action)
}

fn check_pid(pid: &str) -> Result<u32, ApiError> {
    pid.parse::<u32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad(format!("pid: {pid:?} is not a process id")))
}

fn check_port(port: &str) -> Result<u16, ApiError> {
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad(format!("port: {port:?} is not a TCP port (1-65535)")))
}

fn file_route(method: &str, segments: &[&str]) -> bool {
    matches!(
        (method, segments.get(2..).unwrap_or(&[])),
        ("GET" | "PUT" | "DELETE", ["files"])
            | ("GET", ["files", "stat" | "list"])
            | ("GET" | "PUT", ["tar"])
    )
}

fn parse_stream_query(query: Option<&str>) -> Result<bool, ApiError> {
    let mut stream = false;
    for (name, value) in query_pairs(query)? {
        match name.as_str() {
            "stream" => stream = parse_bool(&value, "stream")?,
            other => return Err(bad(format!("{other}: unknown query parameter (stream)"))),
        }
    }
    Ok(stream)
}

fn parse_bool(value: &str, field: &str) -> Result<bool, ApiError> {
    match value {
        "true" | "1" | "" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(bad(format!("{field}: {value:?} is not true or false"))),
    }
}

fn query_pairs(query: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
    let mut pairs = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name, "query")?;
        let value = percent_decode(value, &name)?;
        pairs.push((name, value));
    }
    Ok(pairs)
}

/// A path in the sandbox: absolute, no `..` (nothing may escape the sandbox's root), no NUL.
pub fn check_guest_path(path: &str, field: &str) -> Result<String, ApiError> {
    if !path.starts_with('/') {
        return Err(bad(format!(
            "{field}: {path:?} is relative; give an absolute path in the sandbox"
        )));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(bad(format!(
            "{field}: {path:?} escapes the sandbox root (it has a .. component)"
        )));
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err(bad(format!(
            "{field}: {path:?} is over 4096 bytes or holds a NUL"
        )));
    }
    Ok(path.to_string())
}

fn parse_file_op(method: &str, rest: &[&str], query: Option<&str>) -> Result<FileOp, ApiError> {
    let mut path = None;
    let (mut mode, mut parents, mut recursive) = (None, false, false);
    let writes = method == "PUT" && rest == ["files"];
    let removes = method == "DELETE";
    for (name, value) in query_pairs(query)? {
        match name.as_str() {
            "path" => path = Some(check_guest_path(&value, "path")?),
            "mode" if writes => {
                mode = Some(
                    u32::from_str_radix(&value, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| bad(format!("mode: {value:?} is not octal 0-7777")))?,
                )
            }
            "parents" if writes => parents = parse_bool(&value, "parents")?,
            "recursive" if removes => recursive = parse_bool(&value, "recursive")?,
            other => return Err(bad(format!("{other}: unknown query parameter here"))),
        }
    }
    let path = path.ok_or_else(|| bad("path: required (?path=/absolute/path)"))?;
    Ok(match (method, rest) {
        ("GET", ["files"]) => FileOp::Read { path },
        ("PUT", ["files"]) => FileOp::Write {
            path,
            mode,
            parents,
        },
        ("DELETE", _) => FileOp::Remove { path, recursive },
        ("GET", ["files", "stat"]) => FileOp::Stat { path },
        ("GET", ["files", "list"]) => FileOp::List { path },
        ("GET", ["tar"]) => FileOp::TarDownload { path },
        _ => FileOp::TarUpload { path },
    })
}

fn parse_signal(value: &SignalValue) -> Result<i32, ApiError> {
    const NAMES: &[(&str, i32)] = &[
        ("HUP", 1),
        ("INT", 2),
        ("QUIT", 3),
        ("KILL", 9),
        ("USR1", 10),
        ("USR2", 12),
        ("TERM", 15),
        ("CONT", 18),
        ("STOP", 19),
    ];
    match value {
        SignalValue::Number(n) if (1..=64).contains(n) => Ok(i32::try_from(*n).unwrap_or(15)),
        SignalValue::Number(n) => Err(bad(format!("signal: {n} is not 1-64"))),
        SignalValue::Name(name) => {
            let short = name.strip_prefix("SIG").unwrap_or(name);
            NAMES
                .iter()
                .find(|(n, _)| *n == short)
                .map(|(_, number)| *number)
                .ok_or_else(|| {
                    bad(format!(
                        "signal: {name:?} is not a number or one of HUP INT QUIT KILL USR1 USR2 TERM CONT STOP"
                    ))
                })
        }
    }
}

fn parse_exec(body: &[u8]) -> Result<Exec, ApiError> {
    let body: ExecBody = from_json(body)?;
    let command = match body.cmd {
        CmdBody::Argv(argv) => {
            if argv.first().is_none_or(|a| a.is_empty()) {
                return Err(bad("cmd: the argv needs a non-empty program"));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(bad("cmd: an argument holds a NUL"));
            }
            ExecCommand::Argv(argv)
        }
        CmdBody::Shell(script) => {
            if script.trim().is_empty() || script.contains('\0') {
                return Err(bad("cmd: the shell command is empty or holds a NUL"));
            }
            ExecCommand::Shell(script)
        }
    };
    check_env(&body.env)?;
    let cwd = body.cwd.map(|c| check_guest_path(&c, "cwd")).transpose()?;
    let timeout_ms = match body.timeout_s {
        None => None,
        Some(t) if t > 0.0 && t <= MAX_EXEC_TIMEOUT_S => Some((t * 1000.0).ceil() as u64),
        Some(t) => {
            return Err(bad(format!(
                "timeout_s: {t} is out of range (over 0, at most {MAX_EXEC_TIMEOUT_S})"
            )))
        }
    };
    let max_output_bytes = match body.max_output_bytes {
        None => DEFAULT_OUTPUT_BYTES,
        Some(n) => u64::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_OUTPUT_BYTES).contains(n))
            .ok_or_else(|| {
                bad(format!(
                    "max_output_bytes: {n} is out of range (1-{MAX_OUTPUT_BYTES})"
                ))
            })?,
    };
    Ok(Exec {
        command,
        env: body.env,
        cwd,
        user: body.user,
        stdin: body.stdin.map(String::into_bytes),
        stdin_open: body.stdin_open,
        timeout_ms,
        max_output_bytes,
    })
}

const MAX_ENV: usize = 256;

fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if env.len() > MAX_ENV {
        return Err(bad(format!("env: more than {MAX_ENV} variables")));
    }
    for (key, value) in env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(bad(format!(
                "env: {key:?} is not a variable name (non-empty, no = or NUL)"
            )));
        }
    }
    Ok(())
}

fn matches_pattern(pattern: &str, segments: &[&str]) -> bool {
    let parts: Vec<&str> = pattern.trim_start_matches('/').split('/').collect();
    parts.len() == segments.len()
        && parts
            .iter()
            .zip(segments)
            .all(|(p, s)| p.starts_with('{') || p == s)
}

/// Deserializes JSON; an error names the field it is about.
fn from_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(bad("the request needs a JSON body"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            bad(format!("bad JSON body: {}", e.inner()))
        } else {
            bad(format!("{path}: {}", e.inner()))
        }
    })?;
    de.end().map_err(|e| bad(format!("bad JSON body: {e}")))?;
    Ok(value)
}

/// Sandbox ids: `sb-` and 16 lowercase hex digits.
pub fn check_id(id: &str) -> Result<String, ApiError> {
    let hex = id.strip_prefix("sb-").unwrap_or("");
    if hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(id.to_string())
    } else {
        Err(bad(format!(
            "id: {id:?} is not a sandbox id (sb- and 16 hex digits)"
        )))
    }
}

/// Template names: 1-63 of a-z 0-9 . _ -, starting with a letter or digit.
pub fn check_template_name(name: &str, field: &str) -> Result<String, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || (i > 0 && matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(name.to_string())
    } else {
        Err(bad(format!(
            "{field}: {name:?} is not a template name (1-63 of a-z 0-9 . _ -, starting with a letter or digit)"
        )))
    }
}

fn in_range(value: Option<i64>, field: &str, min: u32, max: u32) -> Result<Option<u32>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if v >= i64::from(min) && v <= i64::from(max) => Ok(u32::try_from(v).ok()),
        Some(v) => Err(bad(format!("{field}: {v} is out of range ({min}-{max})"))),
    }
}

fn ttl(value: i64, field: &str) -> Result<u64, ApiError> {
    match u64::try_from(value) {
        Ok(v) if (1..=MAX_TTL_S).contains(&v) => Ok(v),
        _ => Err(bad(format!(
            "{field}: {value} is out of range (1-{MAX_TTL_S} seconds)"
        ))),
    }
}

fn absolute(path: &std::path::Path, field: &str) -> Result<(), ApiError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(bad(format!(
            "{field}: {} is not an absolute path",
            path.display()
        )))
    }
}

fn parse_template(body: &[u8]) -> Result<AddTemplate, ApiError> {
    let body: TemplateBody = from_json(body)?;
    let name = check_template_name(&body.name, "name")?;
    absolute(&body.kernel, "kernel")?;
    for (path, field) in [(&body.rootfs, "rootfs"), (&body.initrd, "initrd")] {
        if let Some(path) = path {
            absolute(path, field)?;
        }
    }
    if let Some(image) = &body.image {
        check_image(image, body.rootfs.is_some())?;
    }
    let cmdline = match (body.cmdline, &body.image) {
        (Some(cmdline), _) => cmdline,
        (None, Some(_)) => IMAGE_CMDLINE.to_string(),
        (None, None) => String::new(),
    };
    if cmdline.len() > 2048 || cmdline.chars().any(char::is_control) {
        return Err(bad(
            "cmdline: must be at most 2048 bytes with no control characters",
        ));
    }
    for (command, field) in [
        (&body.start_cmd, "start_cmd"),
        (&body.ready_cmd, "ready_cmd"),
    ] {
        if let Some(command) = command {
            check_template_command(command, field)?;
        }
    }
    if body.ready_cmd.is_some() && body.start_cmd.is_none() {
        return Err(bad("ready_cmd: needs a start_cmd to wait for"));
    }
    if body.ready_timeout_s.is_some() && body.ready_cmd.is_none() {
        return Err(bad("ready_timeout_s: needs a ready_cmd to time"));
    }
    Ok(AddTemplate {
        template: Template {
            name,
            kernel: body.kernel,
            rootfs: body.rootfs,
            initrd: body.initrd,
            cmdline,
            vcpus: in_range(body.vcpus, "vcpus", 1, MAX_VCPUS)?.unwrap_or(1),
            memory_mib: in_range(body.memory_mib, "memory_mib", 1, MAX_MEMORY_MIB)?.unwrap_or(128),
            created_at_ms: 0,
            image: None,
            boot_snapshot: None,
            start_cmd: body.start_cmd,
            ready_cmd: body.ready_cmd,
            ready_timeout_s: in_range(body.ready_timeout_s, "ready_timeout_s", 1, 3600)?,
        },
        image: body.image,
        boot_snapshot: body.boot_snapshot,
    })
}

/// A template's start or ready command: a non-empty shell command line of at most 4096 bytes.
fn check_template_command(command: &str, field: &str) -> Result<(), ApiError> {
    if command.trim().is_empty() {
        return Err(bad(format!("{field}: must not be empty")));
    }
    if command.len() > 4096 || command.contains('\0') {
        return Err(bad(format!(
            "{field}: must be at most 4096 bytes with no NUL byte"
        )));
    }
    Ok(())
}

fn check_image(image: &ImageSource, has_rootfs: bool) -> Result<(), ApiError> {
    if has_rootfs {
        return Err(bad(
            "image: give either rootfs (a built image) or image, not both",
        ));
    }
    match (&image.docker_archive, &image.oci_layout) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "image: give at most one of docker_archive and oci_layout",
            ))
        }
        (Some(path), None) => absolute(path, "image.docker_archive")?,
        (None, Some(path)) => absolute(path, "image.oci_layout")?,
        (None, None) if image.reference.is_none() => {
            return Err(bad(
                "image.reference: required to pull from a registry (or give docker_archive or oci_layout)",
            ))
        }
        (None, None) => {}
    }
    if let Some(reference) = &image.reference {
        if reference.is_empty()
            || reference.len() > 512
            || reference
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad(format!(
                "image.reference: {reference:?} is not an image reference"
            )));
        }
    }
    if let Some(size) = image.size_mib {
        if !(16..=65536).contains(&size) {
            return Err(bad(format!(
                "image.size_mib: {size} is out of range (16 to 65536)"
            )));
        }
    }
    Ok(())
}

/// Label keys: 1-63 of A-Z a-z 0-9 . _ / -, starting with a letter or digit.
fn check_label_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 63
        && key.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_alphanumeric() || (i > 0 && matches!(b, b'.' | b'_' | b'/' | b'-'))
        })
}

fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(bad(format!("labels: more than {MAX_LABELS}")));
    }
    for (key, value) in labels {
        if !check_label_key(key) {
            return Err(bad(format!(
                "labels: key {key:?} is not 1-63 of A-Z a-z 0-9 . _ / - starting with a letter or digit"
            )));
        }
        if value.len() > 255 || value.chars().any(char::is_control) {
            return Err(bad(format!(
                "labels.{key}: the value must be at most 255 bytes with no control characters"
            )));
        }
    }
    Ok(())
}

fn parse_create(body: &[u8]) -> Result<CreateSandbox, ApiError> {
    let body: CreateBody = from_json(body)?;
    check_labels(&body.labels)?;
    check_env(&body.env)?;
    if body.metadata.len() > MAX_METADATA
        || body
            .metadata
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 4096)
    {
        return Err(bad(format!(
            "metadata: at most {MAX_METADATA} entries, keys of 1-128 bytes, values of at most 4096"
        )));
    }
    if let Some(key) = &body.idempotency_key {
        if key.is_empty() || key.len() > 128 || key.chars().any(char::is_control) {
            return Err(bad(
                "idempotency_key: must be 1-128 bytes with no control characters",
            ));
        }
    }
    let (template, snapshot) = match (body.template, body.snapshot) {
        (Some(t), None) => (check_template_name(&t, "template")?, None),
        (None, Some(s)) => {
            if body.vcpus.is_some() || body.memory_mib.is_some() {
                return Err(bad(
                    "vcpus, memory_mib: a restore keeps its snapshot's shape; leave them out",
                ));
            }
            (String::new(), Some(check_snapshot_id(&s, "snapshot")?))
        }
        _ => {
            return Err(bad(
                "template: give exactly one of template (boot) and snapshot (restore)",
            ))
        }
    };
    Ok(CreateSandbox {
        template,
        snapshot,
        vcpus: in_range(body.vcpus, "vcpus", 1, MAX_VCPUS)?,
        memory_mib: in_range(body.memory_mib, "memory_mib", 1, MAX_MEMORY_MIB)?,
        ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
        idle_ttl_s: body.idle_ttl_s.map(|v| ttl(v, "idle_ttl_s")).transpose()?,
        labels: body.labels,
        metadata: body.metadata,
        idempotency_key: body.idempotency_key,
        env: body.env,
        cpu_limit: body
            .cpu_limit
            .map(|c| {
                if c.is_finite() && (MIN_CPU_LIMIT..=f64::from(MAX_VCPUS)).contains(&c) {
                    Ok(c)
                } else {
                    Err(bad(format!(
                        "cpu_limit: {c} is out of range ({MIN_CPU_LIMIT}-{MAX_VCPUS} cores)"
                    )))
                }
            })
            .transpose()?,
        deterministic: body.deterministic,
    })
}

/// POST /sandboxes/batch: `count` and the fields of POST /sandboxes.
fn parse_batch(body: &[u8]) -> Result<Action, ApiError> {
    let mut fields: serde_json::Map<String, serde_json::Value> = from_json(body)?;
    let count = match fields.remove("count") {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(other) => return Err(bad(format!("count: {other} is not a whole number"))),
        None => return Err(bad("count: required (how many sandboxes)")),
    };
    let count = in_range(count, "count", 1, MAX_BATCH)?
        .ok_or_else(|| bad(format!("count: not a whole number 1-{MAX_BATCH}")))?;
    let spec = serde_json::to_vec(&fields).map_err(|e| bad(format!("bad JSON body: {e}")))?;
    let create = parse_create(&spec)?;
    if let Some(key) = &create.idempotency_key {
        if key.len() > 120 {
            return Err(bad(
                "idempotency_key: a batch's key must be at most 120 bytes (items get KEY/INDEX)",
            ));
        }
    }
    Ok(Action::CreateBatch { count, create })
}

/// Decodes %XX escapes and `+`.
fn percent_decode(text: &str, field: &str) -> Result<String, ApiError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| bad(format!("{field}: bad %-escape in {text:?}")))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("{field}: {text:?} is not UTF-8")))
}

fn parse_query(query: Option<&str>) -> Result<ListQuery, ApiError> {
    let mut out = ListQuery {
        limit: DEFAULT_LIST_LIMIT,
        ..ListQuery::default()
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name, "query")?;
        let value = percent_decode(value, &name)?;
        match name.as_str() {
            "ids" => {
                for id in value.split(',').filter(|i| !i.is_empty()) {
                    out.ids.push(check_id(id)?);
                }
                if out.ids.len() > MAX_IDS {
                    return Err(bad(format!("ids: more than {MAX_IDS}")));
                }
            }
            "label" => {
                let (key, want) = value
                    .split_once('=')
                    .ok_or_else(|| bad(format!("label: {value:?} is not KEY=VALUE")))?;
                if !check_label_key(key) {
                    return Err(bad(format!("label: {key:?} is not a label key")));
                }
                out.labels.push((key.to_string(), want.to_string()));
            }
            "state" => {
                out.state = Some(State::parse(&value).ok_or_else(|| {
                    bad(format!(
                        "state: {value:?} is not one of creating, running, paused, exited, failed, deleted, expired"
                    ))
                })?)
            }
            "limit" => {
                out.limit = value
                    .parse::<u32>()
                    .ok()
                    .filter(|l| (1..=MAX_LIST_LIMIT).contains(l))
                    .ok_or_else(|| bad(format!("limit: {value:?} is not 1-{MAX_LIST_LIMIT}")))?
            }
            "page_token" => {
                out.after = Some(
                    value
                        .parse::<i64>()
                        .ok()
                        .filter(|v| *v >= 0)
                        .ok_or_else(|| bad(format!("page_token: {value:?} is not a page token")))?,
                )
            }
            other => {
                return Err(bad(format!(
                    "{other}: unknown query parameter (ids, label, state, limit, page_token)"
                )))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(result: Result<Action, ApiError>) -> String {
        match result {
            Err(e) => e.to_string(),
            Ok(a) => panic!("accepted: {a:?}"),
        }
    }

    #[test]
    fn create_parses_and_defaults() {
        let action = parse(
            "POST",
            "/sandboxes",
            None,
            br#"{"template":"t1","ttl_s":60,"labels":{"run":"a"},"idempotency_key":"k"}"#,
        )
        .expect("parse");
        let Action::CreateSandbox(c) = action else {
            panic!("{action:?}")
        };
        assert_eq!(c.template, "t1");
        assert_eq!(c.ttl_s, Some(60));
        assert_eq!(c.vcpus, None);
        assert_eq!(c.labels.get("run").map(String::as_str), Some("a"));
    }

    #[test]
    fn bad_create_bodies_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"template":"t","memory_mib":-5}"#, "memory_mib"),
            (r#"{"template":"t","memory_mib":0}"#, "memory_mib"),
            (r#"{"template":"t","vcpus":999}"#, "vcpus"),
            (r#"{"template":"t","ttl_s":0}"#, "ttl_s"),
            (r#"{"template":"t","idle_ttl_s":-1}"#, "idle_ttl_s"),
            (r#"{"template":"t","labels":{"bad key":"v"}}"#, "labels"),
            (r#"{"template":"t","labels":{"k":7}}"#, "labels.k"),
            (r#"{"template":"t","colour":"red"}"#, "colour"),
            (r#"{"template":"T!"}"#, "template"),
            (r#"{"ttl_s":5}"#, "template"),
            (
                r#"{"template":"t","idempotency_key":""}"#,
                "idempotency_key",
            ),
            (r#"{"template":"t"} trailing"#, "JSON"),
            (r#"{"template":"t","env":{"A=B":"x"}}"#, "env"),
            (r#"{"template":"t","env":{"A":7}}"#, "env.A"),
            (r#"{"template":"t","cpu_limit":0}"#, "cpu_limit"),
            (r#"{"template":"t","cpu_limit":-1}"#, "cpu_limit"),
            (r#"{"template":"t","cpu_limit":"half"}"#, "cpu_limit"),
        ];
        for (body, field) in cases {
            let message = err(parse("POST", "/sandboxes", None, body.as_bytes()));
            assert!(
                message.contains(field),
                "{body}: {message:?} does not name {field}"
            );
        }
        assert!(err(parse("POST", "/sandboxes", None, b"")).contains("JSON body"));
    }

    #[test]
    fn templates_parse_and_validate() {
        let ok = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"guest","kernel":"/k","cmdline":"console=ttyS0","memory_mib":64}"#,
        )
        .expect("parse");
        let Action::AddTemplate(t) = ok else {
            panic!("{ok:?}")
        };
        assert_eq!((t.template.vcpus, t.template.memory_mib), (1, 64));
        assert!(t.image.is_none() && !t.boot_snapshot);
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"bb","kernel":"/k","image":{"docker_archive":"/b.tar"},"boot_snapshot":true}"#,
        )
        .expect("parse image") else {
            panic!("not a template")
        };
        assert_eq!(t.template.cmdline, IMAGE_CMDLINE);
        assert!(t.boot_snapshot);
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"ci","kernel":"/k","start_cmd":"serve &","ready_cmd":"curl -f :1"}"#,
        )
        .expect("parse start_cmd") else {
            panic!("not a template")
        };
        assert_eq!(t.template.start_cmd.as_deref(), Some("serve &"));
        assert_eq!(t.template.ready_cmd.as_deref(), Some("curl -f :1"));
        for (body, field) in [
            (r#"{"name":"g","kernel":"rel/k"}"#, "kernel"),
            (r#"{"name":"g","kernel":"/k","rootfs":"r"}"#, "rootfs"),
            (r#"{"name":"g","kernel":"/k","vcpus":0}"#, "vcpus"),
            (r#"{"name":"-g","kernel":"/k"}"#, "name"),
            (r#"{"name":"g","kernel":"/k","cmdline":"a\nb"}"#, "cmdline"),
            (r#"{"name":"g","kernel":"/k","start_cmd":" "}"#, "start_cmd"),
            (
                r#"{"name":"g","kernel":"/k","ready_cmd":"true"}"#,
                "ready_cmd",
            ),
            (
                r#"{"name":"g","kernel":"/k","start_cmd":"a","ready_cmd":"b","ready_timeout_s":0}"#,
                "ready_timeout_s",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{}}"#,
                "image.reference",
            ),
            (
                r#"{"name":"g","kernel":"/k","rootfs":"/r","image":{"reference":"a"}}"#,
                "image",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"docker_archive":"a.tar"}}"#,
                "image.docker_archive",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a b"}}"#,
                "image.reference",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","size_mib":1}}"#,
                "image.size_mib",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","tag":1}}"#,
                "tag",
            ),
        ] {
            let message = err(parse("POST", "/templates", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
    }

    #[test]
    fn ids_and_routes() {
        assert_eq!(
            parse("GET", "/sandboxes/sb-0123456789abcdef", None, b"").expect("get"),
            Action::GetSandbox("sb-0123456789abcdef".into())
        );
        assert!(err(parse("GET", "/sandboxes/sb-XYZ", None, b"")).contains("id"));
        assert!(err(parse("GET", "/sandboxes/../etc", None, b"")).contains("no route"));
        assert!(matches!(
            parse("PUT", "/sandboxes", None, b""),
            Err(ApiError::MethodNotAllowed { .. })
        ));
        assert!(err(parse("GET", "/nope", None, b"")).contains("no route"));
    }

    #[test]
    fn every_route_parses() {
        for (method, pattern) in ROUTES {
            let path = pattern
                .replace("{id}", "sb-0123456789abcdef")
                .replace("{name}", "guest")
                .replace("{snapshot}", "snap-0123456789abcdef");
            let path = path.replace("{pid}", "42").replace("{port}", "8080");
            let body: &[u8] = match (*method, path.as_str()) {
                ("POST", "/templates") => br#"{"name":"g","kernel":"/k"}"#,
                ("POST", "/sandboxes") => br#"{"template":"g"}"#,
                ("POST", "/sandboxes/batch") => br#"{"template":"g","count":2}"#,
                ("POST", p) if p.ends_with("keepalive") => br#"{"ttl_s":5}"#,
                ("POST", p) if p.ends_with("exec") => br#"{"cmd":["true"]}"#,
                ("POST", p) if p.ends_with("signal") => br#"{"signal":"TERM"}"#,
                ("POST", p) if p.ends_with("stdin") => br#"{"data":"x"}"#,
                ("POST", p) if p.ends_with("fork") => br#"{"count":2}"#,
                _ => b"",
            };
            let query = if path.contains("/files") || path.ends_with("/tar") {
                Some("path=/x")
            } else if (*method, path.as_str()) == ("DELETE", "/sandboxes") {
                Some("label=run%3Da")
            } else {
                None
            };
            parse(method, &path, query, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        }
    }

    #[test]
    fn ports_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse(
                "GET",
                "/sandboxes/sb-0123456789abcdef/ports/8080",
                None,
                b""
            )
            .expect("parse"),
            Action::PortConnect {
                id: "sb-0123456789abcdef".into(),
                port: 8080
            }
        );
        for port in ["0", "65536", "http"] {
            let path = format!("/sandboxes/sb-0123456789abcdef/ports/{port}");
            let message = err(parse("GET", &path, None, b""));
            assert!(message.contains(&format!("port: {port:?}")), "{message}");
        }
    }

    #[test]
    fn list_query_parses() {
        let q = parse(
            "GET",
            "/sandboxes",
            Some("label=run%3Da%3Db&state=running&limit=5&page_token=12"),
            b"",
        )
        .expect("parse");
        assert_eq!(
            q,
            Action::ListSandboxes(ListQuery {
                ids: Vec::new(),
                labels: vec![("run".into(), "a=b".into())],
                state: Some(State::Running),
                limit: 5,
                after: Some(12),
            })
        );
        for (query, field) in [
            ("label=novalue", "label"),
            ("state=zombie", "state"),
            ("limit=0", "limit"),
            ("limit=abc", "limit"),
            ("page_token=-3", "page_token"),
            ("colour=red", "colour"),
        ] {
            let message = err(parse("GET", "/sandboxes", Some(query), b""));
            assert!(message.starts_with(field), "{query}: {message:?}");
        }
        assert!(err(parse("GET", "/templates", Some("x=1"), b"")).contains("no query"));
    }

    #[test]
    fn exec_bodies_parse_and_validate() {
        let path = "/sandboxes/sb-0123456789abcdef/exec";
        let ok = parse(
            "POST",
            path,
            Some("stream=true"),
            br#"{"cmd":"echo hi","env":{"A":"1"},"cwd":"/tmp","stdin":"x","timeout_s":1.5}"#,
        )
        .expect("parse");
        let Action::Exec { exec, stream, .. } = ok else {
            panic!("{ok:?}")
        };
        assert!(stream);
        assert_eq!(exec.command, ExecCommand::Shell("echo hi".into()));
        assert_eq!(exec.timeout_ms, Some(1500));
        assert_eq!(exec.max_output_bytes, DEFAULT_OUTPUT_BYTES);
        assert_eq!(exec.stdin.as_deref(), Some(&b"x"[..]));
        for (body, field) in [
            (r#"{"cmd":[]}"#, "cmd"),
            (r#"{"cmd":[""]}"#, "cmd"),
            (r#"{"cmd":7}"#, "cmd"),
            (r#"{"cmd":"  "}"#, "cmd"),
            (r#"{"cmd":["ls"],"cwd":"tmp"}"#, "cwd"),
            (r#"{"cmd":["ls"],"cwd":"/a/../.."}"#, "cwd"),
            (r#"{"cmd":["ls"],"env":{"A=B":"x"}}"#, "env"),
            (r#"{"cmd":["ls"],"timeout_s":0}"#, "timeout_s"),
            (
                r#"{"cmd":["ls"],"max_output_bytes":-1}"#,
                "max_output_bytes",
            ),
            (r#"{"cmd":["ls"],"shell":true}"#, "shell"),
        ] {
            let message = err(parse("POST", path, None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert!(
            err(parse("POST", path, Some("stream=maybe"), br#"{"cmd":"x"}"#)).contains("stream")
        );
    }

    #[test]
    fn signals_and_file_paths() {
        let signal = |body: &[u8]| {
            parse(
                "POST",
                "/sandboxes/sb-0123456789abcdef/processes/9/signal",
                None,
                body,
            )
        };
        assert!(matches!(
            signal(br#"{"signal":"SIGKILL","group":true}"#),
            Ok(Action::Signal {
                signal: 9,
                group: true,
                pid: 9,
                ..
            })
        ));
        assert!(matches!(
            signal(br#"{"signal":2}"#),
            Ok(Action::Signal { signal: 2, .. })
        ));
        assert!(err(signal(br#"{"signal":"BOOM"}"#)).contains("signal"));
        let stdin = |body: &[u8]| {
            parse(
                "POST",
                "/sandboxes/sb-0123456789abcdef/processes/9/stdin",
                None,
                body,
            )
        };
        assert!(matches!(
            stdin(br#"{"data":"AAE=","encoding":"base64","close":true}"#),
            Ok(Action::Stdin { ref data, close: true, .. }) if data == &[0u8, 1]
        ));
        assert!(err(stdin(br#"{"data":"!!","encoding":"base64"}"#)).contains("data"));
        assert!(err(stdin(br#"{}"#)).contains("data"));
        assert!(err(parse(
            "POST",
            "/sandboxes/sb-0123456789abcdef/exec",
            None,
            br#"{"cmd":"cat","stdin_open":true}"#
        ))
        .contains("stdin_open"));
        assert!(err(signal(br#"{"signal":99}"#)).contains("signal"));
        assert!(err(parse(
            "POST",
            "/sandboxes/sb-0123456789abcdef/processes/x/signal",
            None,
            br#"{"signal":2}"#
        ))
        .contains("pid"));
        let files = "/sandboxes/sb-0123456789abcdef/files";
        assert_eq!(
            parse("PUT", files, Some("path=/a%20b&mode=600&parents=1"), b"").expect("put"),
            Action::File {
                id: "sb-0123456789abcdef".into(),
                op: FileOp::Write {
                    path: "/a b".into(),
                    mode: Some(0o600),
                    parents: true
                }
            }
        );
        for (method, query, field) in [
            ("GET", "path=etc/passwd", "relative"),
            ("GET", "path=/tmp/../../etc", "escapes"),
            ("GET", "", "path"),
            ("GET", "path=/x&mode=644", "mode"),
            ("PUT", "path=/x&mode=999", "mode"),
            ("DELETE", "path=/x&recursive=perhaps", "recursive"),
        ] {
            let message = err(parse(method, files, Some(query), b""));
            assert!(message.contains(field), "{query}: {message:?}");
        }
        assert!(is_upload("PUT", "/sandboxes/x/tar") && !is_upload("GET", "/sandboxes/x/tar"));
    }

    #[test]
    fn snapshot_fork_reset_and_restore_bodies() {
        let sb = "/sandboxes/sb-0123456789abcdef";
        let snap = "snap-0123456789abcdef";
        let create = parse(
            "POST",
            "/sandboxes",
            None,
            format!(r#"{{"snapshot":"{snap}","ttl_s":5}}"#).as_bytes(),
        )
        .expect("restore");
        assert!(
            matches!(create, Action::CreateSandbox(CreateSandbox { ref snapshot, .. }) if snapshot.as_deref() == Some(snap))
        );
        for (body, field) in [
            (
                format!(r#"{{"snapshot":"{snap}","template":"t"}}"#),
                "template",
            ),
            (format!(r#"{{"snapshot":"{snap}","vcpus":2}}"#), "vcpus"),
            (r#"{"snapshot":"snap-xyz"}"#.to_string(), "snapshot"),
        ] {
            let message = err(parse("POST", "/sandboxes", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert_eq!(
            parse("POST", &format!("{sb}/snapshots"), None, b"").expect("snapshot"),
            Action::Snapshot {
                id: "sb-0123456789abcdef".into(),
                stop: false,
                ttl_s: None,
            }
        );
        assert!(matches!(
            parse(
                "POST",
                &format!("{sb}/snapshots"),
                None,
                br#"{"stop":true}"#
            ),
            Ok(Action::Snapshot { stop: true, .. })
        ));
        assert!(err(parse(
            "POST",
            &format!("{sb}/snapshots"),
            None,
            br#"{"ttl_s":0}"#
        ))
        .contains("ttl_s"));
        for (body, field) in [
            (r#"{"count":0}"#, "count"),
            (r#"{"count":65}"#, "count"),
            (r#"{"count":2,"ttl_s":-1}"#, "ttl_s"),
            (r#"{"count":2,"labels":{"bad key":"v"}}"#, "labels"),
        ] {
            let message = err(parse("POST", &format!("{sb}/fork"), None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert!(err(parse(
            "POST",
            &format!("{sb}/reset"),
            None,
            br#"{"snapshot":"x"}"#
        ))
        .contains("snapshot"));
        assert!(matches!(
            parse("POST", &format!("{sb}/reset"), None, b""),
            Ok(Action::Reset { snapshot: None, .. })
        ));
        assert!(err(parse("GET", "/snapshots/nope", None, b"")).contains("snapshot"));
        assert!(err(parse("GET", "/snapshots", Some("sandbox=x"), b"")).contains("sandbox: \"x\""));
    }

    #[test]
    fn batches_and_bulk_deletes_parse() {
        let action = parse(
            "POST",
            "/sandboxes/batch",
            None,
            br#"{"count":3,"template":"t","ttl_s":9,"idempotency_key":"k"}"#,
        )
        .expect("batch");
        let Action::CreateBatch { count, create } = action else {
            panic!("{action:?}")
        };
        assert_eq!((count, create.template.as_str()), (3, "t"));
        assert_eq!(create.idempotency_key.as_deref(), Some("k"));
        for (body, field) in [
            (r#"{"template":"t"}"#, "count"),
            (r#"{"count":0,"template":"t"}"#, "count"),
            (r#"{"count":"2","template":"t"}"#, "count"),
            (r#"{"count":2,"template":"t","colour":1}"#, "colour"),
            (r#"{"count":2}"#, "template"),
        ] {
            let message = err(parse("POST", "/sandboxes/batch", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        let ids = "sb-0123456789abcdef,sb-00000000000000aa";
        assert!(matches!(
            parse("DELETE", "/sandboxes", Some(&format!("ids={ids}")), b""),
            Ok(Action::DeleteSandboxes(ListQuery { ref ids, .. })) if ids.len() == 2
        ));
        assert!(err(parse("DELETE", "/sandboxes", None, b"")).contains("ids"));
        assert!(err(parse("DELETE", "/sandboxes", Some("ids=sb-x"), b"")).contains("id"));
        assert!(err(parse(
            "DELETE",
            "/sandboxes",
            Some("label=a%3Db&state=running"),
            b""
        ))
        .contains("state"));
    }

    #[test]
    fn keepalive_needs_a_ttl() {
        let id = "sb-0123456789abcdef";
        let path = format!("/sandboxes/{id}/keepalive");
        assert_eq!(
            parse("POST", &path, None, br#"{"ttl_s":30}"#).expect("parse"),
            Action::Keepalive {
                id: id.into(),
                ttl_s: 30
            }
        );
        assert!(err(parse("POST", &path, None, br#"{"ttl_s":-30}"#)).contains("ttl_s"));
        assert!(err(parse("POST", &path, None, br#"{}"#)).contains("ttl_s"));
    }
}
