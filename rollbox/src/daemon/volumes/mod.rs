//! The volumes service: named shared volumes (a directory each, under `STATE/volumes` or at a
//! host path an admin names), their files read and written from the host (`files.rs`), and
//! the mounts of a sandbox resolved to their directories for the supervisor, which starts a
//! virtiofsd per (sandbox, volume).

mod files;
mod limit;

use std::path::PathBuf;
use std::sync::Arc;

use hyper::body::Bytes;
use tokio::io::AsyncReadExt as _;
use tokio::sync::mpsc;

use super::api::{
    ApiError, BodyTooLarge, Chunk, CreateVolume, Reply, Volume, VolumeMount, VolumeOp, MAX_UPLOAD,
};
use super::store::{Db, VolumeRow};
use super::supervisor::virtiofsd::VolumeSource;
use super::util::{internal, now_ms, remove_dir};
use files::{Found, VolumeFileError, VolumeRoot};

/// How many bytes a streamed read sends at once.
const CHUNK: usize = 256 << 10;

/// The volumes.
pub struct Volumes {
    db: Arc<Db>,
    /// `STATE/volumes`: the directories of volumes made without a host path.
    dir: PathBuf,
    /// `--volume-dir`s (canonical): where an admin's `host_path` may be.
    host_dirs: Vec<PathBuf>,
    /// Who owns the directories it makes (`--volume-uid`, `--volume-gid`); None when the
    /// daemon is not root and cannot give them away.
    owner: Option<(u32, u32)>,
}

/// The answer to a refused or failed file operation: a path that leaves the volume or is of
/// the wrong kind is the caller's (400), a missing one 404, one in the way 409.
fn file_error(name: &str, e: VolumeFileError) -> ApiError {
    let message = format!("volume {name}: {e}");
    match e {
        VolumeFileError::Escapes { .. } | VolumeFileError::Kind { .. } => {
            ApiError::BadRequest(message)
        }
        VolumeFileError::NotFound { .. } => ApiError::NotFound(message),
        VolumeFileError::Exists { .. } => ApiError::Conflict(message),
        VolumeFileError::Full { .. } => ApiError::Conflict(message),
        VolumeFileError::Io { .. } => ApiError::Internal(message),
    }
}

fn no_volume(name: &str) -> ApiError {
    ApiError::NotFound(format!("no volume {name}"))
}

impl Volumes {
    pub fn new(db: Arc<Db>, dir: PathBuf, host_dirs: Vec<PathBuf>, owner: (u32, u32)) -> Volumes {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        Volumes {
            db,
            dir,
            host_dirs,
            owner: root.then_some(owner),
        }
    }

    /// After a start: every size-limited volume's file system is mounted (again, after a
    /// reboot); one that cannot be is logged, and its sandboxes fail to start naming it.
    pub fn remount(&self) {
        let rows = match self.db.lock().volume_rows() {
            Ok(rows) => rows,
            Err(e) => return log::error!("volumes: {e}"),
        };
        for row in rows.iter().filter(|r| r.volume.size_limit_mib.is_some()) {
            if let Err(e) = limit::mount(&row.volume.host_path) {
                log::error!(
                    "volume {}: cannot mount its file system: {e}",
                    row.volume.name
                );
            }
        }
    }

    /// A volume's row, or 404.
    pub fn row(&self, name: &str) -> Result<VolumeRow, ApiError> {
        self.db
            .lock()
            .volume(name)
            .map_err(internal)?
            .ok_or_else(|| no_volume(name))
    }

    /// GET /volumes.
    pub fn list(&self) -> Result<Reply, ApiError> {
        Ok(Reply::Volumes(self.db.lock().volumes().map_err(internal)?))
    }

    /// POST /volumes: records the volume, then makes its directory (under the state dir), or
    /// checks the admin's directory.
    pub async fn create(&self, request: CreateVolume) -> Result<Reply, ApiError> {
        let (host_path, managed) = match &request.host_path {
            Some(path) => {
                let meta = std::fs::metadata(path).map_err(|e| {
                    ApiError::BadRequest(format!("host_path: {}: {e}", path.display()))
                })?;
                if !meta.is_dir() {
                    return Err(ApiError::BadRequest(format!(
                        "host_path: {} is not a directory",
                        path.display()
                    )));
                }
                let path = path.canonicalize().map_err(internal)?;
                if !self.host_dirs.iter().any(|dir| path.starts_with(dir)) {
                    return Err(ApiError::BadRequest(format!(
                        "host_path: {} is not under a --volume-dir of this server ({})",
                        path.display(),
                        if self.host_dirs.is_empty() {
                            "it has none".to_string()
                        } else {
                            self.host_dirs
                                .iter()
                                .map(|d| d.display().to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    )));
                }
                (path, false)
            }
            None => (self.dir.join(&request.name), true),
        };
        let volume = Volume {
            name: request.name.clone(),
            host_path: host_path.clone(),
            created_at_ms: now_ms(),
            tenant: request.tenant,
            size_limit_mib: request.size_limit_mib,
            mounted_by: Vec::new(),
        };
        if !self
            .db
            .lock()
            .add_volume(&volume, managed)
            .map_err(internal)?
        {
            return Err(ApiError::Conflict(format!(
                "volume {} exists (GET /volumes/{})",
                request.name, request.name
            )));
        }
        if let Some(mib) = request.size_limit_mib {
            let (dir, owner) = (host_path.clone(), self.owner);
            let made = tokio::task::spawn_blocking(move || limit::make(&dir, mib, owner))
                .await
                .map_err(internal)?;
            if let Err(e) = made {
                let _ = self.db.lock().remove_volume(&request.name);
                return Err(ApiError::Unavailable(format!(
                    "volume {}: its {mib} MiB file system: {e}",
                    request.name
                )));
            }
        } else if managed {
            // Any guest user may write it (the state dir around it is the daemon's alone); its
            // owner is the one its virtiofsd runs as.
            let made = std::fs::create_dir_all(&host_path).and_then(|()| {
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::set_permissions(&host_path, std::fs::Permissions::from_mode(0o777))?;
                let (uid, gid) = self.owner.unzip();
                std::os::unix::fs::chown(&host_path, uid, gid)
            });
            if let Err(e) = made {
                let _ = self.db.lock().remove_volume(&request.name);
                return Err(ApiError::Internal(format!(
                    "volume {}: {}: {e}",
                    request.name,
                    host_path.display()
                )));
            }
        }
        Ok(Reply::Volume {
            created: true,
            volume,
        })
    }

    /// A route under /volumes/{name} (not the upload).
    pub async fn handle(&self, name: &str, op: VolumeOp) -> Result<Reply, ApiError> {
        match op {
            VolumeOp::Get => Ok(Reply::Volume {
                created: false,
                volume: self.row(name)?.volume,
            }),
            VolumeOp::Delete => self.delete(name).await,
            VolumeOp::Read { path } => self.read(name, path).await,
            VolumeOp::Tar { path } => self.tar(name, path).await,
            VolumeOp::Stat { path } => {
                let root = self.root(name)?;
                let info = root.stat(&path).map_err(|e| file_error(name, e))?;
                Ok(Reply::File(info))
            }
            VolumeOp::MakeDir { path, parents } => {
                let root = self.root(name)?;
                let info = root
                    .make_dir(&path, parents)
                    .map_err(|e| file_error(name, e))?;
                Ok(Reply::File(info))
            }
            VolumeOp::Remove { path } => {
                let root = self.root(name)?;
                let owned = name.to_string();
                tokio::task::spawn_blocking(move || root.remove(&path))
                    .await
                    .map_err(internal)?
                    .map_err(|e| file_error(&owned, e))?;
                Ok(Reply::NoContent)
            }
            VolumeOp::Write { .. } => {
                Err(internal(format!("PUT /volumes/{name}/files is an upload")))
            }
        }
    }

    /// DELETE /volumes/{name}: refused while a template or a live sandbox mounts it; a volume under the
    /// state dir loses its files, an admin's directory is left as it is.
    async fn delete(&self, name: &str) -> Result<Reply, ApiError> {
        let row = self.row(name)?;
        let templates: Vec<String> = self
            .db
            .lock()
            .templates()
            .map_err(internal)?
            .into_iter()
            .filter(|t| t.volumes.iter().any(|v| v.name == name))
            .map(|t| t.name)
            .collect();
        if !templates.is_empty() {
            return Err(ApiError::Conflict(format!(
                "volume {name} is mounted by template {}; remove the template first",
                templates.join(", ")
            )));
        }
        match self.db.lock().remove_volume(name).map_err(internal)? {
            Err(users) => {
                return Err(ApiError::Conflict(format!(
                    "volume {name} is mounted by live sandboxes {}; delete them first",
                    users.join(", ")
                )))
            }
            Ok(false) => return Err(no_volume(name)),
            Ok(true) => {}
        }
        if row.volume.size_limit_mib.is_some() {
            let dir = row.volume.host_path;
            tokio::task::spawn_blocking(move || limit::unmake(&dir))
                .await
                .map_err(internal)?
                .map_err(|e| internal(format!("volume {name}: removing its file system: {e}")))?;
        } else if row.managed {
            let dir = row.volume.host_path;
            tokio::task::spawn_blocking(move || remove_dir(&dir))
                .await
                .map_err(internal)?
                .map_err(|e| internal(format!("volume {name}: removing its files: {e}")))?;
        }
        Ok(Reply::NoContent)
    }

    /// GET .../files: a file's bytes (streamed), or a directory's listing.
    async fn read(&self, name: &str, path: String) -> Result<Reply, ApiError> {
        let root = self.root(name)?;
        let found = root.find(&path).map_err(|e| file_error(name, e))?;
        let file = match found {
            Found::Dir(dir) => {
                return Ok(Reply::Files(dir.list().map_err(|e| file_error(name, e))?))
            }
            Found::File(file) => file,
        };
        let (tx, rx) = mpsc::channel::<Chunk>(8);
        tokio::task::spawn_blocking(move || {
            use std::io::Read as _;
            let mut file = file;
            loop {
                let mut buffer = vec![0u8; CHUNK];
                let chunk = match file.read(&mut buffer) {
                    Ok(0) => return,
                    Ok(n) => {
                        buffer.truncate(n);
                        Ok(Bytes::from(buffer))
                    }
                    Err(e) => Err(e),
                };
                let failed = chunk.is_err();
                if tx.blocking_send(chunk).is_err() || failed {
                    return;
                }
            }
        });
        Ok(Reply::Stream {
            content_type: "application/octet-stream",
            body: rx,
        })
    }

    /// GET .../tar: a directory as a tar stream.
    async fn tar(&self, name: &str, path: String) -> Result<Reply, ApiError> {
        let root = self.root(name)?;
        let Found::Dir(dir) = root.find(&path).map_err(|e| file_error(name, e))? else {
            return Err(ApiError::BadRequest(format!(
                "volume {name}: path {path:?} is a file; tar takes a directory"
            )));
        };
        let (tx, rx) = mpsc::channel::<Chunk>(8);
        tokio::task::spawn_blocking(move || {
            let mut out = ChannelWriter { tx: tx.clone() };
            if let Err(e) = dir.tar(&mut out) {
                let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
            }
        });
        Ok(Reply::Stream {
            content_type: "application/x-tar",
            body: rx,
        })
    }

    /// PUT .../files: the body (up to [`MAX_UPLOAD`]) becomes the file, whole or not at all.
    pub async fn upload<R>(&self, name: &str, path: String, body: R) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let root = self.root(name)?;
        let mut data = Vec::new();
        let mut body = body.take(MAX_UPLOAD as u64 + 1);
        body.read_to_end(&mut data).await.map_err(|e| {
            if e.get_ref().is_some_and(|inner| inner.is::<BodyTooLarge>()) {
                ApiError::TooLarge(MAX_UPLOAD)
            } else {
                ApiError::BadRequest(format!("reading the request body: {e}"))
            }
        })?;
        if data.len() > MAX_UPLOAD {
            return Err(ApiError::TooLarge(MAX_UPLOAD));
        }
        let name_owned = name.to_string();
        let written_path = path.clone();
        let bytes = tokio::task::spawn_blocking(move || root.write(&written_path, &data))
            .await
            .map_err(internal)?
            .map_err(|e| file_error(&name_owned, e))?;
        Ok(Reply::Written {
            path: format!("/{path}"),
            bytes,
        })
    }

    fn root(&self, name: &str) -> Result<VolumeRoot, ApiError> {
        let row = self.row(name)?;
        VolumeRoot::open(&row.volume.host_path).map_err(|e| file_error(name, e))
    }

    /// The directories of a sandbox's mounts, each volume visible to `tenant` (None: an
    /// admin's sandbox, which may mount any).
    pub fn resolve(
        &self,
        mounts: &[VolumeMount],
        tenant: Option<&str>,
    ) -> Result<Vec<VolumeSource>, ApiError> {
        mounts
            .iter()
            .enumerate()
            .map(|(i, mount)| {
                let row = self.db.lock().volume(&mount.name).map_err(internal)?;
                let visible =
                    row.filter(|row| tenant.is_none() || row.volume.tenant.as_deref() == tenant);
                let row = visible.ok_or_else(|| {
                    ApiError::BadRequest(format!(
                        "volumes[{i}].name: no volume {:?} (create it with POST /volumes)",
                        mount.name
                    ))
                })?;
                Ok(VolumeSource {
                    mount: mount.clone(),
                    host_path: row.volume.host_path,
                })
            })
            .collect()
    }
}

/// A blocking writer into a streamed body.
struct ChannelWriter {
    tx: mpsc::Sender<Chunk>,
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
