//! A small blocking HTTP/1.1 client over a Unix socket or TCP: the CLI (and the daemon's
//! tests) use it to talk to the daemon. The daemon talks to a VMM with `vmm_api::Client`.

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
        let body = body.unwrap_or(b"");
        let mut all = headers.to_vec();
        if !body.is_empty() {
            all.push(("Content-Type", "application/json"));
        }
        let mut source: &[u8] = body;
        let len = body.len() as u64;
        self.open(method, path, &all, Some((&mut source, len)), timeout)?
            .into_response()
    }

    /// Sends one request with `key` as its bearer key and `body`, if any, as its JSON body
    /// (the daemon's API), and reads the whole response.
    pub fn request_json(
        &self,
        method: &str,
        path: &str,
        key: &str,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let auth = format!("Bearer {key}");
        let body = body.map(serde_json::Value::to_string);
        self.request(
            method,
            path,
            &[("Authorization", &auth)],
            body.as_deref().map(str::as_bytes),
            timeout,
        )
    }

    /// Sends one request whose body (of the given length) comes from a reader, and returns
    /// the response with its body still to read (chunked bodies are decoded).
    pub fn open(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<(&mut dyn Read, u64)>,
        timeout: Duration,
    ) -> Result<Streaming, ClientError> {
        let endpoint = self.to_string();
        let io = |source| ClientError::Io {
            endpoint: endpoint.clone(),
            source,
        };
        let connect = |source| ClientError::Connect {
            endpoint: endpoint.clone(),
            source,
        };
        let stream: Box<dyn Stream> = match self {
            Endpoint::Unix(path) => {
                let s = std::os::unix::net::UnixStream::connect(path).map_err(connect)?;
                s.set_read_timeout(Some(timeout)).map_err(io)?;
                s.set_write_timeout(Some(timeout)).map_err(io)?;
                Box::new(s)
            }
            Endpoint::Tcp(addr) => {
                let s = std::net::TcpStream::connect(addr).map_err(connect)?;
                // A request goes out as head then body: no waiting for a delayed ACK between.
                s.set_nodelay(true).map_err(io)?;
                s.set_read_timeout(Some(timeout)).map_err(io)?;
                s.set_write_timeout(Some(timeout)).map_err(io)?;
                Box::new(s)
            }
        };
        exchange(stream, endpoint, method, path, headers, body)
    }
}

/// One request (`Connection: close`) on a connection the caller opened itself (a TLS stream to
/// another service, say): the response with its body still to read (chunked bodies are
/// decoded); `peer` names the other end in errors. The headers go as given (no `Content-Type`
/// is added).
pub fn request_on(
    stream: impl Read + Write + 'static,
    peer: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Streaming, ClientError> {
    let mut source: &[u8] = body;
    let len = body.len() as u64;
    exchange(
        Box::new(stream),
        peer.to_string(),
        method,
        path,
        headers,
        Some((&mut source, len)),
    )
}

/// Writes the request's head and body on `stream` and reads the response's head.
fn exchange(
    mut stream: Box<dyn Stream>,
    endpoint: String,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&mut dyn Read, u64)>,
) -> Result<Streaming, ClientError> {
    let io = |source| ClientError::Io {
        endpoint: endpoint.clone(),
        source,
    };
    let length = body.as_ref().map_or(0, |(_, len)| *len);
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {length}\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let written = stream.write_all(head.as_bytes()).and_then(|()| {
        if let Some((source, len)) = body {
            let copied = std::io::copy(&mut source.take(len), &mut stream)?;
            if copied != len {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the request body ended after {copied} of {len} bytes"),
                ));
            }
        }
        stream.flush()
    });
    let response = read_head(stream);
    // A server may answer early (a body over its limit) and close: its answer wins.
    if let (Err(e), Err(_)) = (written, &response) {
        return Err(io(e));
    }
    let mut response = response.map_err(|e| match e {
        ReadError::Io(source) => io(source),
        ReadError::Bad(message) => ClientError::BadResponse {
            endpoint: endpoint.clone(),
            message,
        },
    })?;
    response.endpoint = endpoint;
    Ok(response)
}

/// A connection a `101 Switching Protocols` answer handed over: its bytes are the upgraded
/// protocol's.
#[derive(Debug)]
pub enum Upgraded {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

impl Upgraded {
    /// Another handle on the same connection (to read and write from two threads).
    pub fn try_clone(&self) -> std::io::Result<Upgraded> {
        Ok(match self {
            Upgraded::Unix(s) => Upgraded::Unix(s.try_clone()?),
            Upgraded::Tcp(s) => Upgraded::Tcp(s.try_clone()?),
        })
    }

    /// Ends what this side sends; the other side still sends until it is done.
    pub fn shutdown_write(&self) -> std::io::Result<()> {
        match self {
            Upgraded::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Upgraded::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        }
    }
}

impl Read for Upgraded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Upgraded::Unix(s) => s.read(buf),
            Upgraded::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Upgraded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Upgraded::Unix(s) => s.write(buf),
            Upgraded::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Upgraded::Unix(s) => s.flush(),
            Upgraded::Tcp(s) => s.flush(),
        }
    }
}

/// Longest response head an upgrade reads.
const MAX_UPGRADE_HEAD: usize = 16 << 10;

impl Endpoint {
    /// `GET path` asking to upgrade the connection to `protocol`: the connection on a 101,
    /// else the refusal (read whole: its body has a length, as the daemon's errors do).
    pub fn upgrade(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        protocol: &str,
        timeout: Duration,
    ) -> Result<Result<Upgraded, Response>, ClientError> {
        let endpoint = self.to_string();
        let io = |source| ClientError::Io {
            endpoint: endpoint.clone(),
            source,
        };
        let connect = |source| ClientError::Connect {
            endpoint: endpoint.clone(),
            source,
        };
        let mut stream = match self {
            Endpoint::Unix(path) => {
                Upgraded::Unix(std::os::unix::net::UnixStream::connect(path).map_err(connect)?)
            }
            Endpoint::Tcp(addr) => {
                let s = std::net::TcpStream::connect(addr).map_err(connect)?;
                // Interactive traffic: keystrokes must not wait for a delayed ACK.
                s.set_nodelay(true).map_err(connect)?;
                Upgraded::Tcp(s)
            }
        };
        let set_timeout = |stream: &Upgraded, timeout| match stream {
            Upgraded::Unix(s) => s.set_read_timeout(timeout),
            Upgraded::Tcp(s) => s.set_read_timeout(timeout),
        };
        set_timeout(&stream, Some(timeout)).map_err(io)?;
        let mut head = format!(
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n"
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).map_err(io)?;
        // Byte by byte up to the blank line: what follows a 101 is the new protocol's.
        let mut answer = Vec::new();
        let mut byte = [0u8; 1];
        while !answer.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).map_err(io)? == 0 {
                return Err(ClientError::BadResponse {
                    endpoint: endpoint.clone(),
                    message: "connection closed before the headers ended".into(),
                });
            }
            answer.push(byte[0]);
            if answer.len() > MAX_UPGRADE_HEAD {
                return Err(ClientError::BadResponse {
                    endpoint: endpoint.clone(),
                    message: format!("response head over {MAX_UPGRADE_HEAD} bytes"),
                });
            }
        }
        let response = read_head(Box::new(std::io::Cursor::new(answer))).map_err(|e| match e {
            ReadError::Io(source) => io(source),
            ReadError::Bad(message) => ClientError::BadResponse {
                endpoint: endpoint.clone(),
                message,
            },
        })?;
        if response.status == 101 {
            set_timeout(&stream, None).map_err(io)?;
            return Ok(Ok(stream));
        }
        // The head was read alone: the body (by its length) is still on the connection.
        let length = response
            .headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .unwrap_or(0);
        let mut body = Vec::new();
        (&mut stream)
            .take(length)
            .read_to_end(&mut body)
            .map_err(io)?;
        Ok(Err(Response {
            status: response.status,
            headers: response.headers,
            body,
        }))
    }
}

/// A response whose body is read as it comes.
pub struct Streaming {
    pub status: u16,
    /// Header names in lowercase.
    pub headers: Vec<(String, String)>,
    pub endpoint: String,
    body: Box<dyn Read>,
}

impl Read for Streaming {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.body.read(buf)
    }
}

impl Streaming {
    /// Reads the rest of the body.
    pub fn into_response(mut self) -> Result<Response, ClientError> {
        let mut body = Vec::new();
        self.body
            .read_to_end(&mut body)
            .map_err(|e| ClientError::BadResponse {
                endpoint: self.endpoint.clone(),
                message: format!("reading the body: {e}"),
            })?;
        Ok(Response {
            status: self.status,
            headers: self.headers,
            body,
        })
    }
}

enum ReadError {
    Io(std::io::Error),
    Bad(String),
}

/// Reads the status line and headers; the body follows, framed by its length or chunked.
fn read_head(mut stream: Box<dyn Stream>) -> Result<Streaming, ReadError> {
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
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let rest = std::io::Cursor::new(buf[head_end + 4..].to_vec()).chain(stream);
    let body: Box<dyn Read> =
        if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            Box::new(Chunked {
                inner: std::io::BufReader::new(rest),
                left: 0,
                done: false,
            })
        } else if let Some(length) = header("content-length").and_then(|v| v.parse::<u64>().ok()) {
            Box::new(Exact {
                inner: rest.take(length),
                left: length,
            })
        } else {
            Box::new(rest)
        };
    Ok(Streaming {
        status,
        headers,
        endpoint: String::new(),
        body,
    })
}

/// A body of a known length: ending early is an error.
struct Exact<R> {
    inner: std::io::Take<R>,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.left -= n as u64;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed mid-body",
            ));
        }
        Ok(n)
    }
}

/// A chunked body, decoded; a body without its final chunk is an error.
struct Chunked<R> {
    inner: std::io::BufReader<R>,
    left: u64,
    done: bool,
}

impl<R: Read> Chunked<R> {
    fn line(&mut self) -> std::io::Result<String> {
        use std::io::BufRead;
        let mut line = String::new();
        if self.inner.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the chunked body ended without its last chunk (the server broke it off)",
            ));
        }
        Ok(line.trim_end().to_string())
    }
}

impl<R: Read> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let line = self.line()?;
            let size = line.split(';').next().unwrap_or("").trim();
            self.left = u64::from_str_radix(size, 16).map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("bad chunk size {line:?}"),
                )
            })?;
            if self.left == 0 {
                // Trailers, up to the empty line.
                while !self.line()?.is_empty() {}
                self.done = true;
                return Ok(0);
            }
        }
        let want = usize::try_from(self.left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed mid-chunk",
            ));
        }
        self.left -= n as u64;
        if self.left == 0 {
            self.line()?;
        }
        Ok(n)
    }
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
        let data = std::io::Cursor::new(
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nRetry-After: 1\r\n\r\n{}extra".to_vec(),
        );
        let response = read_head(Box::new(data))
            .ok()
            .expect("head")
            .into_response()
            .expect("response");
        assert_eq!(response.status, 201);
        assert_eq!(response.body, b"{}");
        assert_eq!(response.header("retry-after"), Some("1"));
    }

    #[test]
    fn decodes_a_chunked_body_and_notices_a_broken_one() {
        let whole = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        let response = read_head(Box::new(std::io::Cursor::new(whole.to_vec())))
            .ok()
            .expect("head")
            .into_response()
            .expect("response");
        assert_eq!(response.body, b"abcde");
        let broken = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n";
        let result = read_head(Box::new(std::io::Cursor::new(broken.to_vec())))
            .ok()
            .expect("head")
            .into_response();
        assert!(result.is_err());
    }
}
