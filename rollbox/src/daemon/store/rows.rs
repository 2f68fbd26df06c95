//! The tables' rows: what SQLite holds, apart from the API's model (a template's and a
//! snapshot's `spec` column is JSON of these; a sandbox is one column per field), and the
//! mapping both ways.

use std::collections::BTreeMap;
use std::path::PathBuf;

use rusqlite::Row;
use serde::{Deserialize, Serialize};

use super::super::api::{
    NetworkRequest, OnTimeout, Sandbox, Snapshot, State, Template, VolumeMount,
};
use super::{json_column, to_json, StoreError};

/// The columns of a sandbox row, in [`SandboxRow::read`]'s order.
pub const COLUMNS: &str = "seq, id, idempotency_key, template, state, vcpus, memory_mib, labels, \
    metadata, created_at_ms, expires_at_ms, idle_ttl_s, last_active_at_ms, pid, pid_start_time, \
    dir, ended_at_ms, end_reason, env, cpu_limit, deterministic, on_timeout, auto_resume, ttl_s, \
    tenant, volumes, gpus, network";

/// Between a tenant's name and its idempotency key or snapshot name in their columns: those
/// are unique per tenant, and neither a key nor a name may hold a control character.
const TENANT_SEPARATOR: char = '\u{1}';

/// A per-tenant unique value (idempotency key, snapshot name) as its column holds it.
pub fn namespaced(tenant: Option<&str>, value: &str) -> String {
    match tenant {
        Some(tenant) => format!("{tenant}{TENANT_SEPARATOR}{value}"),
        None => value.to_string(),
    }
}

/// The value of a [`namespaced`] column, without its tenant.
pub fn unnamespaced(column: String) -> String {
    match column.split_once(TENANT_SEPARATOR) {
        Some((_, value)) => value.to_string(),
        None => column,
    }
}

/// A `sandboxes` row: the JSON columns (labels, metadata, env) and the state as text.
pub struct SandboxRow {
    pub seq: i64,
    pub id: String,
    pub idempotency_key: Option<String>,
    pub template: String,
    pub state: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub labels: String,
    pub metadata: String,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub idle_ttl_s: Option<u64>,
    pub last_active_at_ms: u64,
    pub pid: Option<u32>,
    pub pid_start_time: Option<u64>,
    pub dir: String,
    pub ended_at_ms: Option<u64>,
    pub end_reason: Option<String>,
    pub env: String,
    pub cpu_limit: Option<f64>,
    pub deterministic: bool,
    pub on_timeout: String,
    pub auto_resume: bool,
    pub ttl_s: u64,
    pub tenant: Option<String>,
    /// JSON of its [`VolumeMount`]s.
    pub volumes: String,
    /// JSON of the PCI addresses of its GPUs.
    pub gpus: String,
    /// JSON of its network (`SandboxNetwork`), or NULL.
    pub network: Option<String>,
}

impl SandboxRow {
    /// A row selected with [`COLUMNS`].
    pub fn read(row: &Row) -> rusqlite::Result<SandboxRow> {
        Ok(SandboxRow {
            seq: row.get(0)?,
            id: row.get(1)?,
            idempotency_key: row.get(2)?,
            template: row.get(3)?,
            state: row.get(4)?,
            vcpus: row.get(5)?,
            memory_mib: row.get(6)?,
            labels: row.get(7)?,
            metadata: row.get(8)?,
            created_at_ms: row.get(9)?,
            expires_at_ms: row.get(10)?,
            idle_ttl_s: row.get(11)?,
            last_active_at_ms: row.get(12)?,
            pid: row.get(13)?,
            pid_start_time: row.get(14)?,
            dir: row.get(15)?,
            ended_at_ms: row.get(16)?,
            end_reason: row.get(17)?,
            env: row.get(18)?,
            cpu_limit: row.get(19)?,
            deterministic: row.get(20)?,
            on_timeout: row.get(21)?,
            auto_resume: row.get(22)?,
            ttl_s: row.get(23)?,
            tenant: row.get(24)?,
            volumes: row.get(25)?,
            gpus: row.get(26)?,
            network: row.get(27)?,
        })
    }

    /// The row of a sandbox about to be inserted (its `seq` is SQLite's to give).
    pub fn of(sandbox: &Sandbox) -> Result<SandboxRow, StoreError> {
        Ok(SandboxRow {
            seq: 0,
            id: sandbox.id.clone(),
            idempotency_key: sandbox
                .idempotency_key
                .as_deref()
                .map(|key| namespaced(sandbox.tenant.as_deref(), key)),
            template: sandbox.template.clone(),
            state: sandbox.state.as_str().to_string(),
            vcpus: sandbox.vcpus,
            memory_mib: sandbox.memory_mib,
            labels: to_json(&sandbox.labels, "labels")?,
            metadata: to_json(&sandbox.metadata, "metadata")?,
            created_at_ms: sandbox.created_at_ms,
            expires_at_ms: sandbox.expires_at_ms,
            idle_ttl_s: sandbox.idle_ttl_s,
            last_active_at_ms: sandbox.last_active_at_ms,
            pid: sandbox.pid,
            pid_start_time: sandbox.pid_start_time,
            dir: sandbox.dir.to_string_lossy().into_owned(),
            ended_at_ms: sandbox.ended_at_ms,
            end_reason: sandbox.end_reason.clone(),
            env: to_json(&sandbox.env, "env")?,
            cpu_limit: sandbox.cpu_limit,
            deterministic: sandbox.deterministic,
            on_timeout: sandbox.on_timeout.as_str().to_string(),
            auto_resume: sandbox.auto_resume,
            ttl_s: sandbox.ttl_s,
            tenant: sandbox.tenant.clone(),
            volumes: to_json(&sandbox.volumes, "volumes")?,
            gpus: to_json(&sandbox.gpus, "gpus")?,
            network: sandbox
                .network
                .as_ref()
                .map(|network| to_json(network, "network"))
                .transpose()?,
        })
    }

    /// The sandbox, and its position (for page tokens).
    pub fn into_model(self) -> Result<(i64, Sandbox), StoreError> {
        let sandbox = Sandbox {
            id: self.id,
            template: self.template,
            // A state this build does not know reads as failed.
            state: State::parse(&self.state).unwrap_or(State::Failed),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            labels: json_column::<BTreeMap<String, String>>(&self.labels, "labels")?,
            metadata: json_column(&self.metadata, "metadata")?,
            idempotency_key: self.idempotency_key.map(unnamespaced),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
            idle_ttl_s: self.idle_ttl_s,
            last_active_at_ms: self.last_active_at_ms,
            pid: self.pid,
            pid_start_time: self.pid_start_time,
            dir: PathBuf::from(self.dir),
            ended_at_ms: self.ended_at_ms,
            end_reason: self.end_reason,
            env: json_column(&self.env, "env")?,
            cpu_limit: self.cpu_limit,
            deterministic: self.deterministic,
            // A value this build does not know reads as kill (the default).
            on_timeout: OnTimeout::parse(&self.on_timeout).unwrap_or_default(),
            auto_resume: self.auto_resume,
            ttl_s: self.ttl_s,
            tenant: self.tenant,
            volumes: json_column(&self.volumes, "volumes")?,
            gpus: json_column(&self.gpus, "gpus")?,
            network: self
                .network
                .as_deref()
                .map(|text| json_column(text, "network"))
                .transpose()?,
        };
        Ok((self.seq, sandbox))
    }
}

/// A template's `spec` column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRow {
    pub name: String,
    pub kernel: PathBuf,
    pub rootfs: Option<PathBuf>,
    /// Rows written before layer sharing read as none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_rootfs: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_snapshot: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_s: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkRequest>,
    /// Rows written before `docker` existed read as false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub docker: bool,
}

impl From<&Template> for TemplateRow {
    fn from(t: &Template) -> TemplateRow {
        let t = t.clone();
        TemplateRow {
            name: t.name,
            kernel: t.kernel,
            rootfs: t.rootfs,
            base_rootfs: t.base_rootfs,
            initrd: t.initrd,
            cmdline: t.cmdline,
            vcpus: t.vcpus,
            memory_mib: t.memory_mib,
            created_at_ms: t.created_at_ms,
            image: t.image,
            boot_snapshot: t.boot_snapshot,
            start_cmd: t.start_cmd,
            ready_cmd: t.ready_cmd,
            ready_timeout_s: t.ready_timeout_s,
            volumes: t.volumes,
            network: t.network,
            docker: t.docker,
        }
    }
}

impl From<TemplateRow> for Template {
    fn from(t: TemplateRow) -> Template {
        Template {
            name: t.name,
            kernel: t.kernel,
            rootfs: t.rootfs,
            base_rootfs: t.base_rootfs,
            initrd: t.initrd,
            cmdline: t.cmdline,
            vcpus: t.vcpus,
            memory_mib: t.memory_mib,
            created_at_ms: t.created_at_ms,
            image: t.image,
            boot_snapshot: t.boot_snapshot,
            start_cmd: t.start_cmd,
            ready_cmd: t.ready_cmd,
            ready_timeout_s: t.ready_timeout_s,
            volumes: t.volumes,
            network: t.network,
            docker: t.docker,
        }
    }
}

/// A snapshot's `spec` column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRow {
    pub id: String,
    pub sandbox: String,
    pub parent: Option<String>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub dir: PathBuf,
    pub created_at_ms: u64,
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    #[serde(default)]
    pub deterministic: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose: Vec<u16>,
}

impl From<&Snapshot> for SnapshotRow {
    fn from(s: &Snapshot) -> SnapshotRow {
        let s = s.clone();
        SnapshotRow {
            id: s.id,
            sandbox: s.sandbox,
            parent: s.parent,
            template: s.template,
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            dir: s.dir,
            created_at_ms: s.created_at_ms,
            expires_at_ms: s.expires_at_ms,
            deterministic: s.deterministic,
            tenant: s.tenant,
            volumes: s.volumes,
            network: s.network,
            expose: s.expose,
        }
    }
}

impl From<SnapshotRow> for Snapshot {
    fn from(s: SnapshotRow) -> Snapshot {
        Snapshot {
            id: s.id,
            // The `name` column's; the store sets it.
            name: None,
            sandbox: s.sandbox,
            parent: s.parent,
            template: s.template,
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            dir: s.dir,
            created_at_ms: s.created_at_ms,
            expires_at_ms: s.expires_at_ms,
            deterministic: s.deterministic,
            tenant: s.tenant,
            volumes: s.volumes,
            network: s.network,
            expose: s.expose,
        }
    }
}

/// One sandbox's usage columns.
pub struct UsageRow {
    pub sandbox: Sandbox,
    /// Milliseconds it ran before `running_since_ms`.
    pub run_ms: u64,
    /// The start of its current running stretch.
    pub running_since_ms: Option<u64>,
    /// CPU time of its ended VMMs.
    pub cpu_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A template row written before `docker` existed reads as `docker: false`; a docker
    /// template's row keeps it.
    #[test]
    fn template_rows_without_docker_read_as_false() {
        let old = r#"{"name":"t","kernel":"/k","rootfs":null,"initrd":null,"cmdline":"","vcpus":1,"memory_mib":128,"created_at_ms":1}"#;
        let row: TemplateRow = serde_json::from_str(old).expect("an old row");
        assert!(!Template::from(row.clone()).docker);
        let mut template = Template::from(row);
        template.docker = true;
        let written = serde_json::to_string(&TemplateRow::from(&template)).expect("row");
        let read: TemplateRow = serde_json::from_str(&written).expect("read back");
        assert!(Template::from(read).docker, "{written}");
    }
}
