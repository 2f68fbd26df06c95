//! envd's `/files`: downloads and uploads (octet-stream, multipart, gzip; streamed, see
//! multipart.rs), as the user the request names; an upload belongs to that user, as envd's do. Uploads write in place, as envd
//! does (a watch sees the file's own name written), and set the file's metadata from
//! `X-Metadata-<key>` headers (envd 0.6.2).

use std::collections::BTreeMap;

use hyper::body::Incoming;
use hyper::{Request, Response};
use rollbox_agent_protocol::{
    METADATA_MAX_KEY as MAX_METADATA_KEY, METADATA_MAX_VALUE as MAX_METADATA_VALUE,
};
use serde_json::{json, Value};
use tokio::io::AsyncRead;

use super::super::super::api::{Action, BodyTooLarge, FileOp, Reply, MAX_UPLOAD};
use super::super::transport::{BodyReader, Out};
use super::call::{query_value, Call};
use super::multipart::{self, Multipart, MultipartError};
use super::wire::{header, json};

impl Call {
    pub async fn download(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = match self.with_query_user(&query).await {
            Ok(call) => call,
            Err(e) => return files_error(e.code.http_status(), e.message),
        };
        let Some(path) = query_value(&query, "path") else {
            return files_error(400, "path: required".to_string());
        };
        let path = call.resolve(&path);
        let read = Action::File {
            id: self.id().to_string(),
            op: FileOp::Read { path: path.clone() },
        };
        match self.e2b.core.handle(read).await {
            Ok(Reply::Stream { body, .. }) => {
                let mut response = Response::new(Out::Stream(body));
                response.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/octet-stream"),
                );
                response
            }
            Ok(other) => files_error(500, format!("path {path}: the read answered {other:?}")),
            Err(e) => files_error(e.status(), format!("path {path}: {e}")),
        }
    }

    /// An upload, streamed: the body (gunzipped on a blocking thread when it says gzip, split
    /// into its file parts when multipart) goes to the agent as it arrives, at most
    /// [`MAX_UPLOAD`] bytes of it (a 413 past that).
    pub async fn upload(&self, request: Request<Incoming>) -> Response<Out> {
        let query = request.uri().query().unwrap_or("").to_string();
        let call = match self.with_query_user(&query).await {
            Ok(call) => call,
            Err(e) => return files_error(e.code.http_status(), e.message),
        };
        let content_type = header(&request, "content-type").unwrap_or("").to_string();
        let metadata = match metadata_headers(request.headers()) {
            Ok(metadata) => metadata,
            Err(e) => return files_error(400, e),
        };
        let gzip = header(&request, "content-encoding")
            .is_some_and(|e| e.trim().eq_ignore_ascii_case("gzip"));
        let declared =
            header(&request, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > MAX_UPLOAD as u64) {
            return files_error(413, format!("the request body is over {MAX_UPLOAD} bytes"));
        }
        let body = BodyReader::new(request.into_body(), MAX_UPLOAD);
        let source: Source = if gzip {
            Box::new(multipart::gunzip(body, MAX_UPLOAD))
        } else {
            Box::new(body)
        };
        let query_path = query_value(&query, "path").filter(|p| !p.is_empty());
        let upload = Upload {
            call: &call,
            metadata: &metadata,
        };
        if !content_type.starts_with("multipart/form-data") {
            let Some(path) = query_path else {
                return files_error(400, "path: required for an octet-stream upload".into());
            };
            return match upload.write(&path, source).await {
                Ok(info) => json(200, &Value::Array(vec![info])),
                Err(response) => response,
            };
        }
        let boundary = match multipart::boundary(&content_type) {
            Ok(boundary) => boundary,
            Err(e) => return files_error(400, e.to_string()),
        };
        let mut body = Multipart::new(source, &boundary);
        let mut written = Vec::new();
        loop {
            let part = match body.next_part().await {
                Ok(Some(part)) => part,
                Ok(None) => break,
                Err(e) => return files_error(multipart_status(&e), e.to_string()),
            };
            if !part.is_file() {
                continue;
            }
            if written.len() == MAX_FILE_PARTS {
                return files_error(
                    400,
                    format!("multipart: more than {MAX_FILE_PARTS} file parts in one upload"),
                );
            }
            // `?path=` names the file of a one-part upload (the SDK's `write`); parts are
            // written as they come, so a second file part then is an error.
            let path = match (&query_path, part.filename) {
                (Some(path), _) if written.is_empty() => path.clone(),
                (Some(path), _) => {
                    return files_error(
                        400,
                        format!("path: ?path={path} names one file, but the multipart body has more than one file part (drop ?path= to write each part to its filename)"),
                    )
                }
                (None, Some(name)) if !name.is_empty() => name,
                _ => {
                    return files_error(
                        400,
                        "path: a part has no filename and the query no path".to_string(),
                    )
                }
            };
            match upload.write(&path, body.data()).await {
                Ok(info) => written.push(info),
                Err(response) => return response,
            }
        }
        if written.is_empty() {
            return files_error(400, "the multipart body has no file part".into());
        }
        json(200, &Value::Array(written))
    }
}

/// The most file parts one multipart upload may write.
const MAX_FILE_PARTS: usize = 1000;

/// An upload's body: the request's, or its gunzipped bytes.
type Source = Box<dyn AsyncRead + Unpin + Send>;

/// The status of a multipart body that cannot be read: 413 past the upload limit, else 400.
fn multipart_status(error: &MultipartError) -> u16 {
    match error {
        MultipartError::Io(e) if e.get_ref().is_some_and(|inner| inner.is::<BodyTooLarge>()) => 413,
        _ => 400,
    }
}

/// What every file of one upload shares: who writes it and its metadata.
struct Upload<'a> {
    call: &'a Call,
    metadata: &'a BTreeMap<String, String>,
}

impl Upload<'_> {
    /// Streams `data` into the file `path`; its entry, or the error answer.
    async fn write<R>(&self, path: &str, data: R) -> Result<Value, Response<Out>>
    where
        R: AsyncRead + Unpin,
    {
        let path = self.call.resolve(path);
        // Every upload sets the metadata, so an overwrite without any clears the old, and
        // gives the file to the user, as envd does (a watch sees that as `chmod`).
        let op = FileOp::Write {
            path: path.clone(),
            mode: None,
            parents: true,
            atomic: false,
            metadata: Some(self.metadata.clone()),
            owner: self.call.user.clone(),
        };
        if let Err(e) = self.call.e2b.core.upload(self.call.id(), op, data).await {
            return Err(files_error(e.status(), format!("path {path}: {e}")));
        }
        let name = path.rsplit('/').next().unwrap_or("").to_string();
        let mut info = json!({ "path": path, "name": name, "type": "file" });
        if !self.metadata.is_empty() {
            info["metadata"] = json!(self.metadata);
        }
        Ok(info)
    }
}

/// The header that carries one metadata entry: `X-Metadata-<key>: <value>`.
const METADATA_HEADER: &str = "x-metadata-";

/// The file metadata of an upload's `X-Metadata-*` headers, keys lowercased (header names
/// are; an empty key is dropped, a repeated one keeps its first value, as in envd); a bad
/// value or a key too long is named in the error (a 400, InvalidArgumentException).
fn metadata_headers(headers: &hyper::HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut metadata = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        // envd drops an empty key and keeps a repeated header's first value.
        if key.is_empty() || metadata.contains_key(key) {
            continue;
        }
        if key.len() > MAX_METADATA_KEY {
            return Err(format!(
                "header {name}: the metadata key is over {MAX_METADATA_KEY} bytes"
            ));
        }
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                format!("header {name}: the metadata value must be printable US-ASCII")
            })?;
        if value.len() > MAX_METADATA_VALUE {
            return Err(format!(
                "header {name}: the metadata value is over {MAX_METADATA_VALUE} bytes"
            ));
        }
        metadata.insert(key.to_string(), value.to_string());
    }
    Ok(metadata)
}

/// envd's `/files` error body.
fn files_error(status: u16, message: String) -> Response<Out> {
    json(status, &json!({ "code": status, "message": message }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_comes_from_x_metadata_headers() {
        let mut headers = hyper::HeaderMap::new();
        headers.insert("X-Metadata-Owner", "alice".parse().expect("value"));
        headers.insert(
            "x-metadata-content-type",
            "text/plain".parse().expect("value"),
        );
        headers.insert(
            "content-type",
            "application/octet-stream".parse().expect("value"),
        );
        let metadata = metadata_headers(&headers).expect("metadata");
        assert_eq!(
            metadata,
            BTreeMap::from([
                ("content-type".to_string(), "text/plain".to_string()),
                ("owner".to_string(), "alice".to_string()),
            ])
        );
        let mut odd = hyper::HeaderMap::new();
        odd.insert("x-metadata-", "v".parse().expect("value"));
        odd.append("x-metadata-k", "1".parse().expect("value"));
        odd.append("x-metadata-k", "2".parse().expect("value"));
        assert_eq!(
            metadata_headers(&odd).expect("metadata"),
            BTreeMap::from([("k".to_string(), "1".to_string())])
        );
        let mut bad = hyper::HeaderMap::new();
        bad.insert(
            "x-metadata-k",
            hyper::header::HeaderValue::from_bytes(b"caf\xc3\xa9").expect("value"),
        );
        assert!(metadata_headers(&bad)
            .expect_err("not ascii")
            .contains("x-metadata-k"));
    }
}
