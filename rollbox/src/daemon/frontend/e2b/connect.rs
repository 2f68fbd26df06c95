//! The Connect protocol's JSON codec as envd speaks it: unary calls are plain JSON bodies;
//! streams are 5-byte envelopes (flag byte, big-endian u32 length) of JSON, the last one
//! flagged [`END_STREAM`] and carrying `{}` or `{"error":{code,message}}`.

use serde_json::{json, Value};

/// Envelope flag of the end-of-stream message.
pub const END_STREAM: u8 = 0x02;
/// Envelope flag of a compressed message (never sent; refused when received).
const COMPRESSED: u8 = 0x01;

/// A request envelope that cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("the request body is {0} bytes, shorter than a 5-byte Connect envelope header")]
    Short(usize),
    #[error("the Connect envelope says {declared} bytes but {present} follow")]
    Length { declared: usize, present: usize },
    #[error(
        "compressed Connect envelopes are not supported (send connect-content-encoding: identity)"
    )]
    Compressed,
}

/// One envelope around `payload`.
pub fn envelope(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 5);
    out.push(flag);
    out.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(payload);
    out
}

/// A message envelope holding `value`.
pub fn message(value: &Value) -> Vec<u8> {
    envelope(0, value.to_string().as_bytes())
}

/// The end-of-stream envelope: success, or an error with a Connect code.
pub fn end_stream(error: Option<&RpcError>) -> Vec<u8> {
    let body = match error {
        None => json!({}),
        Some(e) => json!({ "error": { "code": e.code.as_str(), "message": e.message } }),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

/// The first message of a streaming request body (the server-streaming calls send one).
pub fn first_message(body: &[u8]) -> Result<&[u8], EnvelopeError> {
    let Some(header) = body.get(..5) else {
        return Err(EnvelopeError::Short(body.len()));
    };
    if header[0] & COMPRESSED != 0 {
        return Err(EnvelopeError::Compressed);
    }
    let declared = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let rest = &body[5..];
    rest.get(..declared).ok_or(EnvelopeError::Length {
        declared,
        present: rest.len(),
    })
}

/// One whole envelope of a client stream.
#[derive(Debug, PartialEq, Eq)]
pub struct Envelope<'a> {
    pub flag: u8,
    pub payload: &'a [u8],
    /// Bytes it took of the buffer, header included.
    pub taken: usize,
}

/// The first whole envelope of a client stream's `buffer`; `None` while it is incomplete.
pub fn next_envelope(buffer: &[u8]) -> Result<Option<Envelope<'_>>, EnvelopeError> {
    let Some(header) = buffer.get(..5) else {
        return Ok(None);
    };
    if header[0] & COMPRESSED != 0 {
        return Err(EnvelopeError::Compressed);
    }
    let declared = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    Ok(buffer.get(5..5 + declared).map(|payload| Envelope {
        flag: header[0],
        payload,
        taken: 5 + declared,
    }))
}

/// Connect error codes envd answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    Unimplemented,
    Unavailable,
    Internal,
    DeadlineExceeded,
    FailedPrecondition,
    ResourceExhausted,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::Unauthenticated => "unauthenticated",
            Code::Unimplemented => "unimplemented",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::FailedPrecondition => "failed_precondition",
            Code::ResourceExhausted => "resource_exhausted",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's mapping).
    pub fn http_status(self) -> u16 {
        match self {
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::Unauthenticated => 401,
            Code::PermissionDenied => 403,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::DeadlineExceeded => 504,
            Code::ResourceExhausted => 429,
            Code::Internal => 500,
        }
    }
}

/// A failed RPC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// The unary error body.
    pub fn body(&self) -> Value {
        json!({ "code": self.code.as_str(), "message": self.message })
    }
}

/// A `connect-timeout-ms` value: SDK 1.x sends floats such as `1500.0`; 0 or none is no limit.
pub fn timeout_ms(header: Option<&str>) -> Option<u64> {
    let ms = header?.trim().parse::<f64>().ok()?;
    (ms.is_finite() && ms >= 1.0).then_some(ms as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_refuse_bad_ones() {
        let framed = message(&json!({"a": 1}));
        assert_eq!(&framed[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(first_message(&framed), Ok(&br#"{"a":1}"#[..]));
        assert_eq!(first_message(&[0, 0]), Err(EnvelopeError::Short(2)));
        assert_eq!(
            first_message(&[0, 0, 0, 0, 9, b'{']),
            Err(EnvelopeError::Length {
                declared: 9,
                present: 1
            })
        );
        assert_eq!(
            first_message(&[1, 0, 0, 0, 0]),
            Err(EnvelopeError::Compressed)
        );
        let end = end_stream(Some(&RpcError::new(Code::NotFound, "no process 7")));
        assert_eq!(end[0], END_STREAM);
        let body: Value = serde_json::from_slice(&end[5..]).expect("json");
        assert_eq!(body["error"]["code"], "not_found");
        assert_eq!(&end_stream(None)[5..], b"{}");
    }

    #[test]
    fn client_stream_envelopes_come_out_whole() {
        let mut stream = message(&json!({"start": {}}));
        stream.extend_from_slice(&message(&json!({"keepalive": {}}))[..4]);
        let first = next_envelope(&stream).expect("ok").expect("one whole");
        assert_eq!((first.flag, first.payload), (0, &br#"{"start":{}}"#[..]));
        assert_eq!(next_envelope(&stream[first.taken..]), Ok(None));
        assert_eq!(
            next_envelope(&[1, 0, 0, 0, 0]),
            Err(EnvelopeError::Compressed)
        );
    }

    #[test]
    fn timeouts_parse_leniently() {
        assert_eq!(timeout_ms(Some("60000")), Some(60000));
        assert_eq!(timeout_ms(Some("1500.0")), Some(1500));
        assert_eq!(timeout_ms(Some("0")), None);
        assert_eq!(timeout_ms(Some("soon")), None);
        assert_eq!(timeout_ms(None), None);
    }
}
