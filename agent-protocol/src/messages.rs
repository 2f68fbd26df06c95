//! The typed messages. Every frame carries a request id; all frames of one
//! request (its stream) share that id, in both directions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One frame from the host (client) to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientFrame {
    /// Request id chosen by the client; unique among its open requests.
    pub id: u64,
    pub body: ClientMessage,
}

/// One frame from the agent to the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerFrame {
    /// The id of the request this frame answers.
    pub id: u64,
    pub body: ServerMessage,
}

/// A static IPv4 configuration for one interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// Interface name (default `eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Address with its prefix length, e.g. `10.200.0.6/30`.
    pub address: String,
    /// Default gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// DNS servers; when given they replace /etc/resolv.conf.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<String>,
    /// A new MAC, `aa:bb:cc:dd:ee:ff`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// What the host asks. Messages marked "(stream input)" go to a request that
/// is still open under the same id; all others open a new request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ClientMessage {
    /// Version handshake; answered by `Hello`.
    Hello,
    /// Start a process and stream its output: `Started`, `Output`*, `Exited`.
    Exec(ExecRequest),
    /// Run a process to completion and answer once with `RunResult`.
    Run(ExecRequest),
    /// (stream input) Bytes for the stdin of an `Exec` or `DockerRun`.
    Stdin {
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// (stream input) Close the process's stdin.
    StdinClose,
    /// (stream input) Send a signal (number, e.g. 15) to the process.
    Signal {
        signal: i32,
        /// Signal the whole process group instead of only the process.
        #[serde(default)]
        group: bool,
    },
    /// (stream input) Abort: kills a running process group, or drops a
    /// half-written upload (its temporary file is removed).
    Cancel,
    /// Read a file: `Data`* then `End`.
    ReadFile {
        path: String,
        #[serde(default)]
        offset: u64,
        #[serde(default)]
        length: Option<u64>,
    },
    /// Write a file: answered by `Ready`; then send `Data`* and `End`;
    /// finished by `Written`.
    WriteFile(WriteFileRequest),
    /// (stream input) A chunk of an upload (`WriteFile`, `TarUpload`).
    Data {
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// (stream input) The upload is complete.
    End,
    /// File metadata: `Stat`.
    Stat {
        path: String,
        /// Follow a final symlink (stat) or describe the link itself (lstat).
        #[serde(default = "default_true")]
        follow_symlinks: bool,
    },
    /// Directory entries, sorted by name: `List`.
    List { path: String },
    /// Create a directory: `Ok`.
    Mkdir {
        path: String,
        /// Create missing parents too, and accept an existing directory.
        #[serde(default)]
        parents: bool,
        #[serde(default)]
        mode: Option<u32>,
        /// Give the directory, and the parents this call creates, to this account (a name or
        /// uid, as `Exec`'s `user`) and its primary group, as E2B's envd does; default: the
        /// agent's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<String>,
    },
    /// Remove a file, symlink or directory: `Ok`.
    Remove {
        path: String,
        /// Remove a non-empty directory with its contents.
        #[serde(default)]
        recursive: bool,
    },
    /// rename(2) within one file system: `Ok`.
    Move { from: String, to: String },
    /// A tar archive of a directory (or one file): `Data`* then `End`.
    TarDownload { path: String },
    /// Unpack a tar archive into a directory (created if missing): `Ready`,
    /// then `Data`* and `End` from the client, finished by `Written`.
    TarUpload { path: String },
    /// Set the wall clock (CLOCK_REALTIME): `Applied`.
    SetTime { unix_seconds: i64, nanos: u32 },
    /// Mix a fresh seed into the kernel RNG (RNDADDENTROPY): `Applied`.
    Reseed {
        #[serde(with = "crate::b64")]
        seed: Vec<u8>,
    },
    /// End the machine the agent is init of: `Applied`, then every other process gets
    /// SIGTERM, then SIGKILL, file systems are synced, and the kernel powers off (or reboots).
    PowerOff {
        #[serde(default)]
        reboot: bool,
    },
    /// New hostname and/or /etc/machine-id: `Applied`.
    SetIdentity {
        #[serde(default)]
        hostname: Option<String>,
        #[serde(default)]
        machine_id: Option<String>,
    },
    /// (Re)address a network interface, as after a fork: a new MAC (the link goes down and
    /// up for it), the IPv4 address replacing the old one, the default route and
    /// /etc/resolv.conf: `Applied`.
    ConfigureNetwork(NetworkConfig),
    /// Health and simple metrics: `Health`.
    Health,
    /// Start dockerd if it is not answering yet: `DockerReady`.
    DockerEnsure {
        /// How long to wait for the daemon socket (default 180 s).
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// Extra dockerd flags, used only when the agent starts dockerd.
        #[serde(default)]
        extra_args: Vec<String>,
    },
    /// Run a container through the docker CLI; streams like `Exec`.
    DockerRun(DockerRunRequest),
    /// (stream input) New terminal size for an `Exec` started with `pty`.
    Resize(PtySize),
    /// Watch a directory with inotify: `Watching`, then `FsEvents`* until the client sends
    /// `Cancel` or the directory is removed or moved, ended by `WatchEnded`.
    Watch(WatchRequest),
    /// Open a TCP connection from inside the guest: `TcpConnected`, after which the connection
    /// stops carrying frames and is a raw byte pipe to that socket, both ways, until either
    /// side closes. Only `Hello` may come before it on a connection.
    TcpConnect {
        /// The guest address to dial (default `127.0.0.1`).
        #[serde(default = "default_tcp_host")]
        host: String,
        port: u16,
    },
    /// Look up an account by name (or numeric uid) in the agent's passwd and group files, as
    /// `Exec`'s `user` would run: `Account`, or an `ENOENT` error when there is none. Agents
    /// older than this answer `bad_request` (an unknown message).
    LookupUser { name: String },
}

/// Where `TcpConnect` dials when it names no host: the guest's own loopback.
pub const DEFAULT_TCP_HOST: &str = "127.0.0.1";

fn default_tcp_host() -> String {
    DEFAULT_TCP_HOST.to_owned()
}

fn default_true() -> bool {
    true
}

/// What to execute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// argv[0] is looked up in PATH when it has no slash.
    Argv(Vec<String>),
    /// Run with `/bin/sh -c`.
    Shell(String),
}

/// A process to start. Defaults: inherit the agent's environment (plus a
/// default PATH), cwd `/`, the agent's user, no timeout, no output cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub command: Command,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Variables set on top of the base environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment instead of the agent's.
    #[serde(default)]
    pub clear_env: bool,
    /// User name or numeric uid, looked up in the guest's /etc/passwd.
    #[serde(default)]
    pub user: Option<String>,
    /// Hard timeout: SIGTERM to the process group, then SIGKILL after the grace period.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Time between SIGTERM and SIGKILL (default 2000 ms).
    #[serde(default)]
    pub kill_grace_ms: Option<u64>,
    /// Cap on stdout + stderr bytes kept or sent; the rest is read and dropped.
    #[serde(default)]
    pub output_limit_bytes: Option<u64>,
    /// Memory limit for the cgroup the process runs in (when cgroups are available).
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    /// Keep stdin open for `Stdin` frames (Exec). Otherwise stdin is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// Stdin contents for `Run` (written, then closed).
    #[serde(default, with = "crate::b64::option")]
    pub stdin_data: Option<Vec<u8>>,
    /// Run on a new pseudo-terminal of this size (`Exec` only): stdin, stdout and stderr are
    /// the terminal, `Stdin` frames are typed into it, output comes as one `pty` stream, and
    /// `Resize` changes its size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// A terminal size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// A directory to watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    pub path: String,
    /// Watch every subdirectory too, including ones created later.
    #[serde(default)]
    pub recursive: bool,
    /// Refuse a directory on a network file system (NFS, CIFS/SMB, FUSE: envd's list), where
    /// inotify misses other machines' changes (default false: any file system is watched).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refuse_network_mounts: bool,
}

/// What happened to an entry under a watched directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsEventKind {
    /// Created, or moved in.
    Create,
    /// Its contents were written.
    Write,
    /// Deleted.
    Remove,
    /// Moved away (its new name, if under the watch, comes as `Create`).
    Rename,
    /// Permissions, owner or other metadata changed.
    Chmod,
}

/// One file system event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    /// The entry's path relative to the watched directory (`sub/file` in a recursive watch).
    pub name: String,
    pub kind: FsEventKind,
}

impl ExecRequest {
    /// An argv command with all defaults.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// A `/bin/sh -c` command with all defaults.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(Command::Shell(script.into()))
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            cwd: None,
            env: BTreeMap::new(),
            clear_env: false,
            user: None,
            timeout_ms: None,
            kill_grace_ms: None,
            output_limit_bytes: None,
            memory_limit_bytes: None,
            stdin: false,
            stdin_data: None,
            pty: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    pub path: String,
    /// Permission bits; default: those of the file being replaced, else 0644.
    #[serde(default)]
    pub mode: Option<u32>,
    /// Give the file, and the parents this write creates, to this account (a name or uid, as
    /// `Exec`'s `user`) and its primary group as it is written, as E2B's envd does; default:
    /// the owner of the file being replaced, else the agent's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Write a temporary file in the same directory, fsync, rename (default true).
    #[serde(default = "default_true")]
    pub atomic: bool,
    /// Create missing parent directories.
    #[serde(default)]
    pub make_parents: bool,
    /// Replace the file's user metadata (its `user.e2b.*` extended attributes) with these
    /// once written; an empty map clears them. None (the default) leaves them as they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl WriteFileRequest {
    pub fn new(path: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            mode: None,
            owner: None,
            atomic: true,
            make_parents: false,
            metadata: None,
        }
    }
}

/// The extended-attribute name prefix of a file's user metadata (`WriteFileRequest::metadata`,
/// `FileInfo::metadata`).
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";
/// Longest metadata key: what Linux's 255-byte attribute name leaves after the prefix.
pub const METADATA_MAX_KEY: usize = 255 - METADATA_XATTR_PREFIX.len();
/// Longest metadata value the agent accepts (Linux allows 64 KiB; ext4 keeps them in one
/// block).
pub const METADATA_MAX_VALUE: usize = 4096;

/// `docker run --rm` of an image, through the docker CLI in the guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DockerRunRequest {
    pub image: String,
    /// Command and arguments after the image (empty: the image's default).
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// `--network` value, e.g. "none" or "host"; default: docker's default.
    #[serde(default)]
    pub network: Option<String>,
    /// More `docker run` flags, placed before the image.
    #[serde(default)]
    pub extra_args: Vec<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub kill_grace_ms: Option<u64>,
    #[serde(default)]
    pub output_limit_bytes: Option<u64>,
    /// Keep stdin open (`docker run -i`) for `Stdin` frames.
    #[serde(default)]
    pub stdin: bool,
    /// Start dockerd first if it is not running (default true).
    #[serde(default = "default_true")]
    pub ensure_daemon: bool,
}

impl DockerRunRequest {
    pub fn new(image: impl Into<String>, command: Vec<String>) -> Self {
        Self {
            image: image.into(),
            command,
            env: BTreeMap::new(),
            workdir: None,
            user: None,
            network: None,
            extra_args: Vec::new(),
            timeout_ms: None,
            kill_grace_ms: None,
            output_limit_bytes: None,
            stdin: false,
            ensure_daemon: true,
        }
    }
}

/// What the agent answers. Every request ends with exactly one terminal
/// message (see [`ServerMessage::is_terminal`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    Hello {
        agent_version: String,
        protocol_version: u32,
    },
    /// The process started (Exec, DockerRun).
    Started {
        pid: u32,
    },
    /// A chunk of stdout or stderr. `seq` counts chunks of both streams in order, from 0.
    Output {
        stream: OutputStream,
        seq: u64,
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// The process ended (Exec, DockerRun).
    Exited(ExitStatus),
    /// Everything from a `Run`.
    RunResult {
        #[serde(with = "crate::b64")]
        stdout: Vec<u8>,
        #[serde(with = "crate::b64")]
        stderr: Vec<u8>,
        status: ExitStatus,
    },
    /// A chunk of a download (ReadFile, TarDownload), `seq` from 0.
    Data {
        seq: u64,
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// The download is complete; `bytes` in total.
    End {
        bytes: u64,
    },
    /// The upload may start.
    Ready,
    /// The upload is stored; `bytes` received.
    Written {
        bytes: u64,
    },
    Stat(FileInfo),
    List {
        entries: Vec<FileInfo>,
    },
    Ok,
    /// Result of a post-restore fixup. `applied` is false when the agent was
    /// told not to apply it (e.g. `--no-set-clock`); `detail` says what happened.
    Applied {
        applied: bool,
        detail: String,
    },
    Health(Health),
    DockerReady {
        /// True when this request started dockerd, false when it already answered.
        started: bool,
        waited_ms: u64,
    },
    /// The watch is set up (Watch); events from now on are reported.
    Watching,
    /// File system events of a `Watch`, in the order inotify gave them.
    FsEvents {
        events: Vec<FsEvent>,
    },
    /// The watch ended: the client cancelled it, or the watched directory was removed or
    /// moved; `reason` says which.
    WatchEnded {
        reason: String,
    },
    /// A stream input for a still-open request was refused (e.g. an invalid
    /// signal number); the request goes on. Not terminal.
    Notice {
        message: String,
    },
    /// The request failed; terminal.
    Error(ErrorInfo),
    /// `TcpConnect` reached `address`; the next byte either way is the pipe's. Terminal.
    TcpConnected {
        address: String,
    },
    /// The account `LookupUser` asked for.
    Account(Account),
}

impl ServerMessage {
    /// True for the message that ends a request.
    pub fn is_terminal(&self) -> bool {
        !matches!(
            self,
            Self::Started { .. }
                | Self::Output { .. }
                | Self::Data { .. }
                | Self::Ready
                | Self::Watching
                | Self::FsEvents { .. }
                | Self::Notice { .. }
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputStream {
    Stdout,
    Stderr,
    /// The terminal of a `pty` exec (stdout and stderr together).
    Pty,
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    pub code: Option<i32>,
    /// Signal number when a signal ended the process.
    pub signal: Option<i32>,
    /// The hard timeout fired (and the process group was killed).
    pub timed_out: bool,
    /// The kernel OOM killer killed a process of this exec (see `oom_detection`).
    pub oom_killed: bool,
    /// How OOM kills were detected for this exec.
    pub oom_detection: OomDetection,
    /// Output beyond `output_limit_bytes` was dropped.
    pub truncated: bool,
    /// Bytes of stdout, or of the terminal for a `pty` exec.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub duration_ms: u64,
}

impl ExitStatus {
    /// Exited with code 0, no timeout.
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }
}

/// Where the OOM verdict came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OomDetection {
    /// `oom_kill` in memory.events of the exec's own cgroup v2: exact.
    CgroupV2,
    /// `oom_kill` in memory.oom_control of the exec's own cgroup v1: exact.
    CgroupV1,
    /// No cgroup: the process died of SIGKILL while the system-wide
    /// /proc/vmstat `oom_kill` counter rose. A strong hint, not proof.
    KernelCounter,
    /// Nothing to go on.
    #[default]
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    /// Last path component.
    pub name: String,
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (including setuid/setgid/sticky).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// The target, for a symlink.
    #[serde(default)]
    pub link_target: Option<String>,
    /// User metadata: the `user.e2b.*` extended attributes, prefix stripped (agents before
    /// this field send none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// An account of the guest's passwd file (`LookupUser`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    pub agent_version: String,
    pub protocol_version: u32,
    pub pid: u32,
    /// The agent runs as PID 1 (init) of its PID namespace.
    pub is_init: bool,
    pub uptime_seconds: f64,
    pub load: [f64; 3],
    pub memory: MemoryInfo,
    pub disk: DiskInfo,
    pub running_processes: u64,
    /// The VM generation counter as the agent last read it; absent when it
    /// does not watch the counter (host mode, not x86_64, no port access).
    #[serde(default)]
    pub generation: Option<u64>,
    /// Whether every step of the re-identification after the last generation
    /// change worked; absent before any change.
    #[serde(default)]
    pub generation_applied: Option<bool>,
}

/// From /proc/meminfo, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryInfo {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub available_bytes: u64,
}

/// statvfs of `/`, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskInfo {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub available_bytes: u64,
}

/// A failed request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// errno name (e.g. "ENOENT") for system errors, else a short kind
    /// ("bad_request", "unknown_request", "internal").
    pub code: String,
    /// The errno value, for system errors.
    #[serde(default)]
    pub errno: Option<i32>,
    /// Human-readable, names the input: "open /x/y: No such file or directory".
    pub message: String,
}

impl std::fmt::Display for ErrorInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)
    }
}

impl ErrorInfo {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            code: "bad_request".into(),
            errno: None,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_round_trips_with_defaults_filled() {
        let json = r#"{"id":7,"body":{"op":"exec","command":{"argv":["echo","hi"]}}}"#;
        let frame: ClientFrame = serde_json::from_str(json).expect("parse");
        assert_eq!(frame.id, 7);
        assert_eq!(
            frame.body,
            ClientMessage::Exec(ExecRequest::argv(["echo", "hi"]))
        );
        let back = serde_json::to_string(&frame).expect("serialize");
        let again: ClientFrame = serde_json::from_str(&back).expect("reparse");
        assert_eq!(again, frame);
    }

    #[test]
    fn binary_data_is_base64() {
        let frame = ServerFrame {
            id: 1,
            body: ServerMessage::Output {
                stream: OutputStream::Stderr,
                seq: 3,
                data: b"\x00\xffhi".to_vec(),
            },
        };
        let json = serde_json::to_string(&frame).expect("serialize");
        assert!(json.contains(r#""data":"AP9oaQ==""#), "{json}");
        assert_eq!(
            serde_json::from_str::<ServerFrame>(&json).expect("parse"),
            frame
        );
    }

    #[test]
    fn terminal_messages() {
        assert!(!ServerMessage::Ready.is_terminal());
        assert!(!ServerMessage::Started { pid: 1 }.is_terminal());
        assert!(ServerMessage::Ok.is_terminal());
        assert!(ServerMessage::Error(ErrorInfo::bad_request("x")).is_terminal());
    }

    #[test]
    fn health_of_an_older_agent_has_no_generation() {
        let json = r#"{"agent_version":"0.1.0","protocol_version":1,"pid":1,"is_init":true,
            "uptime_seconds":1.5,"load":[0.0,0.0,0.0],
            "memory":{"total_bytes":1,"free_bytes":1,"available_bytes":1},
            "disk":{"total_bytes":1,"free_bytes":1,"available_bytes":1},
            "running_processes":0}"#;
        let health: Health = serde_json::from_str(json).expect("parse");
        assert_eq!((health.generation, health.generation_applied), (None, None));
    }

    #[test]
    fn pty_exec_and_watch_frames_round_trip() {
        let json = r#"{"id":2,"body":{"op":"exec","command":{"shell":"tty"},"pty":{"rows":24,"cols":80}}}"#;
        let frame: ClientFrame = serde_json::from_str(json).expect("parse");
        let ClientMessage::Exec(req) = &frame.body else {
            panic!("not an exec: {frame:?}");
        };
        assert_eq!(req.pty, Some(PtySize { rows: 24, cols: 80 }));
        let resize = r#"{"id":2,"body":{"op":"resize","rows":50,"cols":132}}"#;
        assert_eq!(
            serde_json::from_str::<ClientFrame>(resize)
                .expect("parse")
                .body,
            ClientMessage::Resize(PtySize {
                rows: 50,
                cols: 132
            })
        );
        let watch = r#"{"id":3,"body":{"op":"watch","path":"/tmp"}}"#;
        assert_eq!(
            serde_json::from_str::<ClientFrame>(watch)
                .expect("parse")
                .body,
            ClientMessage::Watch(WatchRequest {
                path: "/tmp".into(),
                recursive: false,
                refuse_network_mounts: false,
            })
        );
        let events = ServerMessage::FsEvents {
            events: vec![FsEvent {
                name: "a/b".into(),
                kind: FsEventKind::Chmod,
            }],
        };
        let text = serde_json::to_string(&events).expect("serialize");
        assert_eq!(
            text,
            r#"{"type":"fs_events","events":[{"name":"a/b","kind":"chmod"}]}"#
        );
        assert!(!events.is_terminal());
        assert!(!ServerMessage::Watching.is_terminal());
        assert!(ServerMessage::WatchEnded {
            reason: "cancelled".into()
        }
        .is_terminal());
    }

    #[test]
    fn write_metadata_and_network_mount_fields_are_optional() {
        // Older hosts send neither field: atomic writes, metadata untouched, any mount watched.
        let old = r#"{"op":"write_file","path":"/a"}"#;
        let ClientMessage::WriteFile(req) = serde_json::from_str(old).expect("parse") else {
            panic!("not a write");
        };
        assert_eq!(req, WriteFileRequest::new("/a"));
        let mut req = WriteFileRequest::new("/a");
        req.atomic = false;
        req.metadata = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
        req.owner = Some("user".into());
        let text = serde_json::to_string(&ClientMessage::WriteFile(req.clone())).expect("json");
        assert!(text.contains(r#""metadata":{"k":"v"}"#), "{text}");
        assert_eq!(
            serde_json::from_str::<ClientMessage>(&text).expect("parse"),
            ClientMessage::WriteFile(req)
        );
        let watch = WatchRequest {
            path: "/w".into(),
            recursive: false,
            refuse_network_mounts: false,
        };
        let text = serde_json::to_string(&watch).expect("json");
        assert!(!text.contains("refuse_network_mounts"), "{text}");
        // An entry without metadata reads as an empty map, and writes none.
        let entry = r#"{"name":"a","path":"/a","kind":"file","size":1,"mode":420,"uid":0,"gid":0,"mtime_ns":0}"#;
        let info: FileInfo = serde_json::from_str(entry).expect("parse");
        assert!(info.metadata.is_empty());
        assert!(!serde_json::to_string(&info)
            .expect("json")
            .contains("metadata"));
    }

    #[test]
    fn tcp_connect_dials_loopback_unless_told() {
        let frame: ClientFrame =
            serde_json::from_str(r#"{"id":1,"body":{"op":"tcp_connect","port":8080}}"#)
                .expect("parse");
        assert_eq!(
            frame.body,
            ClientMessage::TcpConnect {
                host: "127.0.0.1".into(),
                port: 8080
            }
        );
        let refused = serde_json::from_str::<ClientFrame>(
            r#"{"id":1,"body":{"op":"tcp_connect","port":70000}}"#,
        );
        assert!(refused.is_err(), "a port above 65535 parsed");
        assert!(ServerMessage::TcpConnected {
            address: "127.0.0.1:8080".into()
        }
        .is_terminal());
    }

    #[test]
    fn lookup_user_and_write_owner_on_the_wire() {
        let frame: ClientFrame =
            serde_json::from_str(r#"{"id":1,"body":{"op":"lookup_user","name":"user"}}"#)
                .expect("parse");
        assert_eq!(
            frame.body,
            ClientMessage::LookupUser {
                name: "user".into()
            }
        );
        let account = ServerMessage::Account(Account {
            name: "user".into(),
            uid: 1000,
            gid: 1000,
            home: "/home/user".into(),
            shell: "/bin/bash".into(),
        });
        let text = serde_json::to_string(&account).expect("serialize");
        assert!(
            text.starts_with(r#"{"type":"account","name":"user""#),
            "{text}"
        );
        assert!(account.is_terminal());
        // A write without an owner encodes as before, so older agents still read it.
        let plain = serde_json::to_string(&WriteFileRequest::new("/x")).expect("serialize");
        assert!(!plain.contains("owner"), "{plain}");
        let owned: WriteFileRequest =
            serde_json::from_str(r#"{"path":"/x","owner":"user"}"#).expect("parse");
        assert_eq!(owned.owner.as_deref(), Some("user"));
    }

    #[test]
    fn unknown_op_is_rejected() {
        let err = serde_json::from_str::<ClientFrame>(r#"{"id":1,"body":{"op":"fly"}}"#);
        assert!(err.is_err());
    }
}
