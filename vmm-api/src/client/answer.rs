//! What a call gets back: a [`Response`], or a [`ClientError`] that names the socket and the
//! call; and the caps on an answer's head and body.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::ErrorBody;

/// Largest head (status line and headers) of a request or an answer.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest body of a request or an answer.
pub const MAX_BODY: usize = 1024 * 1024;

/// A failed call. Each names the socket and the call (`METHOD /path`).
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The method or path would not make one request line.
    #[error("VMM API {}: {call:?}: not a request line: {detail}", .sock.display())]
    BadRequest {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The body could not be written as JSON.
    #[error("VMM API {}: {call}: cannot write the body as JSON: {source}", .sock.display())]
    Encode {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// serde's reason.
        source: serde_json::Error,
    },
    /// Nothing listens on the socket.
    #[error("VMM API {}: {call}: cannot connect: {source}", .sock.display())]
    Connect {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// The connect error.
        source: io::Error,
    },
    /// Sending or receiving failed.
    #[error("VMM API {}: {call}: {source}", .sock.display())]
    Io {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// The socket error.
        source: io::Error,
    },
    /// The call's deadline passed.
    #[error("VMM API {}: {call}: no answer within {timeout:?} (the deadline passed while {stage})", .sock.display())]
    Deadline {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// The deadline the call had.
        timeout: Duration,
        /// What the client was doing then.
        stage: &'static str,
    },
    /// The answer's head did not end within [`MAX_HEAD`] bytes.
    #[error("VMM API {}: {call}: the answer's head is over the {MAX_HEAD}-byte cap", .sock.display())]
    HeadTooLarge {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
    },
    /// The answer's body is (or says it is) over [`MAX_BODY`] bytes.
    #[error("VMM API {}: {call}: the answer's body ({length} bytes) is over the {MAX_BODY}-byte cap", .sock.display())]
    BodyTooLarge {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// Its Content-Length, or what had arrived when the cap was passed.
        length: u64,
    },
    /// The answer is not HTTP/1.x as the client reads it.
    #[error("VMM API {}: {call}: malformed answer: {detail}", .sock.display())]
    Malformed {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The VMM refused the call (a typed call got no 2xx).
    #[error("VMM API {}: {call}: {status} {message}", .sock.display())]
    Refused {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// The HTTP status.
        status: u16,
        /// The answer's `fault_message`, else its body as text.
        message: String,
    },
    /// A 2xx answer whose body is not what the call answers.
    #[error("VMM API {}: {call}: unexpected answer {body:?}: {source}", .sock.display())]
    Decode {
        /// The socket.
        sock: PathBuf,
        /// The call.
        call: String,
        /// The body, as text.
        body: String,
        /// serde's reason.
        source: serde_json::Error,
    },
}

impl ClientError {
    /// The HTTP status of a refusal.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether nothing listened on the socket.
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect { .. })
    }
}

/// One answer, whatever its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
    /// The body (empty for a 204).
    pub body: Vec<u8>,
}

impl Response {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A refusal's `fault_message`, else the body as trimmed text.
    pub fn fault_message(&self) -> String {
        serde_json::from_slice::<ErrorBody>(&self.body)
            .map(|e| e.fault_message)
            .unwrap_or_else(|_| self.text().trim().to_string())
    }
}
