//! envd's `/files`: downloads and uploads (octet-stream, multipart, gzip), as the user the
//! request names; an upload belongs to that user, as envd's do. Uploads write in place, as envd
//! does (a watch sees the file's own name written), and set the file's metadata from
//! `X-Metadata-<key>` headers (envd 0.6.2).

use std::collections::BTreeMap;
use std::io::Read as _;

use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::{
    METADATA_MAX_KEY as MAX_METADATA_KEY, METADATA_MAX_VALUE as MAX_METADATA_VALUE,
};
use serde_json::{json, Value};

use super::super::super::api::{Action, FileOp, Reply, MAX_UPLOAD};
use super::super::transport::Out;
use super::call::{query_value, read_body, Call};
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
        let body = match read_body(request, MAX_UPLOAD).await {
            Ok(body) => body,
            Err(e) if e.contains("over") => return files_error(413, e),
            Err(e) => return files_error(400, e),
        };
        let body = if gzip {
            let mut out = Vec::new();
            let mut decoder = flate2::read::GzDecoder::new(&body[..]).take(MAX_UPLOAD as u64 + 1);
            if let Err(e) = std::io::Read::read_to_end(&mut decoder, &mut out) {
                return files_error(400, format!("the gzip body does not decode: {e}"));
            }
            if out.len() > MAX_UPLOAD {
                return files_error(413, format!("the decoded body is over {MAX_UPLOAD} bytes"));
            }
            Bytes::from(out)
        } else {
            body
        };
        let query_path = query_value(&query, "path").filter(|p| !p.is_empty());
        let files: Vec<(String, Bytes)> = if content_type.starts_with("multipart/form-data") {
            let parts = match multipart(&content_type, &body) {
                Ok(parts) => parts,
                Err(e) => return files_error(400, e),
            };
            let single = parts.len() == 1;
            let mut files = Vec::new();
            for (filename, data) in parts {
                let path = match (&query_path, filename) {
                    (Some(path), _) if single => path.clone(),
                    (_, Some(name)) if !name.is_empty() => name,
                    _ => {
                        return files_error(
                            400,
                            "path: a part has no filename and the query no path".to_string(),
                        )
                    }
                };
                files.push((path, data));
            }
            files
        } else {
            match query_path {
                Some(path) => vec![(path, body)],
                None => {
                    return files_error(400, "path: required for an octet-stream upload".into())
                }
            }
        };
        if files.is_empty() {
            return files_error(400, "the multipart body has no file part".into());
        }
        let mut written = Vec::new();
        for (path, data) in files {
            let path = call.resolve(&path);
            // Every upload sets the metadata, so an overwrite without any clears the old, and
            // gives the file to the user, as envd does (a watch sees that as `chmod`).
            let op = FileOp::Write {
                path: path.clone(),
                mode: None,
                parents: true,
                atomic: false,
                metadata: Some(metadata.clone()),
                owner: call.user.clone(),
            };
            if let Err(e) = self.e2b.core.upload(self.id(), op, &data[..]).await {
                return files_error(e.status(), format!("path {path}: {e}"));
            }
            let name = path.rsplit('/').next().unwrap_or("").to_string();
            let mut info = json!({ "path": path, "name": name, "type": "file" });
            if !metadata.is_empty() {
                info["metadata"] = json!(metadata);
            }
            written.push(info);
        }
        json(200, &Value::Array(written))
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

/// The file parts of a multipart/form-data body: (filename, data).
fn multipart(content_type: &str, body: &[u8]) -> Result<Vec<(Option<String>, Bytes)>, String> {
    let boundary = content_type
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"').to_string())
        .ok_or_else(|| "content-type: multipart without a boundary".to_string())?;
    let delimiter = format!("--{boundary}").into_bytes();
    let mut parts = Vec::new();
    let mut rest = match find(body, &delimiter) {
        Some(at) => &body[at + delimiter.len()..],
        None => return Err("multipart: the body has no boundary line".into()),
    };
    loop {
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        let rest_after_crlf = rest.strip_prefix(b"\r\n").unwrap_or(rest);
        let headers_end = find(rest_after_crlf, b"\r\n\r\n")
            .ok_or_else(|| "multipart: a part's headers do not end".to_string())?;
        let headers = String::from_utf8_lossy(&rest_after_crlf[..headers_end]).to_string();
        let data_start = &rest_after_crlf[headers_end + 4..];
        let mut closing = b"\r\n".to_vec();
        closing.extend_from_slice(&delimiter);
        let data_end = find(data_start, &closing)
            .ok_or_else(|| "multipart: a part does not end with the boundary".to_string())?;
        let data = Bytes::copy_from_slice(&data_start[..data_end]);
        let disposition = headers
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or("");
        let filename = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("filename=")
                .map(|f| f.trim_matches('"').to_string())
        });
        let name = disposition.split(';').find_map(|p| {
            p.trim()
                .strip_prefix("name=")
                .map(|f| f.trim_matches('"').to_string())
        });
        if name.as_deref() == Some("file") || filename.is_some() {
            parts.push((filename, data));
        }
        rest = &data_start[data_end + closing.len()..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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

    #[test]
    fn multipart_parts_keep_full_path_filenames() {
        let body = b"--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/c\"\r\n\r\n\r\n--XY--\r\n";
        let parts = multipart("multipart/form-data; boundary=XY", body).expect("parts");
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0.as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(parts[1].0.as_deref(), Some("rel/c"));
        assert!(parts[1].1.is_empty());
        assert!(multipart("multipart/form-data", body).is_err());
        assert!(multipart("multipart/form-data; boundary=XY", b"--XY\r\nno end").is_err());
    }
}
