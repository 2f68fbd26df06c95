//! A one-connection Unix-socket server for the client's tests.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::thread::JoinHandle;

/// A one-connection server on a socket in a fresh directory: reads one request (head and
/// Content-Length body), hands its bytes to `answer` to reply on the stream, and returns
/// them when joined.
pub(super) struct Server {
    _dir: tempfile::TempDir,
    pub(super) sock: PathBuf,
    pub(super) thread: JoinHandle<Vec<u8>>,
}

pub(super) fn serve(answer: impl FnOnce(&mut UnixStream, &[u8]) + Send + 'static) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let listener = UnixListener::bind(&sock).expect("bind");
    let thread = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let request = read_request(&mut stream);
        answer(&mut stream, &request);
        request
    });
    Server {
        _dir: dir,
        sock,
        thread,
    }
}

fn read_request(stream: &mut UnixStream) -> Vec<u8> {
    let mut request = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&request[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .map_or(0, |v| v.parse().expect("length"));
            if request.len() >= end + 4 + length {
                return request;
            }
        }
        let n = stream.read(&mut chunk).expect("read");
        if n == 0 {
            return request;
        }
        request.extend_from_slice(&chunk[..n]);
    }
}

pub(super) fn reply(text: &'static str) -> impl FnOnce(&mut UnixStream, &[u8]) + Send + 'static {
    move |stream, _| stream.write_all(text.as_bytes()).expect("write")
}

/// What the server read, as text.
pub(super) fn joined(server: Server) -> String {
    String::from_utf8(server.thread.join().expect("server")).expect("utf-8")
}
