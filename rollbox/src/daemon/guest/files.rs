//! Files through the agent: read, write (streamed uploads), remove, stat, list, and tar
//! archives both ways.

use hyper::body::Bytes;
use std::time::Duration;

use rollbox_agent_protocol::client::{ClientError, RawRequest};
use rollbox_agent_protocol::messages::{ClientMessage, ServerMessage, WriteFileRequest};
use tokio::sync::mpsc;

use super::super::api::{ApiError, Chunk, FileOp, Reply};
use super::super::util::internal;
use super::{agent_error, file_info, Guest};

impl Guest {
    /// A file operation without a request body.
    pub async fn file(&self, id: &str, op: FileOp) -> Result<Reply, ApiError> {
        let client = self.agent(id).await?;
        let fail = |e| agent_error(id, e);
        match op {
            FileOp::Stat { path } => Ok(Reply::File(file_info(
                client.stat(&path).await.map_err(fail)?,
            ))),
            FileOp::List { path } => Ok(Reply::Files(
                client
                    .list(&path)
                    .await
                    .map_err(fail)?
                    .into_iter()
                    .map(file_info)
                    .collect(),
            )),
            FileOp::Remove { path, recursive } => {
                client.remove(&path, recursive).await.map_err(fail)?;
                Ok(Reply::NoContent)
            }
            FileOp::Read { path } => {
                let raw = client
                    .open(ClientMessage::ReadFile {
                        path,
                        offset: 0,
                        length: None,
                    })
                    .await
                    .map_err(fail)?;
                download(id, raw, "application/octet-stream", self.timeout).await
            }
            FileOp::TarDownload { path } => {
                let raw = client
                    .open(ClientMessage::TarDownload { path })
                    .await
                    .map_err(fail)?;
                download(id, raw, "application/x-tar", self.timeout).await
            }
            FileOp::Write { .. } | FileOp::TarUpload { .. } => Err(ApiError::Internal(
                "an upload reached the handler without its body".into(),
            )),
        }
    }

    /// An upload: `body` streams into the agent.
    pub async fn upload<R>(&self, id: &str, op: FileOp, body: R) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let client = self.agent(id).await?;
        let (path, bytes) = match op {
            FileOp::Write {
                path,
                mode,
                parents,
                atomic,
                metadata,
                owner,
            } => {
                let mut request = WriteFileRequest::new(path.clone());
                request.mode = mode;
                request.make_parents = parents;
                request.atomic = atomic;
                request.metadata = metadata;
                request.owner = owner;
                let bytes = client.write_file_from(request, body).await;
                (path, bytes)
            }
            FileOp::TarUpload { path } => {
                let bytes = client.tar_upload(&path, body).await;
                (path, bytes)
            }
            other => {
                return Err(internal(format!("{other:?} is not an upload")));
            }
        };
        let bytes = bytes.map_err(|e| agent_error(id, e))?;
        let _ = client.close().await;
        Ok(Reply::Written { path, bytes })
    }
}

/// The next reply of a download, within `limit` (the agent timeout, per frame).
async fn next(
    raw: &mut RawRequest,
    what: &str,
    limit: Duration,
) -> Result<ServerMessage, ClientError> {
    tokio::time::timeout(limit, raw.recv())
        .await
        .unwrap_or_else(|_| {
            Err(ClientError::Timeout {
                what: what.to_owned(),
                after: limit,
            })
        })
}

/// Streams a download; its first reply decides the status (a missing file is a 404). Each
/// reply must come within `limit`.
async fn download(
    id: &str,
    mut raw: RawRequest,
    content_type: &'static str,
    limit: Duration,
) -> Result<Reply, ApiError> {
    let what = match content_type {
        "application/x-tar" => "tar_download",
        _ => "read_file",
    };
    let first = next(&mut raw, what, limit)
        .await
        .map_err(|e| agent_error(id, e))?;
    let (tx, rx) = mpsc::channel::<Chunk>(8);
    tokio::spawn(async move {
        let next_reply = next;
        let mut next = Ok(first);
        let mut received = 0u64;
        loop {
            let chunk = match next {
                Ok(ServerMessage::Data { data, .. }) => {
                    received += data.len() as u64;
                    Ok(Bytes::from(data))
                }
                Ok(ServerMessage::End { bytes }) if bytes == received => return,
                Ok(other) => Err(std::io::Error::other(format!(
                    "the agent broke off the download: {other:?}"
                ))),
                Err(e) => Err(std::io::Error::other(format!(
                    "the agent broke off the download: {e}"
                ))),
            };
            let failed = chunk.is_err();
            if tx.send(chunk).await.is_err() {
                let _ = raw.send(ClientMessage::Cancel).await;
                return;
            }
            if failed {
                return;
            }
            next = next_reply(&mut raw, what, limit).await;
        }
    });
    Ok(Reply::Stream {
        content_type,
        body: rx,
    })
}
