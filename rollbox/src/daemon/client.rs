//! A small blocking HTTP/1.1 client over a Unix socket or TCP: the CLI uses it to talk to the
//! daemon, and the daemon to talk to a VMM's API socket.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

/// A failed request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("{endpoint}: {source}")]
    Io {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("{endpoint}: bad HTTP response: {message}")]
    BadResponse { endpoint: String, message: String },
    #[error("bad URL {0:?}: expected http://HOST:PORT")]
    BadUrl(String),
}

impl ClientError {
    /// Whether nothing listens where the request went.
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect { .. })
    }
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// HOST:PORT
    Tcp(String),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
            Endpoint::Tcp(addr) => write!(f, "http://{addr}"),
        }
    }
}

/// One response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names in lowercase.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body's `error` field, else the body as text.
    pub fn error_message(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).trim().to_string())
    }
}

trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

impl Endpoint {
    /// `http://HOST:PORT` (a trailing `/` is allowed).
    pub fn from_url(url: &str) -> Result<Endpoint, ClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| ClientError::BadUrl(url.to_string()))?
            .trim_end_matches('/');
        if rest.is_empty() || rest.contains('/') || !rest.contains(':') {
            return Err(ClientError::BadUrl(url.to_string()));
        }
        Ok(Endpoint::Tcp(rest.to_string()))
    }

    /// Sends one request (`Connection: close`) and reads the whole response.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let endpoint = self.to_string();
        let io = |source| ClientError::Io {
            endpoint: endpoint.clone(),
            source,
        };
        let connect = |source| ClientError::Connect {
            endpoint: endpoint.clone(),
            source,
        };
        let mut stream: Box<dyn Stream> = match self {
            Endpoint::Unix(path) => {
                let s = std::os::unix::net::UnixStream::connect(path).map_err(connect)?;
                s.set_read_timeout(Some(timeout)).map_err(io)?;
                s.set_write_timeout(Some(timeout)).map_err(io)?;
                Box::new(s)
            }
            Endpoint::Tcp(addr) => {
                let s = std::net::TcpStream::connect(addr).map_err(connect)?;
                s.set_read_timeout(Some(timeout)).map_err(io)?;
                s.set_write_timeout(Some(timeout)).map_err(io)?;
                Box::new(s)
            }
        };
        let body = body.unwrap_or(b"");
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if !body.is_empty() {
            head.push_str("Content-Type: application/json\r\n");
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let written = stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(body))
            .and_then(|()| stream.flush());
        let response = read_response(&mut stream);
        // A server may answer early (a body over its limit) and close: its answer wins.
        if let (Err(e), Err(_)) = (written, &response) {
            return Err(io(e));
        }
        response.map_err(|e| match e {
            ReadError::Io(source) => io(source),
            ReadError::Bad(message) => ClientError::BadResponse {
                endpoint: endpoint.clone(),
                message,
            },
        })
    }
}

enum ReadError {
    Io(std::io::Error),
    Bad(String),
}

fn read_response(stream: &mut dyn Stream) -> Result<Response, ReadError> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = stream.read(&mut chunk).map_err(ReadError::Io)?;
        if n == 0 {
            return Err(ReadError::Bad(
                "connection closed before the headers ended".into(),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| ReadError::Bad(format!("bad status line in {head:?}")))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let length = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok());
    let mut body = buf[head_end + 4..].to_vec();
    match length {
        Some(length) => {
            while body.len() < length {
                let n = stream.read(&mut chunk).map_err(ReadError::Io)?;
                if n == 0 {
                    return Err(ReadError::Bad("connection closed mid-body".into()));
                }
                body.extend_from_slice(&chunk[..n]);
            }
            body.truncate(length);
        }
        None => {
            stream.read_to_end(&mut body).map_err(ReadError::Io)?;
        }
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            Endpoint::from_url("http://127.0.0.1:7070/").expect("url"),
            Endpoint::Tcp("127.0.0.1:7070".into())
        );
        for bad in ["127.0.0.1:1", "https://h:1", "http://h", "http://h:1/x"] {
            assert!(Endpoint::from_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn reads_a_response_with_a_length() {
        let mut data = std::io::Cursor::new(
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nRetry-After: 1\r\n\r\n{}extra".to_vec(),
        );
        let response = read_response(&mut data).ok().expect("response");
        assert_eq!(response.status, 201);
        assert_eq!(response.body, b"{}");
        assert_eq!(response.header("retry-after"), Some("1"));
    }
}
