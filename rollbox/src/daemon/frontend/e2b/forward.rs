//! Sandbox ports other than envd's: each request goes as HTTP/1.1 over a byte pipe the guest
//! agent opens to that port on the guest's loopback (`tcp_connect`), and its answer streams
//! back as it comes.
//!
//! The guest is not trusted with the host's credentials, and its answers are not trusted with
//! the client's browser: the request loses the daemon's key, the sandbox's tokens (also when
//! they ride in `Authorization`) and its cookies; the answer loses `Set-Cookie`. E2B's proxy
//! passes both through; rollbox sandboxes share one domain, where a cookie one sandbox sets
//! for the domain would reach every other (and any other site on it).

use base64::Engine as _;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Request, Response};
use tokio::io::{AsyncRead, AsyncWrite};

use super::super::transport::Out;
use super::state::E2b;
use super::wire::TRAFFIC_TOKEN_HEADER;
use crate::daemon::keys::same_secret;

/// Chunks of a forwarded answer in flight to the client.
const CHUNKS_IN_FLIGHT: usize = 16;

/// Request headers that never reach a guest port: the daemon's key, envd's token, the
/// traffic token, and cookies (the domain's, not the sandbox's own to read).
const HOST_ONLY_HEADERS: [&str; 5] = [
    "x-api-key",
    "x-access-token",
    TRAFFIC_TOKEN_HEADER,
    "cookie",
    "proxy-authorization",
];

/// Whether an `Authorization` value carries one of `secrets`: as the whole value, after its
/// scheme (`Bearer <key>`), or as the user or password of `Basic`.
fn carries_secret(value: &HeaderValue, secrets: &[&str]) -> bool {
    let Ok(text) = value.to_str() else {
        return false;
    };
    let text = text.trim();
    let mut candidates = vec![text.to_string()];
    if let Some((scheme, rest)) = text.split_once(' ') {
        let rest = rest.trim();
        candidates.push(rest.to_string());
        if scheme.eq_ignore_ascii_case("basic") {
            if let Some(decoded) = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .ok()
                .and_then(|d| String::from_utf8(d).ok())
            {
                let (user, password) = decoded.split_once(':').unwrap_or((&decoded, ""));
                candidates.push(user.to_string());
                candidates.push(password.to_string());
            }
        }
    }
    candidates.iter().any(|candidate| {
        let candidate = candidate.trim();
        !candidate.is_empty()
            && secrets
                .iter()
                .any(|secret| same_secret(candidate.as_bytes(), secret.trim().as_bytes()))
    })
}

/// Drops what a guest must not see from a request's headers: [`HOST_ONLY_HEADERS`], and an
/// `Authorization` that carries one of `secrets` (a guest service's own bearer token, such as
/// the MCP gateway's, passes).
pub fn strip_request_headers(headers: &mut HeaderMap, secrets: &[&str]) {
    for name in HOST_ONLY_HEADERS {
        headers.remove(name);
    }
    let host_credential = headers
        .get_all(hyper::header::AUTHORIZATION)
        .iter()
        .any(|value| carries_secret(value, secrets));
    if host_credential {
        headers.remove(hyper::header::AUTHORIZATION);
    }
}

/// The headers of a guest's answer that go to the client: all but the framing ones (the
/// answer is re-framed) and `Set-Cookie`.
pub fn answer_headers(from: &HeaderMap) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in from {
        if name != hyper::header::CONTENT_LENGTH
            && name != hyper::header::TRANSFER_ENCODING
            && name != hyper::header::SET_COOKIE
            && name.as_str() != "set-cookie2"
        {
            headers.append(name, value.clone());
        }
    }
    headers
}

/// Sends `request` over `pipe` (a connection to `port` of sandbox `id`) and streams its
/// answer back; `Err` says why it could not.
pub async fn forward<S>(
    e2b: &E2b,
    id: &str,
    pipe: S,
    port: u16,
    mut request: Request<Incoming>,
) -> Result<Response<Out>, String>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (access, traffic) = (e2b.access_token(id), e2b.traffic_token(id));
    strip_request_headers(
        request.headers_mut(),
        &[e2b.api_key.as_str(), access.as_str(), traffic.as_str()],
    );
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(pipe))
            .await
            .map_err(|e| format!("HTTP handshake with guest port {port}: {e}"))?;
    tokio::spawn(connection);
    let answer = sender
        .send_request(request)
        .await
        .map_err(|e| format!("guest port {port} gave no answer: {e}"))?;
    let (parts, mut body) = answer.into_parts();
    let (chunks, receiver) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
    tokio::spawn(async move {
        while let Some(frame) = body.frame().await {
            let chunk = match frame {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => Ok(data),
                    Err(_) => continue, // trailers
                },
                Err(e) => Err(std::io::Error::other(e)),
            };
            let failed = chunk.is_err();
            // A client that went away ends the forward, and dropping the pipe closes the
            // guest socket.
            if chunks.send(chunk).await.is_err() || failed {
                return;
            }
        }
    });
    let mut response = Response::new(Out::Stream(receiver));
    *response.status_mut() = parts.status;
    *response.headers_mut() = answer_headers(&parts.headers);
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_credentials_and_cookies_do_not_reach_the_guest() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("X-API-KEY", "daemon-key"),
            ("X-Access-Token", "envd-token"),
            ("E2B-Traffic-Access-Token", "traffic-token"),
            ("Cookie", "session=1"),
            ("Authorization", "Bearer daemon-key"),
            ("X-Other", "kept"),
        ] {
            headers.append(name, HeaderValue::from_static(value));
        }
        let secrets = ["daemon-key", "envd-token", "traffic-token"];
        strip_request_headers(&mut headers, &secrets);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers["x-other"], "kept");
        // The guest service's own bearer token passes; a Basic that hides the key does not.
        let mut own = HeaderMap::new();
        own.insert(
            "authorization",
            HeaderValue::from_static("Bearer mcp-token"),
        );
        strip_request_headers(&mut own, &secrets);
        assert_eq!(own["authorization"], "Bearer mcp-token");
        let basic = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("user:traffic-token")
        );
        let mut hidden = HeaderMap::new();
        hidden.insert("authorization", basic.parse().expect("value"));
        strip_request_headers(&mut hidden, &secrets);
        assert!(hidden.is_empty(), "{hidden:?}");
        let mut bare = HeaderMap::new();
        bare.insert("authorization", HeaderValue::from_static("envd-token"));
        strip_request_headers(&mut bare, &secrets);
        assert!(bare.is_empty(), "{bare:?}");
    }

    #[test]
    fn set_cookie_does_not_come_back() {
        let mut from = HeaderMap::new();
        from.append(
            "set-cookie",
            HeaderValue::from_static("a=1; Domain=e2b.test"),
        );
        from.append("set-cookie", HeaderValue::from_static("b=2"));
        from.append("content-length", HeaderValue::from_static("3"));
        from.append("content-type", HeaderValue::from_static("text/plain"));
        let headers = answer_headers(&from);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(headers["content-type"], "text/plain");
    }
}
