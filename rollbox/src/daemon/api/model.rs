//! The API's model: the wire types of requests (as validated) and answers. Nothing here is the
//! agent's or the store's; those convert at their boundaries.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

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

/// What a sandbox's TTL does when it runs out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// End it (state `expired`).
    #[default]
    Kill,
    /// Pause it; paused, it is kept [`PAUSED_RETENTION_S`](super::limits::PAUSED_RETENTION_S).
    Pause,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
    }

    pub fn parse(text: &str) -> Option<OnTimeout> {
        [OnTimeout::Kill, OnTimeout::Pause]
            .into_iter()
            .find(|o| o.as_str() == text)
    }
}

/// A registered template: what a sandbox boots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    pub kernel: PathBuf,
    pub rootfs: Option<PathBuf>,
    /// The read-only base its rootfs stacks on (`STATE/templates/NAME/base.ext4`): the layers
    /// this template's image shares with images built before it, one file for all of them.
    /// Then `rootfs` is the top disk (the rest of the image as an overlay upper layer) and
    /// every sandbox of it boots with the overlay as its root. Set by image builds only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_rootfs: Option<PathBuf>,
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
    /// Volumes every sandbox of it mounts unless its create names others (its boot snapshot
    /// has them mounted, so such creates are restores).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// Every sandbox of it has a network, with this egress unless its create names another
    /// (its boot snapshot has the network interface, so such creates are restores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkRequest>,
    /// The agent starts dockerd after a boot, before the start command (and so before the
    /// boot snapshot): every sandbox of it has Docker ready.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub docker: bool,
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
    /// Credentials for this pull only: never stored, logged or answered.
    pub auth: Option<ImageAuth>,
}

/// `image.auth` of POST /templates: a user and password, or a registry token. It is only
/// ever read from a request: it has no `Serialize`, and its `Debug` hides the secrets.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageAuth {
    pub username: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
}

impl std::fmt::Debug for ImageAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |secret: &Option<String>| secret.as_ref().map(|_| "<redacted>");
        f.debug_struct("ImageAuth")
            .field("username", &self.username)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .finish()
    }
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
    /// What its TTL does when it runs out.
    pub on_timeout: OnTimeout,
    /// Paused, it resumes when a request comes for it (E2B's data plane); needs
    /// `on_timeout: pause`.
    pub auto_resume: bool,
    /// The tenant whose key made it (None: an admin key); the core sets it, never the body.
    pub tenant: Option<String>,
    /// Shared volumes to mount (a create from a snapshot takes the snapshot's).
    pub volumes: Vec<VolumeMount>,
    /// GPUs passed through (a boot only).
    pub gpu: Option<GpuRequest>,
    /// A network interface with NAT and an egress policy (a boot only, for now).
    pub network: Option<NetworkRequest>,
}

/// `network` of a create or a template.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NetworkRequest {
    /// The egress policy in `rollbox net`'s syntax (`none`, `all`, or `CIDR|HOST[:PORT[-PORT]],...`);
    /// None: the server's `--default-egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<String>,
    /// Guest TCP ports to expose: each gets a host port of the server's
    /// `--expose-port-range`, on 127.0.0.1 (and on `--publish`'s address, if given).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose: Vec<u16>,
}

impl NetworkRequest {
    /// This request with what it leaves out taken from `base` (a template's or a snapshot's
    /// network): its egress, and its exposed ports when it names none.
    pub fn over(&self, base: &NetworkRequest) -> NetworkRequest {
        NetworkRequest {
            egress: self.egress.clone().or_else(|| base.egress.clone()),
            expose: if self.expose.is_empty() {
                base.expose.clone()
            } else {
                self.expose.clone()
            },
        }
    }
}

/// A guest port exposed on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExposedPort {
    /// The guest's TCP port.
    pub port: u16,
    /// Where to connect: `--publish`'s address if the server publishes, else 127.0.0.1
    /// (which the host can use in either case).
    pub host_address: std::net::Ipv4Addr,
    pub host_port: u16,
}

/// A sandbox's network, as it was made: a host tap with a /30 of the server's pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetwork {
    /// The egress policy (`none`, `all`, or an allow-list).
    pub egress: String,
    /// The guest's address, its gateway (the host's end of the tap) and prefix length.
    pub address: std::net::Ipv4Addr,
    pub gateway: std::net::Ipv4Addr,
    pub prefix_len: u8,
    /// The guest's MAC.
    pub mac: String,
    /// The host's tap.
    pub tap: String,
    /// The DNS server the guest is given and may reach (none under `egress: none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<std::net::Ipv4Addr>,
    /// Its exposed ports, each with the host address and port that reach it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ExposedPort>,
}

/// `gpu` and `gpu_count` of a create: that many devices whose name matches (`any`: any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRequest {
    pub name: String,
    pub count: u32,
    /// How long a create waits for busy devices to come free (0: a 409 at once).
    pub wait_s: u64,
}

/// A GPU of the node: a PCI device bound to vfio-pci.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Its PCI address, `DDDD:BB:DD.F`.
    pub bdf: String,
    /// `rollbox serve --gpu BDF=NAME`, else the PCI ID database's vendor and device names.
    pub name: String,
    /// PCI vendor and device ids, hex.
    pub vendor: String,
    pub device: String,
    /// Devices of one IOMMU group go to one sandbox together.
    pub iommu_group: u32,
    /// The sandbox holding it (shown to admin keys).
    pub holder: Option<String>,
}

/// A shared volume as a sandbox mounts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name, which is also its virtio-fs tag in the guest.
    pub name: String,
    /// Where the guest mounts it (absolute).
    pub mount_path: String,
    #[serde(default)]
    pub readonly: bool,
}

/// A named shared volume (virtio-fs), served to each sandbox that mounts it by a virtiofsd
/// of that sandbox's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Volume {
    pub name: String,
    /// Its files on the host: under the state directory, or the directory an admin named.
    pub host_path: PathBuf,
    pub created_at_ms: u64,
    /// The tenant that owns it; absent for an admin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its size limit (an ext4 file system of this size); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_limit_mib: Option<u64>,
    /// The live sandboxes that mount it.
    #[serde(default)]
    pub mounted_by: Vec<String>,
}

/// POST /volumes, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateVolume {
    pub name: String,
    /// An existing host directory (admin only); None: a directory under the state dir.
    pub host_path: Option<PathBuf>,
    /// A size limit in MiB (a volume under the state dir only).
    pub size_limit_mib: Option<u64>,
    /// The core sets it from the key, never the body.
    pub tenant: Option<String>,
}

/// What a volume route does.
#[derive(Debug, Clone, PartialEq)]
pub enum VolumeOp {
    Get,
    Delete,
    /// GET .../files: a file's bytes, or a directory's listing.
    Read {
        path: String,
    },
    /// PUT .../files: the body becomes the file (streamed by the frontend).
    Write {
        path: String,
    },
    /// GET .../tar: a directory as a tar stream.
    Tar {
        path: String,
    },
    /// What a path is (a symlink described, not followed); no native route (the E2B
    /// frontend's volume content API).
    Stat {
        path: String,
    },
    /// Make a directory; `parents`: its missing parents too, and an existing one is no error.
    MakeDir {
        path: String,
        parents: bool,
    },
    /// Remove a file, symlink or directory (with what it holds).
    Remove {
        path: String,
    },
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
    /// Only this tenant's sandboxes (the core sets it for a tenant key, never the query).
    pub tenant: Option<String>,
}

/// The label that ties a sandbox to a Kubernetes pod (the pod's UID; `rollbox-lease` sets it):
/// with `rollbox serve --kubelet-pods-dir`, the sandbox ends once its pod is gone.
pub const POD_UID_LABEL: &str = "rollbox.dev/pod-uid";

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
    /// `console.log`, `vmm.log`, and a boot's `vmm-config.json` (the VMM's `--config`).
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
    /// What its TTL does when it runs out.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Paused, it resumes when a request comes for it.
    #[serde(default)]
    pub auto_resume: bool,
    /// The TTL it was created with: a resume of an `on_timeout: pause` sandbox runs it again.
    #[serde(default)]
    pub ttl_s: u64,
    /// The tenant that owns it; absent for sandboxes made with an admin key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its shared volumes.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
    /// The GPUs (PCI addresses) it holds.
    #[serde(default)]
    pub gpus: Vec<String>,
    /// Its network; absent: none (no network interface).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetwork>,
}

/// GET /sandboxes answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    pub next_page_token: Option<String>,
}

/// What to run: an argv, or a string for `/bin/sh -c`.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecCommand {
    /// argv[0] is looked up in PATH when it has no slash.
    Argv(Vec<String>),
    Shell(String),
}

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
        /// Write a temporary file and rename it over `path` (the native API), or write `path`
        /// in place, truncating it (E2B's envd: a watch sees a write of `path`, not a rename).
        atomic: bool,
        /// Replace the file's user metadata (E2B file metadata); None leaves it.
        metadata: Option<std::collections::BTreeMap<String, String>>,
        /// Give the file to this guest user as it is written (E2B's envd does); None: the
        /// agent's rules (a new file is root's, a replaced one keeps its owner).
        owner: Option<String>,
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

/// What kind of file an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// A file in the sandbox (stat, list).
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
}

/// A memory snapshot of a sandbox (the VMM's Full snapshot, plus a copy of its rootfs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    /// Its name, unique on the daemon (a new snapshot of the same name takes it over).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
    /// The tenant that owns it (its sandbox's); absent for an admin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The volumes its sandbox mounted: every restore of it mounts them again.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
    /// The egress of the network its sandbox had: every restore of it gets a network of its
    /// own (this egress unless the create names another); absent: no network interface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The guest ports its sandbox exposed: every restore of it exposes them too (on host
    /// ports of its own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose: Vec<u16>,
}

/// One sandbox of a fork: made, or why not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkResult {
    pub sandbox: Option<Sandbox>,
    pub error: Option<String>,
}

/// GET /sandboxes/{id}/usage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub sandbox: String,
    pub template: String,
    pub state: State,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// Whole seconds it ran (paused time not counted), rounded up.
    pub running_s: u64,
    pub vcpu_seconds: u64,
    pub memory_mib_seconds: u64,
    /// CPU time (user + system) its VMM processes used, as /proc measured it.
    pub cpu_seconds: f64,
    pub ended_at_ms: Option<u64>,
    /// The tenant that owns the sandbox; absent for an admin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// POST /keys, validated: a key for `tenant`, or an admin key (None).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewKey {
    pub tenant: Option<String>,
}

/// An API key as the API shows it: never its hash; its plaintext only in the answer to
/// the POST /keys that made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    pub id: String,
    /// `admin` or `tenant`.
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub created_at_ms: u64,
    /// The key itself: shown once, when it is made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// Whether a node takes new sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    Ready,
    /// `POST /node/drain`: creates, batches and forks get 503 until `DELETE /node/drain`.
    Draining,
}

/// GET /node: this daemon as one node of a fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// `rollbox serve --node-id`, else made once and kept in the state directory.
    pub node_id: String,
    pub version: String,
    pub status: NodeStatus,
    /// While draining with a deadline: when what is left is ended (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_deadline_ms: Option<u64>,
    pub slots: NodeSlots,
    pub memory_mib: NodeMemory,
    pub cpu: CpuFingerprint,
    pub templates: Vec<NodeTemplate>,
    /// The ids of the snapshots this node holds.
    pub snapshots: Vec<String>,
    /// `--warm-pool`: the VMM shells kept ready per guest memory size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm_pool: Vec<WarmPoolShape>,
}

/// One shape of the warm pool: a memory size, or a template's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmPoolShape {
    pub memory_mib: u32,
    /// The template its shells are kept for (`--warm-pool templates=N`); absent: any restore
    /// of its memory size (`MIB=N`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Shells it keeps ready (`--warm-pool MIB=N`).
    pub target: u64,
    /// Shells ready now.
    pub ready: u64,
}

/// Sandboxes against `--max-sandboxes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSlots {
    /// `--max-sandboxes` (none: no limit).
    pub total: Option<u64>,
    /// Live sandboxes: creating, running or paused.
    pub used: u64,
    /// Of those, the ones still being created.
    pub pending: u64,
}

/// Guest memory against `--memory-budget-mib`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeMemory {
    /// `--memory-budget-mib` (none: no limit).
    pub budget: Option<u64>,
    /// What the live sandboxes' guests hold.
    pub committed: u64,
    /// The host's `MemAvailable`.
    pub host_available: u64,
}

/// What a restore depends on of the host CPU: a snapshot taken on one node restores on
/// another whose `id` is the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuFingerprint {
    pub vendor: String,
    pub family: u32,
    pub model: u32,
    pub stepping: u32,
    /// A hash of the vendor, signature, feature leaves (1, 7, 0xd, 0x80000001) and the xsave
    /// layout: equal ids, restorable snapshots.
    pub id: String,
}

/// A template as a placement decision sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeTemplate {
    pub name: String,
    /// `reference@digest` of an image-built template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Whether creates restore its boot snapshot.
    pub boot_snapshot: bool,
}
