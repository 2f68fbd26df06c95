//! The typed interface between the frontends and the daemon's services: the [`Action`] every
//! request parses into, the [`Reply`] it gets, and [`ApiError`], which carries the HTTP status
//! of a refusal.

use std::collections::BTreeMap;

use hyper::body::Bytes;

use super::limits::MAX_UPLOAD;
use super::model::{
    AddTemplate, CreateSandbox, CreateVolume, Exec, ExecResult, FileInfo, FileOp, ForkResult, Gpu,
    KeyInfo, ListQuery, NetworkRequest, NewKey, NodeInfo, Sandbox, SandboxList, Snapshot, Template,
    Usage, Volume, VolumeOp,
};

/// A refused or failed request; [`ApiError::status`] is its HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing or wrong API key: send `Authorization: Bearer KEY`")]
    Unauthorized,
    /// The key is good but its role may not do this (a tenant key and an admin action).
    #[error("{0}")]
    Forbidden(String),
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
    /// The node is at one of its admission limits (`limit` names which): 429, retry later.
    #[error("{message}")]
    Full {
        limit: &'static str,
        message: String,
    },
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
            ApiError::Forbidden(_) => 403,
            ApiError::NotFound(_) => 404,
            ApiError::MethodNotAllowed { .. } => 405,
            ApiError::Conflict(_) => 409,
            ApiError::TooLarge(_) => 413,
            ApiError::Overloaded(_) | ApiError::Full { .. } => 429,
            ApiError::Internal(_) => 500,
            ApiError::Unavailable(_) => 503,
            ApiError::BadGateway(_) => 502,
        }
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
    /// A live sandbox's new egress policy.
    SetNetwork {
        id: String,
        network: NetworkRequest,
    },
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
    /// Snapshot a sandbox; `stop` ends it afterwards; `ttl_s`: retention removes it then;
    /// `name` moves that name to the new snapshot.
    Snapshot {
        id: String,
        stop: bool,
        ttl_s: Option<u64>,
        name: Option<String>,
    },
    ListSnapshots {
        sandbox: Option<String>,
    },
    /// A snapshot by id, or by name.
    GetSnapshot(String),
    DeleteSnapshot(String),
    /// The snapshot as an archive (`application/x-tar`, streamed) for another node's import.
    ExportSnapshot(String),
    /// An exported snapshot from the request body (an upload: only the HTTP layer has it).
    ImportSnapshot,
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
    /// Make an API key (admin only).
    AddKey(NewKey),
    ListKeys,
    /// Revoke a key by its id: its next request gets 401.
    RevokeKey(String),
    /// GET /node.
    GetNode,
    /// Take no new sandboxes; with a deadline, end what is left then.
    Drain {
        deadline_s: Option<u64>,
    },
    Undrain,
    ListVolumes,
    ListGpus,
    CreateVolume(CreateVolume),
    /// A route under /volumes/{name}.
    Volume {
        name: String,
        op: VolumeOp,
    },
}

impl Action {
    /// Whether only an admin key may run it: templates' writes, node metrics, keys and the
    /// node's own routes.
    pub fn admin_only(&self) -> bool {
        matches!(
            self,
            Action::AddTemplate(_)
                | Action::RemoveTemplate(_)
                | Action::Metrics
                | Action::AddKey(_)
                | Action::ListKeys
                | Action::RevokeKey(_)
                | Action::GetNode
                | Action::Drain { .. }
                | Action::Undrain
        )
    }
}

/// A typed answer; each frontend turns it into its own response (one per request, moved
/// once: the size of its largest variant, a sandbox, costs nothing worth a box).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Reply {
    Health,
    Template {
        created: bool,
        template: Template,
    },
    Templates(Vec<Template>),
    Sandbox {
        created: bool,
        sandbox: Sandbox,
    },
    Sandboxes(SandboxList),
    Exec(ExecResult),
    File(FileInfo),
    Files(Vec<FileInfo>),
    Written {
        path: String,
        bytes: u64,
    },
    Snapshot {
        created: bool,
        snapshot: Snapshot,
    },
    Snapshots(Vec<Snapshot>),
    Forked(Vec<ForkResult>),
    /// The sandboxes a DELETE /sandboxes ended.
    Deleted(Vec<String>),
    Usage(Usage),
    /// Prometheus text.
    Metrics(String),
    /// A key just made (201, with its plaintext).
    Key(KeyInfo),
    Keys(Vec<KeyInfo>),
    Node(NodeInfo),
    Volume {
        created: bool,
        volume: Volume,
    },
    Volumes(Vec<Volume>),
    Gpus(Vec<Gpu>),
    /// A body streamed as it comes (chunked): NDJSON exec lines, a file, a tar archive.
    Stream {
        content_type: &'static str,
        body: tokio::sync::mpsc::Receiver<Chunk>,
    },
    NoContent,
    /// 101: the connection now carries a guest TCP connection's bytes (`Upgrade: tcp`).
    SwitchingProtocols,
}

impl ForkResult {
    /// One create of a batch or a fork: the sandbox it made, or why not.
    pub fn of(result: Result<Reply, ApiError>) -> ForkResult {
        match result {
            Ok(Reply::Sandbox { sandbox, .. }) => ForkResult {
                sandbox: Some(sandbox),
                error: None,
            },
            Ok(other) => ForkResult {
                sandbox: None,
                error: Some(format!("unexpected reply {other:?}")),
            },
            Err(e) => ForkResult {
                sandbox: None,
                error: Some(e.to_string()),
            },
        }
    }
}

/// A streamed body chunk, or why the stream broke.
pub type Chunk = Result<Bytes, std::io::Error>;

/// The marker inside the `io::Error` an upload body gives when it passes [`MAX_UPLOAD`].
#[derive(Debug)]
pub struct BodyTooLarge;

impl std::fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body is over {MAX_UPLOAD} bytes")
    }
}

impl std::error::Error for BodyTooLarge {}
