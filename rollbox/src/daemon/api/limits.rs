//! What a request may ask for: body sizes, exec output, counts, shapes and TTLs.

/// The largest request body the daemon reads.
pub const MAX_BODY: usize = 1 << 20;
/// The largest file or tar upload (streamed to the agent, never held whole).
pub const MAX_UPLOAD: usize = 256 << 20;
/// Default and largest stdout + stderr an exec keeps (the rest is dropped, `truncated` set).
pub const DEFAULT_OUTPUT_BYTES: u64 = 16 << 20;
pub const MAX_OUTPUT_BYTES: u64 = 64 << 20;
/// Longest exec timeout: one day.
pub const MAX_EXEC_TIMEOUT_S: f64 = 86_400.0;

/// Most sandboxes one fork makes.
pub const MAX_FORK: u32 = 64;
/// Most sandboxes one batch create makes.
pub const MAX_BATCH: u32 = 1000;
/// Most ids one `ids=` query names.
pub const MAX_IDS: usize = 1000;

/// The longest node id: it ends every sandbox id, which must fit an E2B host name's label
/// (`PORT-ID`, 63 bytes) and the sandbox's socket paths.
pub const MAX_NODE_ID: usize = 24;

/// Most vCPUs of one sandbox.
pub const MAX_VCPUS: u32 = 32;
/// Smallest `cpu_limit`, in cores.
pub const MIN_CPU_LIMIT: f64 = 0.01;
/// Largest guest memory in MiB.
pub const MAX_MEMORY_MIB: u32 = 256 * 1024;
/// Longest TTL (and idle TTL): 30 days.
pub const MAX_TTL_S: u64 = 30 * 24 * 3600;
/// How long a sandbox with `on_timeout: pause` is kept once paused (by its TTL or by hand):
/// the longest TTL. Then it ends; a resume gives it its create TTL again.
pub const PAUSED_RETENTION_S: u64 = MAX_TTL_S;
/// Most labels of one sandbox.
pub const MAX_LABELS: usize = 32;
/// Most metadata entries of one sandbox.
pub const MAX_METADATA: usize = 64;
/// Largest page of GET /sandboxes, and the page without a `limit`.
pub const MAX_LIST_LIMIT: u32 = 1000;
pub const DEFAULT_LIST_LIMIT: u32 = 100;
/// Most environment variables of a sandbox or an exec.
pub const MAX_ENV: usize = 256;
/// Most shared volumes one sandbox mounts.
pub const MAX_VOLUME_MOUNTS: usize = 8;
/// Longest volume name: it is the guest's virtio-fs tag (36 bytes at most there).
pub const MAX_VOLUME_NAME: usize = 32;
/// Most GPUs one sandbox asks for.
pub const MAX_GPU_COUNT: u32 = 16;
/// Longest wait of a create for busy GPUs.
pub const MAX_GPU_WAIT_S: u32 = 3600;
/// Entries in a sandbox's egress allow-list (each one rule in its nftables chain).
pub const MAX_EGRESS_ALLOW: usize = 256;
/// Exposed guest ports per sandbox.
pub const MAX_EXPOSE: usize = 16;
/// Largest size limit of a volume: 1 TiB.
pub const MAX_VOLUME_MIB: u32 = 1 << 20;
