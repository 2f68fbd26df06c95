//! A refused E2B control-plane call: its status, its message (the `{"code","message"}` body)
//! and whether the SDK may retry it.

use serde::Deserialize;

use super::super::super::api::ApiError;

/// A refused control-plane call.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) status: u16,
    pub(super) message: String,
    /// `Should-Retry: false`: a retry could make a second sandbox.
    pub(super) no_retry: bool,
}

impl Refusal {
    pub(super) fn new(status: u16, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
            no_retry: false,
        }
    }

    pub(super) fn not_found(id: &str) -> Refusal {
        Refusal::new(404, format!("sandbox {id:?} not found"))
    }
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Refusal {
        Refusal::new(error.status(), error.to_string())
    }
}

/// A JSON body (an empty one is `{}`); a bad one is a 400 naming `what`.
pub fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, Refusal> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, format!("{what}: the JSON body is not valid: {e}")))
}
