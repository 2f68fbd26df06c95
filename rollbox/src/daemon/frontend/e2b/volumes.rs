//! E2B volumes on the daemon's own: an E2B volume is a daemon volume, its `volumeID` its
//! name. The control plane's `/volumes` (with `X-API-KEY`), and the volume content API
//! (`/volumecontent/{volumeID}/file|dir|path`), which the SDK sends to `E2B_VOLUME_API_URL`
//! or `https://api.{domain}`: this listener.
//!
//! A content call carries `Authorization: Bearer TOKEN`: the volume's token (an HMAC of the
//! volume's name, creation time and tenant under the daemon's key, given with the volume; it
//! reaches that volume only, as its owner, and a volume made again under the same name gets
//! another) or an API key. Each call is a daemon action run for that caller, which scopes it.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::super::api::{
    self, Action, CreateVolume, FileInfo, FileKind, Reply, Volume, VolumeOp, MAX_UPLOAD,
};
use super::super::super::keys::Caller;
use super::super::transport::{BodyReader, Out};
use super::refusal::Refusal;
use super::state::E2b;
use super::wire::{header, json, no_content, query_pairs, rfc3339};
use crate::daemon::keys::same_secret;

/// The deepest directory listing (`depth`).
const MAX_DEPTH: u32 = 16;
/// The most entries one listing answers.
const MAX_ENTRIES: usize = 100_000;

/// What rollbox answers for the owner and mode parameters it does not serve.
const NO_OWNERS: &str = "not served: rollbox writes volume files as its daemon (files 0644, directories 0755) and sets no owner or mode";

#[derive(Deserialize)]
struct NewVolume {
    name: String,
}

/// `VolumeAndToken`.
fn volume_and_token(e2b: &E2b, volume: &Volume) -> Value {
    json!({
        "volumeID": volume.name,
        "name": volume.name,
        "token": e2b.volume_token(volume),
    })
}

/// A 404 for a volume id that is not a volume name (it cannot exist).
fn not_found(id: &str) -> Refusal {
    Refusal::new(404, format!("volume {id:?} not found"))
}

/// `POST /volumes {name}`: 201 `VolumeAndToken`; 409 when the name is taken.
pub(super) async fn create(
    e2b: &Arc<E2b>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let new: NewVolume = serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, format!("NewVolume: the JSON body is not valid: {e}")))?;
    let name = api::check_volume_name(&new.name, "name")?;
    let create = CreateVolume {
        name,
        host_path: None,
        size_limit_mib: None,
        tenant: None,
    };
    match e2b
        .core
        .handle_as(caller, Action::CreateVolume(create))
        .await?
    {
        Reply::Volume { volume, .. } => Ok(json(201, &volume_and_token(e2b, &volume))),
        other => Err(Refusal::new(500, format!("create answered {other:?}"))),
    }
}

/// `GET /volumes`: `[Volume]`, the ones the key sees.
pub(super) async fn list(e2b: &Arc<E2b>, caller: &Caller) -> Result<Response<Out>, Refusal> {
    match e2b.core.handle_as(caller, Action::ListVolumes).await? {
        Reply::Volumes(volumes) => Ok(json(
            200,
            &Value::Array(
                volumes
                    .iter()
                    .map(|v| json!({ "volumeID": v.name, "name": v.name }))
                    .collect(),
            ),
        )),
        other => Err(Refusal::new(500, format!("list answered {other:?}"))),
    }
}

/// `GET /volumes/{volumeID}`: `VolumeAndToken`.
pub(super) async fn get(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
) -> Result<Response<Out>, Refusal> {
    let name = api::check_volume_name(id, "volumeID").map_err(|_| not_found(id))?;
    let op = VolumeOp::Get;
    match e2b
        .core
        .handle_as(caller, Action::Volume { name, op })
        .await?
    {
        Reply::Volume { volume, .. } => Ok(json(200, &volume_and_token(e2b, &volume))),
        other => Err(Refusal::new(500, format!("get answered {other:?}"))),
    }
}

/// `DELETE /volumes/{volumeID}`: 204; 409 while a live sandbox mounts it.
pub(super) async fn delete(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
) -> Result<Response<Out>, Refusal> {
    let name = api::check_volume_name(id, "volumeID").map_err(|_| not_found(id))?;
    let op = VolumeOp::Delete;
    e2b.core
        .handle_as(caller, Action::Volume { name, op })
        .await?;
    Ok(no_content())
}

/// Who a content call is for: an API key's caller, or the owner of the volume whose token it
/// carries. Nothing of the volume is told to a call without either (401).
async fn content_caller(
    e2b: &E2b,
    request: &Request<Incoming>,
    name: &str,
) -> Result<Caller, Refusal> {
    let given = header(request, "authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| header(request, "x-api-key"))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            Refusal::new(
                401,
                "missing volume token: send `Authorization: Bearer TOKEN` with the token Volume.create or Volume.connect gave (or a rollbox API key)",
            )
        })?;
    if let Some(caller) = e2b.core.authenticate(given) {
        return Ok(caller);
    }
    let refused = || {
        Refusal::new(
            401,
            format!("the bearer token is neither volume {name:?}'s token nor a rollbox API key"),
        )
    };
    let get = Action::Volume {
        name: name.to_string(),
        op: VolumeOp::Get,
    };
    let volume = match e2b.core.handle(get).await {
        Ok(Reply::Volume { volume, .. }) => volume,
        _ => return Err(refused()),
    };
    if !same_secret(given.as_bytes(), e2b.volume_token(&volume).as_bytes()) {
        return Err(refused());
    }
    Ok(match volume.tenant {
        Some(tenant) => Caller::Tenant(tenant),
        None => Caller::Admin,
    })
}

/// `/volumecontent/{volumeID}/{file|dir|path}?path=...`: authenticated here (the control
/// plane's key check does not apply), the body of an upload streamed.
pub(super) async fn content(
    e2b: &Arc<E2b>,
    request: Request<Incoming>,
) -> Result<Response<Out>, Refusal> {
    let method = request.method().as_str().to_string();
    let uri_path = request.uri().path().trim_end_matches('/').to_string();
    let segments: Vec<&str> = uri_path.split('/').filter(|s| !s.is_empty()).collect();
    let ["volumecontent", id, what] = segments.as_slice() else {
        return Err(Refusal::new(
            404,
            format!("no E2B route {method} {uri_path} on rollbox"),
        ));
    };
    let (id, what) = (id.to_string(), what.to_string());
    let name = api::check_volume_name(&id, "volumeID").map_err(|_| not_found(&id))?;
    let caller = content_caller(e2b, &request, &name).await?;
    let pairs = query_pairs(request.uri().query().unwrap_or(""));
    let value = |key: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    let raw = value("path").ok_or_else(|| Refusal::new(400, "path: required"))?;
    let path = api::check_volume_path(raw, "path")?;
    for key in ["uid", "gid", "mode"] {
        if value(key).is_some() {
            return Err(Refusal::new(400, format!("{key}: {NO_OWNERS}")));
        }
    }
    let flag = |key: &str| match value(key) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(Refusal::new(
            400,
            format!("{key}: {other:?} is not true or false"),
        )),
    };
    let volume = Content {
        e2b,
        caller: &caller,
        name: &name,
    };
    match (method.as_str(), what.as_str()) {
        ("GET", "file") => volume.read(path).await,
        ("PUT", "file") => {
            flag("force")?;
            volume.write(path, request).await
        }
        ("GET", "dir") => {
            let depth = match value("depth") {
                None => 1,
                Some(text) => text
                    .parse::<u32>()
                    .ok()
                    .filter(|d| (1..=MAX_DEPTH).contains(d))
                    .ok_or_else(|| {
                        Refusal::new(400, format!("depth: {text:?} is not 1 to {MAX_DEPTH}"))
                    })?,
            };
            volume.list(path, depth).await
        }
        ("POST", "dir") => {
            let parents = flag("force")?;
            let info = volume.file(VolumeOp::MakeDir { path, parents }).await?;
            Ok(json(201, &entry(&info)))
        }
        ("GET", "path") => Ok(json(
            200,
            &entry(&volume.file(VolumeOp::Stat { path }).await?),
        )),
        ("DELETE", "path") => {
            volume.run(VolumeOp::Remove { path }).await?;
            Ok(no_content())
        }
        ("PATCH", "path") => Err(Refusal::new(
            501,
            format!("update_metadata (PATCH /volumecontent/{id}/path) is {NO_OWNERS}"),
        )),
        _ => Err(Refusal::new(
            404,
            format!("no E2B route {method} {uri_path} on rollbox"),
        )),
    }
}

/// One volume's content calls, for one caller.
struct Content<'a> {
    e2b: &'a E2b,
    caller: &'a Caller,
    name: &'a str,
}

impl Content<'_> {
    async fn run(&self, op: VolumeOp) -> Result<Reply, Refusal> {
        let action = Action::Volume {
            name: self.name.to_string(),
            op,
        };
        Ok(self.e2b.core.handle_as(self.caller, action).await?)
    }

    /// An op that answers one entry.
    async fn file(&self, op: VolumeOp) -> Result<FileInfo, Refusal> {
        match self.run(op).await? {
            Reply::File(info) => Ok(info),
            other => Err(Refusal::new(500, format!("answered {other:?}"))),
        }
    }

    /// `GET .../file`: the bytes, streamed.
    async fn read(&self, path: String) -> Result<Response<Out>, Refusal> {
        let shown = format!("/{path}");
        match self.run(VolumeOp::Read { path }).await? {
            Reply::Stream { body, .. } => {
                let mut response = Response::new(Out::Stream(body));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                Ok(response)
            }
            Reply::Files(_) => Err(Refusal::new(
                400,
                format!(
                    "path {shown:?}: a directory (list it with GET /volumecontent/{}/dir)",
                    self.name
                ),
            )),
            other => Err(Refusal::new(500, format!("read answered {other:?}"))),
        }
    }

    /// `PUT .../file`: the body (up to [`MAX_UPLOAD`] bytes) becomes the file, parents made;
    /// 201 with its entry.
    async fn write(
        &self,
        path: String,
        request: Request<Incoming>,
    ) -> Result<Response<Out>, Refusal> {
        if path.is_empty() {
            return Err(Refusal::new(
                400,
                "path: names the volume's root, not a file",
            ));
        }
        let declared =
            header(&request, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_UPLOAD as u64) {
            return Err(Refusal::new(
                413,
                format!("the request body is over {MAX_UPLOAD} bytes"),
            ));
        }
        let body = BodyReader::new(request.into_body(), MAX_UPLOAD);
        self.e2b
            .core
            .volume_upload_as(self.caller, self.name, path.clone(), body)
            .await?;
        let info = self.file(VolumeOp::Stat { path }).await?;
        Ok(json(201, &entry(&info)))
    }

    /// `GET .../dir?depth=N`: the entries below `path`, `depth` levels down, each level
    /// sorted by name and followed by what its directories hold.
    async fn list(&self, path: String, depth: u32) -> Result<Response<Out>, Refusal> {
        let mut entries = Vec::new();
        let mut pending = vec![(path, 1u32)];
        while let Some((dir, level)) = pending.pop() {
            let shown = format!("/{dir}");
            let listed = match self.run(VolumeOp::Read { path: dir }).await? {
                Reply::Files(listed) => listed,
                Reply::Stream { .. } => {
                    return Err(Refusal::new(
                        400,
                        format!(
                        "path {shown:?}: not a directory (read it with GET /volumecontent/{}/file)",
                        self.name
                    ),
                    ))
                }
                other => return Err(Refusal::new(500, format!("list answered {other:?}"))),
            };
            for info in listed.iter().rev() {
                if info.kind == FileKind::Dir && level < depth {
                    // Entries' paths start at the root ("/a"); ops take them relative.
                    pending.push((api::check_volume_path(&info.path, "path")?, level + 1));
                }
            }
            entries.extend(listed.iter().map(entry));
            if entries.len() > MAX_ENTRIES {
                return Err(Refusal::new(
                    400,
                    format!("depth: over {MAX_ENTRIES} entries; list with a smaller depth"),
                ));
            }
        }
        Ok(json(200, &Value::Array(entries)))
    }
}

/// `VolumeEntryStat`: rollbox keeps one time per file, its mtime, given as all three.
fn entry(info: &FileInfo) -> Value {
    let kind = match info.kind {
        FileKind::File => "file",
        FileKind::Dir => "directory",
        FileKind::Symlink => "symlink",
        FileKind::Other => "unknown",
    };
    let time = rfc3339(u64::try_from(info.mtime_ns / 1_000_000).unwrap_or(0));
    let mut value = json!({
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "uid": info.uid,
        "gid": info.gid,
        "atime": time,
        "mtime": time,
        "ctime": time,
    });
    if let Some(target) = &info.link_target {
        value["target"] = json!(target);
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_volume_entry_stats() {
        let info = FileInfo {
            name: "l".into(),
            path: "/a/l".into(),
            kind: FileKind::Symlink,
            size: 3,
            mode: 0o777,
            uid: 0,
            gid: 0,
            mtime_ns: 1_796_091_146_123_000_000,
            link_target: Some("b".into()),
        };
        let value = entry(&info);
        assert_eq!(value["type"], "symlink");
        assert_eq!(value["target"], "b");
        assert_eq!(value["mtime"], "2026-12-01T02:12:26.123Z");
        assert_eq!(value["atime"], value["ctime"]);
        let dir = FileInfo {
            kind: FileKind::Dir,
            link_target: None,
            ..info
        };
        assert_eq!(entry(&dir)["type"], "directory");
        assert!(entry(&dir).get("target").is_none());
    }
}
