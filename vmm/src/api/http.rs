//! The server half of HTTP/1.1 on the API socket: a request reader (request line, headers,
//! Content-Length bodies, keep-alive) and the response writer. The client half is
//! [`vmm_api::Client`].

use std::io::{self, Read, Write};

use vmm_api::{MAX_BODY, MAX_HEAD};

/// Errors reading a request.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The peer closed the connection between requests.
    #[error("connection closed")]
    Closed,
    /// Malformed request.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// Socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

/// A parsed request.
#[derive(Debug)]
pub struct Request {
    /// Method, e.g. `PUT`.
    pub method: String,
    /// Path, e.g. `/actions`.
    pub path: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// Reads requests from one connection, keeping bytes that arrive early.
pub struct RequestReader<R> {
    inner: R,
    buffer: Vec<u8>,
}

impl<R: Read> RequestReader<R> {
    /// Wraps a stream.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buffer: Vec::new(),
        }
    }

    fn fill(&mut self) -> Result<usize, HttpError> {
        let mut chunk = [0u8; 4096];
        let n = self.inner.read(&mut chunk)?;
        self.buffer.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads the next request.
    pub fn next_request(&mut self) -> Result<Request, HttpError> {
        let head_end = loop {
            if let Some(pos) = self.buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break pos;
            }
            if self.buffer.len() > MAX_HEAD {
                return Err(HttpError::Malformed("request head too large".into()));
            }
            if self.fill()? == 0 {
                if self.buffer.is_empty() {
                    return Err(HttpError::Closed);
                }
                return Err(HttpError::Malformed("connection closed mid-request".into()));
            }
        };
        let head = String::from_utf8_lossy(&self.buffer[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let request_line = lines.next().unwrap_or_default();
        let mut parts = request_line.split_whitespace();
        let (Some(method), Some(path), Some(version)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(HttpError::Malformed(format!(
                "bad request line {request_line:?}"
            )));
        };
        if !version.starts_with("HTTP/1.") {
            return Err(HttpError::Malformed(format!(
                "unsupported version {version:?}"
            )));
        }
        let mut content_length = 0usize;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                return Err(HttpError::Malformed(format!("bad header line {line:?}")));
            };
            if name.trim().eq_ignore_ascii_case("content-length") {
                content_length = value.trim().parse().map_err(|_| {
                    HttpError::Malformed(format!("bad Content-Length {:?}", value.trim()))
                })?;
            }
            if name.trim().eq_ignore_ascii_case("transfer-encoding") {
                return Err(HttpError::Malformed(
                    "chunked bodies are not supported; send Content-Length".into(),
                ));
            }
        }
        if content_length > MAX_BODY {
            return Err(HttpError::Malformed(format!(
                "body of {content_length} bytes is too large"
            )));
        }
        let body_start = head_end + 4;
        while self.buffer.len() < body_start + content_length {
            if self.fill()? == 0 {
                return Err(HttpError::Malformed("connection closed mid-body".into()));
            }
        }
        let body = self.buffer[body_start..body_start + content_length].to_vec();
        self.buffer.drain(..body_start + content_length);
        Ok(Request {
            method: method.to_string(),
            path: path.to_string(),
            body,
        })
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        500 => "Internal Server Error",
        _ => "Unknown",
    }
}

/// Writes a response with an optional JSON body.
pub fn write_response(out: &mut impl Write, status: u16, json: Option<&str>) -> io::Result<()> {
    let body = json.unwrap_or("");
    let content_type = if json.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    let response = format!(
        "HTTP/1.1 {status} {}\r\nServer: rollbox-vmm\r\n{content_type}Content-Length: {}\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    out.write_all(response.as_bytes())?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pipelined_requests() {
        let raw = b"PUT /actions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut reader = RequestReader::new(&raw[..]);
        let a = reader.next_request().expect("first");
        assert_eq!(
            (a.method.as_str(), a.path.as_str(), a.body.as_slice()),
            ("PUT", "/actions", &b"{}"[..])
        );
        let b = reader.next_request().expect("second");
        assert_eq!(b.path, "/");
        assert!(matches!(reader.next_request(), Err(HttpError::Closed)));
    }

    #[test]
    fn refuses_garbage() {
        let mut reader = RequestReader::new(&b"hello\r\n\r\n"[..]);
        assert!(matches!(
            reader.next_request(),
            Err(HttpError::Malformed(_))
        ));
    }
}
