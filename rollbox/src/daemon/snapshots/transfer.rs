//! Snapshots that move between nodes. Export streams a snapshot as the archive of
//! [`super::archive`]: a manifest (what the snapshot is, the CPU and template it needs, its
//! files), then its files, holes left out. Import checks the manifest against this node
//! before it takes a byte of the files (CPU fingerprint, template and its image and shared
//! base, volumes, sizes, disk space), stages the files in a directory of their own and
//! records the snapshot only once every file is whole: a cut upload, a refusal or a daemon
//! killed midway leaves nothing (the staging directory goes at once, or at the next start
//! with [`Snapshots::sweep`]). Both are restartable: an export is read-only, and importing
//! a snapshot this node already has answers it again.

use std::collections::BTreeSet;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::io::AsyncRead;

use super::super::api::{
    check_snapshot_id, check_snapshot_name, ApiError, Chunk, CpuFingerprint, Reply, Snapshot,
    Template, VolumeMount, MAX_MEMORY_MIB, MAX_VCPUS,
};
use super::super::supervisor::jaildir::JailDir;
use super::super::util::{internal, random_hex, remove_dir};
use super::archive::{self, ArchiveError, Member, Reader, MANIFEST};
use super::Snapshots;
use crate::images::digest::to_hex;

/// The manifest format this daemon writes and reads.
const FORMAT: u32 = 1;
/// The largest manifest read.
const MAX_MANIFEST: u64 = 1 << 20;
/// The largest VM state file taken.
const MAX_VMSTATE: u64 = 64 << 20;
/// The largest disk taken (a sparse file: only its data needs room).
const MAX_ROOTFS: u64 = 1 << 40;
/// Disk kept free beside an import's data.
const DISK_MARGIN: u64 = 64 << 20;
/// The largest memory identity file taken (`memory.id`: the memory file's id and length).
const MAX_MEMORY_ID: u64 = 4096;
/// A snapshot's files, in the order an archive has them.
const FILES: [&str; 4] = ["vmstate", "memory", "memory.id", "rootfs.img"];

/// What an exported snapshot is, where it was made and what follows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    /// The node that exported it.
    pub node: String,
    /// The CPU it was taken on: it restores only where `cpu.id` is the same.
    pub cpu: CpuFingerprint,
    pub snapshot: ManifestSnapshot,
    pub template: ManifestTemplate,
    pub files: Vec<ManifestFile>,
}

/// The snapshot's record, as the importing node keeps it (its tenant is the importer's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestSnapshot {
    pub id: String,
    pub name: Option<String>,
    pub sandbox: String,
    pub parent: Option<String>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub created_at_ms: u64,
    pub expires_at_ms: Option<u64>,
    pub deterministic: bool,
    pub volumes: Vec<VolumeMount>,
    pub network: Option<String>,
    pub expose: Vec<u16>,
}

/// What the template must be on the importing node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestTemplate {
    pub name: String,
    /// `reference@digest` of an image-built template.
    pub image: Option<String>,
    /// The ext4 UUID of the shared base its sandboxes stack on: the very same base file
    /// must be there (a base built again gets another UUID).
    pub base: Option<String>,
}

/// One file of the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    pub name: String,
    /// Its size, holes included.
    pub size: u64,
    /// The bytes of data the archive carries for it.
    pub stored: u64,
}

impl From<&Snapshot> for ManifestSnapshot {
    fn from(s: &Snapshot) -> ManifestSnapshot {
        ManifestSnapshot {
            id: s.id.clone(),
            name: s.name.clone(),
            sandbox: s.sandbox.clone(),
            parent: s.parent.clone(),
            template: s.template.clone(),
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            created_at_ms: s.created_at_ms,
            expires_at_ms: s.expires_at_ms,
            deterministic: s.deterministic,
            volumes: s.volumes.clone(),
            network: s.network.clone(),
            expose: s.expose.clone(),
        }
    }
}

/// The ext4 UUID of `base` (bytes 0x68..0x78 of its superblock, at 1024), in hex.
fn ext4_uuid(base: &Path) -> Result<String, ApiError> {
    use std::os::unix::fs::FileExt as _;
    let mut uuid = [0u8; 16];
    std::fs::File::open(base)
        .and_then(|f| f.read_exact_at(&mut uuid, 1024 + 0x68))
        .map_err(|e| internal(format!("the shared base {}: {e}", base.display())))?;
    Ok(to_hex(&uuid))
}

/// The template's shared base, by its UUID.
fn base_of(template: &Template) -> Result<Option<String>, ApiError> {
    template.base_rootfs.as_deref().map(ext4_uuid).transpose()
}

/// Bytes free on the file system of `dir`.
fn free_bytes(dir: &Path) -> Result<u64, ApiError> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(internal)?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: statvfs writes one `struct statvfs` into `stat`; the path is NUL-terminated.
    if unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } < 0 {
        return Err(internal(format!(
            "{}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: statvfs succeeded, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// An archive error as the API says it: a bad or cut archive is the client's (400), a file
/// that cannot be written the daemon's (500). (An import has no upload limit: its manifest
/// bounds each file.)
fn refused(e: ArchiveError) -> ApiError {
    match e {
        ArchiveError::Io { .. } => ApiError::Internal(e.to_string()),
        ArchiveError::Malformed(_) | ArchiveError::Truncated(_) => {
            ApiError::BadRequest(e.to_string())
        }
    }
}

/// Sends what the archive writer writes down the response channel, a chunk per write.
struct ChannelWriter(tokio::sync::mpsc::Sender<Chunk>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(hyper::body::Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Snapshots {
    /// GET /snapshots/{id}/export: the snapshot's files are opened first (a snapshot deleted
    /// while it streams still streams whole), then written as they are read.
    pub async fn export(&self, id: &str) -> Result<Reply, ApiError> {
        let snapshot = self
            .db
            .lock()
            .snapshot(id)
            .map_err(internal)?
            .ok_or_else(|| ApiError::NotFound(format!("no snapshot {id}")))?;
        let template = self
            .db
            .lock()
            .template(&snapshot.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "snapshot {id}: its template {:?} was removed, so no node could restore it",
                    snapshot.template
                ))
            })?;
        let members = open_members(&snapshot.dir)?;
        let manifest = Manifest {
            format: FORMAT,
            node: self.node.id().to_string(),
            cpu: self.node.cpu().clone(),
            snapshot: ManifestSnapshot::from(&snapshot),
            template: ManifestTemplate {
                name: template.name.clone(),
                image: template.image.clone(),
                base: base_of(&template)?,
            },
            files: members
                .iter()
                .map(|m| ManifestFile {
                    name: m.name.clone(),
                    size: m.size(),
                    stored: m.stored(),
                })
                .collect(),
        };
        let manifest = serde_json::to_vec_pretty(&manifest).map_err(internal)?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(8);
        let mtime = snapshot.created_at_ms / 1000;
        let what = format!("export of snapshot {id}");
        tokio::task::spawn_blocking(move || {
            // write_archive flushes it at the end.
            let mut out = std::io::BufWriter::with_capacity(1 << 20, ChannelWriter(tx.clone()));
            if let Err(e) = archive::write_archive(&mut out, &manifest, &members, mtime) {
                log::info!("{what}: {e}");
                // A chunked body without its end tells the client it was cut.
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            }
        });
        Ok(Reply::Stream {
            content_type: "application/x-tar",
            body: rx,
        })
    }

    /// POST /snapshots/import: an exported snapshot, as `tenant`'s.
    pub async fn import<R>(&self, body: R, tenant: Option<String>) -> Result<Reply, ApiError>
    where
        R: AsyncRead + Unpin,
    {
        let mut reader = Reader::new(body);
        let first = reader
            .next()
            .await
            .map_err(refused)?
            .ok_or_else(|| ApiError::BadRequest("the snapshot archive is empty".into()))?;
        if first.name != MANIFEST {
            return Err(ApiError::BadRequest(format!(
                "the snapshot archive starts with {:?}, not {MANIFEST} (was it made by GET /snapshots/ID/export?)",
                first.name
            )));
        }
        let bytes = reader
            .read_small(&first, MAX_MANIFEST)
            .await
            .map_err(refused)?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::BadRequest(format!("{MANIFEST}: {e}")))?;
        let snapshot = self.admit(&manifest, tenant)?;
        if let Some(existing) = self.db.lock().snapshot(&snapshot.id).map_err(internal)? {
            return already_here(existing, &snapshot);
        }
        let need: u64 = manifest.files.iter().map(|f| f.stored).sum();
        let free = free_bytes(&self.dir)?;
        if free < need.saturating_add(DISK_MARGIN) {
            return Err(ApiError::Unavailable(format!(
                "snapshot {}: {} MiB of files, {} MiB free in {}",
                snapshot.id,
                need >> 20,
                free >> 20,
                self.dir.display()
            )));
        }
        // A dot name: never a snapshot's, and swept at the next start if the daemon dies.
        let staging = self.dir.join(format!(".import-{}", random_hex()));
        std::fs::create_dir(&staging)
            .map_err(|e| internal(format!("{}: {e}", staging.display())))?;
        let received = self.receive(&mut reader, &manifest, &staging).await;
        let placed = received.and_then(|()| self.place(&staging, &snapshot));
        if let Err(e) = placed {
            let _ = remove_dir(&staging);
            // Another import of the same snapshot may have won the race.
            if let Ok(Some(existing)) = self.db.lock().snapshot(&snapshot.id) {
                return already_here(existing, &snapshot);
            }
            return Err(e);
        }
        log::info!(
            "imported snapshot {} (template {:?}) from node {}",
            snapshot.id,
            snapshot.template,
            manifest.node
        );
        Ok(Reply::Snapshot {
            created: true,
            snapshot,
        })
    }

    /// The manifest checked against this node; the snapshot it would record.
    fn admit(&self, manifest: &Manifest, tenant: Option<String>) -> Result<Snapshot, ApiError> {
        if manifest.format != FORMAT {
            return Err(ApiError::BadRequest(format!(
                "{MANIFEST}: format {}; this daemon reads format {FORMAT} (was it made by another rollbox version?)",
                manifest.format
            )));
        }
        let s = &manifest.snapshot;
        let id = check_snapshot_id(&s.id, "snapshot.id")?;
        let name = s
            .name
            .as_deref()
            .map(|n| check_snapshot_name(n, "snapshot.name"))
            .transpose()?;
        let cpu = self.node.cpu();
        if manifest.cpu.id != cpu.id {
            let c = &manifest.cpu;
            return Err(ApiError::Conflict(format!(
                "snapshot {id} was taken on node {} with CPU fingerprint {} ({} family {} model {} stepping {}), this node's is {} ({} family {} model {} stepping {}): it would not restore here; import it on a node whose GET /node shows cpu.id {}",
                manifest.node, c.id, c.vendor, c.family, c.model, c.stepping,
                cpu.id, cpu.vendor, cpu.family, cpu.model, cpu.stepping, c.id
            )));
        }
        if s.vcpus == 0 || s.vcpus > MAX_VCPUS || s.memory_mib == 0 || s.memory_mib > MAX_MEMORY_MIB
        {
            return Err(ApiError::BadRequest(format!(
                "snapshot {id}: {} vCPUs and {} MiB are out of range",
                s.vcpus, s.memory_mib
            )));
        }
        if manifest.template.name != s.template {
            return Err(ApiError::BadRequest(format!(
                "{MANIFEST}: template {:?} and the snapshot's {:?} differ",
                manifest.template.name, s.template
            )));
        }
        let template = self
            .db
            .lock()
            .template(&s.template)
            .map_err(internal)?
            .ok_or_else(|| {
                ApiError::Conflict(format!(
                    "snapshot {id} is of template {:?}, which this node does not have: add it (from the same image) first",
                    s.template
                ))
            })?;
        if let (Some(there), here) = (&manifest.template.image, &template.image) {
            if here.as_ref() != Some(there) {
                return Err(ApiError::Conflict(format!(
                    "snapshot {id}: template {:?} here is {}, the snapshot's was built from {there}",
                    s.template,
                    here.as_deref().map_or("not built from an image".to_string(), |i| format!("from {i}"))
                )));
            }
        }
        let base = base_of(&template)?;
        if base != manifest.template.base {
            let say = |b: &Option<String>| {
                b.as_deref()
                    .map_or("no shared base".to_string(), |u| format!("shared base {u}"))
            };
            return Err(ApiError::Conflict(format!(
                "snapshot {id}: template {:?} has {} here and had {} where the snapshot was taken; a shared base must be the very same file (or build both nodes' templates with `rollbox serve --no-layer-sharing`)",
                s.template,
                say(&base),
                say(&manifest.template.base)
            )));
        }
        if let Some(name) = &name {
            self.name_is_free(name, "snapshot.name")?;
        }
        // Its volumes must be here and the tenant's to mount.
        self.sandboxes.mounts(&s.volumes, tenant.as_deref())?;
        check_files(
            &manifest.files,
            s.memory_mib,
            template.rootfs.is_some(),
            &id,
        )?;
        Ok(Snapshot {
            dir: self.dir.join(&id),
            id,
            name,
            sandbox: s.sandbox.clone(),
            parent: s.parent.clone(),
            template: s.template.clone(),
            vcpus: s.vcpus,
            memory_mib: s.memory_mib,
            created_at_ms: s.created_at_ms,
            expires_at_ms: s.expires_at_ms,
            deterministic: s.deterministic,
            tenant,
            volumes: s.volumes.clone(),
            network: s.network.clone(),
            expose: s.expose.clone(),
        })
    }

    /// The archive's files into `staging`: each one the manifest lists, once, at its size.
    async fn receive<R>(
        &self,
        reader: &mut Reader<R>,
        manifest: &Manifest,
        staging: &Path,
    ) -> Result<(), ApiError>
    where
        R: AsyncRead + Unpin,
    {
        let dir = JailDir::open(staging).map_err(internal)?;
        let owner = self.supervisor.jail_owner();
        let mut seen = BTreeSet::new();
        while let Some(entry) = reader.next().await.map_err(refused)? {
            let listed = manifest
                .files
                .iter()
                .find(|f| f.name == entry.name)
                .ok_or_else(|| {
                    ApiError::BadRequest(format!(
                        "the snapshot archive has {:?}, which its manifest does not list",
                        entry.name
                    ))
                })?;
            if !seen.insert(entry.name.clone()) {
                return Err(ApiError::BadRequest(format!(
                    "the snapshot archive has {:?} twice",
                    entry.name
                )));
            }
            if (entry.size, entry.stored) != (listed.size, listed.stored) {
                return Err(ApiError::BadRequest(format!(
                    "the snapshot archive's {} is {} bytes ({} stored), its manifest says {} ({})",
                    entry.name, entry.size, entry.stored, listed.size, listed.stored
                )));
            }
            let path = staging.join(&entry.name);
            let file = dir
                .create_file(std::ffi::OsStr::new(&entry.name))
                .map_err(internal)?;
            // The jail's user's, as a jailed VMM's own snapshot files are.
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                    .map_err(|e| internal(format!("{}: {e}", path.display())))?;
            }
            let mut file = tokio::fs::File::from_std(file);
            reader
                .copy_to(&entry, &mut file, &path)
                .await
                .map_err(refused)?;
            file.sync_all()
                .await
                .map_err(|e| internal(format!("{}: {e}", path.display())))?;
        }
        if let Some(missing) = manifest.files.iter().find(|f| !seen.contains(&f.name)) {
            return Err(ApiError::BadRequest(format!(
                "the snapshot archive ended without {:?}, which its manifest lists",
                missing.name
            )));
        }
        Ok(())
    }

    /// Makes the staging directory one a jail reads (its group's, as a snapshot directory
    /// is), moves it in place and records the snapshot.
    fn place(&self, staging: &Path, snapshot: &Snapshot) -> Result<(), ApiError> {
        if let Some((_, gid)) = self.supervisor.jail_owner() {
            JailDir::open(staging)
                .and_then(|dir| dir.set_group_mode(gid, 0o750))
                .map_err(internal)?;
        }
        std::fs::rename(staging, &snapshot.dir).map_err(|e| {
            ApiError::Conflict(format!(
                "snapshot {}: {} is taken ({e})",
                snapshot.id,
                snapshot.dir.display()
            ))
        })?;
        if let Err(e) = self.db.lock().add_snapshot(snapshot, false) {
            let _ = remove_dir(&snapshot.dir);
            return Err(internal(e));
        }
        Ok(())
    }
}

/// The answer for a snapshot this node has already: itself (an import run again after a
/// cut connection), unless the id names another snapshot.
fn already_here(existing: Snapshot, imported: &Snapshot) -> Result<Reply, ApiError> {
    let same = (
        &existing.template,
        existing.vcpus,
        existing.memory_mib,
        existing.created_at_ms,
        &existing.tenant,
    ) == (
        &imported.template,
        imported.vcpus,
        imported.memory_mib,
        imported.created_at_ms,
        &imported.tenant,
    );
    if same {
        Ok(Reply::Snapshot {
            created: false,
            snapshot: existing,
        })
    } else {
        Err(ApiError::Conflict(format!(
            "snapshot {} already exists on this node and is another snapshot",
            existing.id
        )))
    }
}

/// The manifest's files: the snapshot's names only, once each, `vmstate` and `memory`
/// always, `rootfs.img` exactly when the template has a disk (`memory.id`, the memory file's
/// identity, when the VMM wrote one), none over its cap.
fn check_files(
    files: &[ManifestFile],
    memory_mib: u32,
    rootfs: bool,
    id: &str,
) -> Result<(), ApiError> {
    let bad = |why: String| ApiError::BadRequest(format!("{MANIFEST}: snapshot {id}: {why}"));
    let mut names = BTreeSet::new();
    for file in files {
        let cap = match file.name.as_str() {
            "vmstate" => MAX_VMSTATE,
            "memory" => u64::from(memory_mib) << 20,
            "memory.id" => MAX_MEMORY_ID,
            "rootfs.img" => MAX_ROOTFS,
            other => return Err(bad(format!("file {other:?} is not a snapshot's"))),
        };
        if !names.insert(file.name.as_str()) {
            return Err(bad(format!("file {:?} is listed twice", file.name)));
        }
        if file.size > cap || file.stored > file.size {
            return Err(bad(format!(
                "file {:?}: {} bytes ({} stored), over its {cap}",
                file.name, file.size, file.stored
            )));
        }
    }
    for (name, wanted) in [("vmstate", true), ("memory", true), ("rootfs.img", rootfs)] {
        if names.contains(name) != wanted {
            return Err(bad(if wanted {
                format!("no {name}")
            } else {
                format!("{name}, but the template here has no disk")
            }));
        }
    }
    Ok(())
}

/// The snapshot directory's files as members, opened now, in [`FILES`] order; anything
/// else there (a symlink, a directory) is an error.
fn open_members(dir: &Path) -> Result<Vec<Member>, ApiError> {
    let mut names: Vec<String> = Vec::new();
    for entry in std::fs::read_dir(dir)
        .map_err(|e| internal(format!("{}: {e}", dir.display())))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !FILES.contains(&name.as_str()) {
            return Err(internal(format!(
                "{}: {name:?} is not a snapshot file",
                dir.display()
            )));
        }
        names.push(name);
    }
    let mut members = Vec::new();
    for name in FILES.iter().filter(|f| names.iter().any(|n| n == *f)) {
        let path: PathBuf = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| internal(format!("{}: {e}", path.display())))?;
        if !file.metadata().map_err(internal)?.is_file() {
            return Err(internal(format!("{} is not a file", path.display())));
        }
        members.push(Member::of_file(name, file, &path).map_err(internal)?);
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, size: u64) -> ManifestFile {
        ManifestFile {
            name: name.into(),
            size,
            stored: size,
        }
    }

    #[test]
    fn a_manifest_lists_the_snapshot_files_once_each_within_their_caps() {
        let ok = [file("vmstate", 100), file("memory", 32 << 20)];
        assert!(check_files(&ok, 32, false, "snap-1").is_ok());
        let with_disk = [
            file("vmstate", 100),
            file("memory", 1 << 20),
            file("rootfs.img", 1 << 30),
        ];
        assert!(check_files(&with_disk, 32, true, "snap-1").is_ok());
        let cases: Vec<(Vec<ManifestFile>, bool, &str)> = vec![
            (vec![file("vmstate", 1)], false, "no memory"),
            (
                vec![file("vmstate", 1), file("memory", 1), file("memory", 1)],
                false,
                "listed twice",
            ),
            (
                vec![file("vmstate", 1), file("memory", (32 << 20) + 1)],
                false,
                "over its",
            ),
            (
                vec![file("vmstate", 1), file("memory", 1), file("../x", 1)],
                false,
                "not a snapshot's",
            ),
            (ok.to_vec(), true, "no rootfs.img"),
            (with_disk.to_vec(), false, "has no disk"),
            (
                vec![
                    file("vmstate", 1),
                    ManifestFile {
                        name: "memory".into(),
                        size: 1,
                        stored: 2,
                    },
                ],
                false,
                "over its",
            ),
        ];
        for (files, rootfs, want) in cases {
            let error = check_files(&files, 32, rootfs, "snap-1")
                .expect_err(want)
                .to_string();
            assert!(error.contains(want), "want {want:?}: {error}");
        }
    }
}
