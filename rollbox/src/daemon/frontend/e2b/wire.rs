//! E2B's wire facts and the HTTP helpers both planes use: the versions and ports rollbox
//! reports, JSON and empty answers, RFC 3339 times, query strings and headers.

use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};

use super::super::transport::Out;

/// The envd version rollbox reports: the newest whose features the façade implements
/// (octet-stream and gzip uploads, CloseStdin: 0.5.7; file metadata as `user.e2b.*` xattrs:
/// 0.6.2; watch events with their entry: 0.6.3; watches on network mounts, refused unless
/// allowed: 0.6.4). The SDK gates nothing on a later version.
pub const ENVD_VERSION: &str = "0.6.4";
/// envd's port in E2B sandboxes, served here; other ports go to the guest through the agent.
pub const ENVD_PORT: u16 = 49983;
/// Sandbox TTL when a create gives no `timeout` (the SDK's own default).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The native metadata key where sandboxes made by the first E2B slice kept their `envVars`
/// (JSON); sandboxes made since keep them as the daemon's sandbox `env`.
pub const ENV_VARS_KEY: &str = "e2b.envVars";

pub fn header<'a>(request: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    request.headers().get(name).and_then(|v| v.to_str().ok())
}

/// A JSON response.
pub fn json(status: u16, value: &serde_json::Value) -> Response<Out> {
    with_body(status, "application/json", Bytes::from(value.to_string()))
}

pub fn with_body(status: u16, content_type: &'static str, body: Bytes) -> Response<Out> {
    let mut response = Response::new(Out::Full(Some(body)));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

pub fn no_content() -> Response<Out> {
    let mut response = Response::new(Out::Full(None));
    *response.status_mut() = hyper::StatusCode::NO_CONTENT;
    response
}

/// Milliseconds since the epoch as RFC 3339 UTC (`2026-12-01T02:12:26.123Z`).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Decodes `%XX` and `+` of a URL query component.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(high), Some(low)) => {
                        out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A query string as decoded (name, value) pairs.
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(name), percent_decode(value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_queries_decode() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_091_146_123), "2026-12-01T02:12:26.123Z");
        assert_eq!(
            query_pairs("metadata=a%3Db%26c%3Dd&state=running%2Cpaused&x"),
            vec![
                ("metadata".to_string(), "a=b&c=d".to_string()),
                ("state".to_string(), "running,paused".to_string()),
                ("x".to_string(), String::new()),
            ]
        );
        assert_eq!(percent_decode("50%"), "50%");
        assert_eq!(percent_decode("a+b%2"), "a b%2");
    }
}
