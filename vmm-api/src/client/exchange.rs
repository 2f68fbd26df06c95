//! The bytes of one call: connect (`connect.rs`), send the request, read the answer (status line, headers,
//! a Content-Length or close-delimited body), all under the call's one deadline and within
//! [`MAX_HEAD`] and [`MAX_BODY`].

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::answer::{ClientError, Response, MAX_BODY, MAX_HEAD};
use super::connect::{connect_within, ConnectError};

/// One request and its answer on a fresh connection, under one deadline.
pub(super) struct Exchange<'a> {
    sock: &'a Path,
    call: &'a str,
    timeout: Duration,
    /// None: no deadline (the timeout does not fit in an [`Instant`]).
    deadline: Option<Instant>,
}

/// What the client is doing, as a passed deadline names it.
const CONNECTING: &str = "connecting (the VMM's listen backlog stayed full)";
const SENDING: &str = "sending the request";
const READING_HEAD: &str = "reading the answer's head";
const READING_BODY: &str = "reading the answer's body";

impl<'a> Exchange<'a> {
    /// A call to `sock` whose deadline is `timeout` from now.
    pub(super) fn new(sock: &'a Path, call: &'a str, timeout: Duration) -> Self {
        Exchange {
            sock,
            call,
            timeout,
            deadline: Instant::now().checked_add(timeout),
        }
    }

    /// Connects, sends `request` and reads the answer.
    pub(super) fn run(&self, request: &[u8]) -> Result<Response, ClientError> {
        let mut stream = connect_within(self.sock, self.deadline).map_err(|e| match e {
            ConnectError::Deadline => self.deadline_passed(CONNECTING),
            ConnectError::Failed(source) => ClientError::Connect {
                sock: self.sock.to_path_buf(),
                call: self.call.into(),
                source,
            },
        })?;
        let sent = self.send(&mut stream, request);
        if let Err(e @ ClientError::Deadline { .. }) = sent {
            return Err(e);
        }
        // A VMM may answer early (a request over its caps) and close: its answer wins.
        match (sent, self.receive(&mut stream)) {
            (_, Ok(response)) => Ok(response),
            (Err(e), Err(_)) | (Ok(()), Err(e)) => Err(e),
        }
    }

    fn send(&self, stream: &mut UnixStream, mut request: &[u8]) -> Result<(), ClientError> {
        while !request.is_empty() {
            stream
                .set_write_timeout(self.left(SENDING)?)
                .map_err(|e| self.io(e))?;
            match stream.write(request) {
                Ok(0) => return Err(self.io(io::ErrorKind::WriteZero.into())),
                Ok(n) => request = request.get(n..).unwrap_or_default(),
                Err(e) => self.retry_or_fail(e, SENDING)?,
            }
        }
        Ok(())
    }

    fn receive(&self, stream: &mut UnixStream) -> Result<Response, ClientError> {
        let mut answer = Vec::new();
        let head_end = loop {
            if let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at;
            }
            if answer.len() >= MAX_HEAD {
                return Err(self.head_too_large());
            }
            if self.read_some(stream, &mut answer, READING_HEAD)? == 0 {
                return Err(self.malformed(format!(
                    "the connection closed after {} bytes, within the head",
                    answer.len()
                )));
            }
        };
        if head_end + 4 > MAX_HEAD {
            return Err(self.head_too_large());
        }
        let head = String::from_utf8_lossy(answer.get(..head_end).unwrap_or_default()).into_owned();
        let (status, length) = self.parse_head(&head)?;
        let mut body = answer.split_off(head_end + 4);
        // 1xx, 204 and 304 answers have no body, whatever their headers say.
        if matches!(status, 100..=199 | 204 | 304) {
            return Ok(Response {
                status,
                body: Vec::new(),
            });
        }
        match length {
            Some(length) => {
                if length > MAX_BODY as u64 {
                    return Err(self.body_too_large(length));
                }
                let want = length as usize;
                while body.len() < want {
                    if self.read_some(stream, &mut body, READING_BODY)? == 0 {
                        return Err(self.malformed(format!(
                            "the connection closed after {} of {want} body bytes",
                            body.len()
                        )));
                    }
                }
                body.truncate(want);
            }
            // No length: the body ends where the VMM closes the connection.
            None => loop {
                if body.len() > MAX_BODY {
                    return Err(self.body_too_large(body.len() as u64));
                }
                if self.read_some(stream, &mut body, READING_BODY)? == 0 {
                    break;
                }
            },
        }
        Ok(Response { status, body })
    }

    /// The status and the Content-Length (if any) of a head.
    fn parse_head(&self, head: &str) -> Result<(u16, Option<u64>), ClientError> {
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.split_whitespace();
        let status = match (parts.next(), parts.next()) {
            (Some(version), Some(code)) if version.starts_with("HTTP/1.") && code.len() == 3 => {
                code.parse::<u16>().ok().filter(|s| (100..600).contains(s))
            }
            _ => None,
        }
        .ok_or_else(|| self.malformed(format!("bad status line {status_line:?}")))?;
        let mut length = None;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                return Err(self.malformed(format!("bad header line {line:?}")));
            };
            let (name, value) = (name.trim(), value.trim());
            if name.eq_ignore_ascii_case("transfer-encoding") {
                return Err(self.malformed(format!(
                    "Transfer-Encoding {value:?} is not supported (the VMM sends Content-Length)"
                )));
            }
            if name.eq_ignore_ascii_case("content-length") {
                let parsed = value
                    .parse::<u64>()
                    .map_err(|_| self.malformed(format!("bad Content-Length {value:?}")))?;
                if length.is_some_and(|l| l != parsed) {
                    return Err(self.malformed("two different Content-Length headers".into()));
                }
                length = Some(parsed);
            }
        }
        Ok((status, length))
    }

    /// Reads what is there (up to 8 KiB) onto `into`, within the deadline; 0 at the end.
    fn read_some(
        &self,
        stream: &mut UnixStream,
        into: &mut Vec<u8>,
        stage: &'static str,
    ) -> Result<usize, ClientError> {
        let mut chunk = [0u8; 8192];
        loop {
            stream
                .set_read_timeout(self.left(stage)?)
                .map_err(|e| self.io(e))?;
            match stream.read(&mut chunk) {
                Ok(n) => {
                    into.extend_from_slice(chunk.get(..n).unwrap_or_default());
                    return Ok(n);
                }
                Err(e) => self.retry_or_fail(e, stage)?,
            }
        }
    }

    /// Time left before the deadline (None: no deadline), or the deadline's error.
    fn left(&self, stage: &'static str) -> Result<Option<Duration>, ClientError> {
        let Some(deadline) = self.deadline else {
            return Ok(None);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.deadline_passed(stage));
        }
        Ok(Some(left))
    }

    fn deadline_passed(&self, stage: &'static str) -> ClientError {
        ClientError::Deadline {
            sock: self.sock.to_path_buf(),
            call: self.call.into(),
            timeout: self.timeout,
            stage,
        }
    }

    /// Ok for an interrupted call (try again); a timed-out one is the deadline's error.
    fn retry_or_fail(&self, e: io::Error, stage: &'static str) -> Result<(), ClientError> {
        match e.kind() {
            io::ErrorKind::Interrupted => Ok(()),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                // A socket timeout ends just about at the deadline: name it as that.
                self.left(stage)?;
                Ok(())
            }
            _ => Err(self.io(e)),
        }
    }

    fn io(&self, source: io::Error) -> ClientError {
        ClientError::Io {
            sock: self.sock.to_path_buf(),
            call: self.call.into(),
            source,
        }
    }

    fn malformed(&self, detail: String) -> ClientError {
        ClientError::Malformed {
            sock: self.sock.to_path_buf(),
            call: self.call.into(),
            detail,
        }
    }

    fn head_too_large(&self) -> ClientError {
        ClientError::HeadTooLarge {
            sock: self.sock.to_path_buf(),
            call: self.call.into(),
        }
    }

    fn body_too_large(&self, length: u64) -> ClientError {
        ClientError::BodyTooLarge {
            sock: self.sock.to_path_buf(),
            call: self.call.into(),
            length,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::super::test_server::{reply, serve};
    use super::super::Client;
    use super::*;

    #[test]
    fn one_deadline_covers_the_whole_answer() {
        // A byte every 50 ms: each read is quick, the call is not.
        let server = serve(|stream, _| {
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}" {
                if stream.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let started = Instant::now();
        let err = Client::new(&server.sock)
            .with_timeout(Duration::from_millis(300))
            .vm_info()
            .expect_err("too slow");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert!(
            matches!(err, ClientError::Deadline { stage, .. } if stage == READING_HEAD),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("api.sock: GET /: no answer within 300ms"),
            "{err}"
        );
        let _ = server.thread.join();
    }

    #[test]
    fn a_silent_server_runs_into_the_deadline() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let server = serve(move |_, _| {
            let _ = rx.recv();
        });
        let err = Client::new(&server.sock)
            .with_timeout(Duration::from_millis(100))
            .machine_config()
            .expect_err("no answer");
        assert!(matches!(err, ClientError::Deadline { .. }), "{err}");
        drop(tx);
        let _ = server.thread.join();
    }

    #[test]
    fn answers_over_the_caps_are_refused() {
        let server = serve(|stream, _| {
            let head = format!("HTTP/1.1 200 OK\r\nX-Pad: {}\r\n\r\n", "a".repeat(MAX_HEAD));
            let _ = stream.write_all(head.as_bytes());
        });
        let err = Client::new(&server.sock).vm_info().expect_err("head cap");
        assert!(matches!(err, ClientError::HeadTooLarge { .. }), "{err}");
        let _ = server.thread.join();

        let server = serve(reply("HTTP/1.1 200 OK\r\nContent-Length: 1048577\r\n\r\n"));
        let err = Client::new(&server.sock).vm_info().expect_err("body cap");
        assert!(
            matches!(
                err,
                ClientError::BodyTooLarge {
                    length: 1048577,
                    ..
                }
            ),
            "{err}"
        );
        let _ = server.thread.join();

        // Without a length, the body ends at the close, and the cap still holds.
        let server = serve(|stream, _| {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let _ = stream.write_all(&vec![b' '; MAX_BODY + 1]);
        });
        let err = Client::new(&server.sock).vm_info().expect_err("body cap");
        assert!(matches!(err, ClientError::BodyTooLarge { .. }), "{err}");
        let _ = server.thread.join();
    }

    #[test]
    fn malformed_answers_are_named() {
        for (answer, detail) in [
            ("hello\r\n\r\n", "bad status line \"hello\""),
            ("HTTP/1.1 20 OK\r\n\r\n", "bad status line"),
            (
                "HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                "bad header line \"no colon\"",
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
                "bad Content-Length \"x\"",
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                "Transfer-Encoding \"chunked\" is not supported",
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",
                "closed after 2 of 10 body bytes",
            ),
            (
                "HTTP/1.1 200 OK\r\n",
                "closed after 17 bytes, within the head",
            ),
        ] {
            let server = serve(reply(answer));
            let err = Client::new(&server.sock).vm_info().expect_err(answer);
            assert!(
                matches!(&err, ClientError::Malformed { detail: d, .. } if d.contains(detail)),
                "{answer:?}: {err}"
            );
            let _ = server.thread.join();
        }
        // A 2xx whose body is not the answer's type.
        let server = serve(reply("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]"));
        let err = Client::new(&server.sock).vm_info().expect_err("decode");
        assert!(matches!(err, ClientError::Decode { .. }), "{err}");
        let _ = server.thread.join();
    }

    #[test]
    fn endless_headers_and_bodies_stop_at_the_caps_without_the_server_closing() {
        // Servers that never stop writing: the client stops at the cap, well before its
        // deadline, holding about the cap in memory, and says which cap.
        let endless_head = serve(|stream, _| {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n");
            while stream.write_all(b"X-More: aaaaaaaaaaaaaaaa\r\n").is_ok() {}
        });
        let started = Instant::now();
        let err = Client::new(&endless_head.sock)
            .with_timeout(Duration::from_secs(20))
            .vm_info()
            .expect_err("endless head");
        assert!(matches!(err, ClientError::HeadTooLarge { .. }), "{err}");
        assert!(err.to_string().contains("16384-byte cap"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let _ = endless_head.thread.join();

        let endless_body = serve(|stream, _| {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let chunk = vec![b' '; 65536];
            while stream.write_all(&chunk).is_ok() {}
        });
        let started = Instant::now();
        let err = Client::new(&endless_body.sock)
            .with_timeout(Duration::from_secs(20))
            .vm_info()
            .expect_err("endless body");
        assert!(
            matches!(err, ClientError::BodyTooLarge { length, .. } if length <= (MAX_BODY + 8192) as u64),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let _ = endless_body.thread.join();
    }
}
