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
/// The native metadata key that holds E2B's `network.allowPublicTraffic` of a create when it
/// was false: then the sandbox's other ports need a token. Forks keep it (they keep `e2b.*`).
pub const PUBLIC_TRAFFIC_KEY: &str = "e2b.allowPublicTraffic";
/// The header that carries a sandbox's traffic access token (E2B's proxy reads this one).
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

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

/// Unix milliseconds of an RFC 3339 time (`2026-12-01T02:12:26.123456+01:00`, `...Z`; what
/// Python's `isoformat()` of an aware datetime writes), or None.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let (date, time) = text.split_once(['T', 't', ' '])?;
    let mut ymd = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (ymd.next()??, ymd.next()??, ymd.next()??);
    if date.len() != 10 || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    // The offset: Z, or +HH:MM / -HH:MM after the clock.
    let (clock, offset_s) = if let Some(clock) = time.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (clock, offset) = time.split_at(at);
        let sign = if offset.starts_with('-') { -1 } else { 1 };
        let (hours, minutes) = offset[1..].split_once(':')?;
        if hours.len() != 2 || minutes.len() != 2 {
            return None;
        }
        let hours: i64 = hours.parse().ok()?;
        let minutes: i64 = minutes.parse().ok()?;
        (clock, sign * (hours * 3600 + minutes * 60))
    };
    let (hms, fraction) = clock.split_once('.').unwrap_or((clock, ""));
    let mut parts = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (parts.next()??, parts.next()??, parts.next()??);
    if hms.len() != 8 || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    if !fraction.bytes().all(|b| b.is_ascii_digit()) || (clock.contains('.') && fraction.is_empty())
    {
        return None;
    }
    let ms: i64 = format!("{fraction:0<3}")[..3].parse().ok()?;
    // Howard Hinnant's days_from_civil.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    u64::try_from(seconds.checked_mul(1000)?.checked_add(ms)?).ok()
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
        for (text, ms) in [
            ("2026-12-01T02:12:26.123Z", Some(1_796_091_146_123)),
            ("2026-12-01T02:12:26.123456+00:00", Some(1_796_091_146_123)),
            ("2026-12-01T03:12:26.1+01:00", Some(1_796_091_146_100)),
            ("2026-12-01T00:12:26-02:00", Some(1_796_091_146_000)),
            ("1970-01-01T00:00:00Z", Some(0)),
            ("2026-12-01", None),
            ("2026-13-01T00:00:00Z", None),
            ("2026-12-01T02:12:26", None),
            ("2026-12-01T02:12:26.Z", None),
            ("2026-12-01T2:12:26Z", None),
            ("yesterday", None),
            ("1969-12-31T23:59:59Z", None),
        ] {
            assert_eq!(parse_rfc3339(text), ms, "{text}");
            if let Some(ms) = ms.filter(|ms| ms % 1000 != 0 && text.ends_with('Z')) {
                assert_eq!(rfc3339(ms), text);
            }
        }
        assert_eq!(percent_decode("a+b%2"), "a b%2");
    }
}
