//! The lease's HTTP side: each request, routed by [`super::route`], goes to the daemon's E2B
//! socket pinned to the lease's sandbox, bodies streamed both ways (envd's process streams
//! stay open as long as the process runs).
//!
//! Inside the pod's network the port is envd as agent-sandbox's envd example serves it: a
//! data-plane request without a token gets the sandbox's access token, and the control routes
//! of this one sandbox get the daemon's key. Who may reach the pod is the NetworkPolicy's
//! business, as for any agent-sandbox pod.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;

use super::route::{route, Route};

/// What every request of a lease is pinned to.
pub struct Pin {
    /// The sandbox's id.
    pub id: String,
    /// envd's access token of the sandbox (the daemon's E2B `envdAccessToken`).
    pub access_token: String,
    /// The daemon's API key, for the control routes of this sandbox.
    pub api_key: String,
    /// The daemon's E2B socket (`rollbox serve --e2b-socket`).
    pub e2b_socket: PathBuf,
    /// The template or snapshot the sandbox came from, and the pod, for `GET /lease`.
    pub source: String,
    pub pod_uid: Option<String>,
}

type Body = BoxBody<Bytes, hyper::Error>;

/// Headers that belong to one connection, never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

fn whole(status: u16, value: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(value.to_string()))
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn set(request: &mut Request<Incoming>, name: &'static str, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        request
            .headers_mut()
            .insert(HeaderName::from_static(name), value);
    }
}

/// One request of a client of the lease.
pub async fn respond(pin: &Pin, mut request: Request<Incoming>) -> Response<Body> {
    let names_sandbox = request.headers().contains_key("e2b-sandbox-id");
    let path = request
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    for name in HOP_BY_HOP {
        request.headers_mut().remove(*name);
    }
    match route(&path, names_sandbox, &pin.id) {
        Route::Info => {
            return whole(
                200,
                &json!({ "sandboxId": pin.id, "source": pin.source, "podUid": pin.pod_uid }),
            );
        }
        Route::Refused => {
            let message = format!(
                "this is the lease of sandbox {}: only its own routes are served here ({path} is not)",
                pin.id
            );
            return whole(403, &json!({ "code": 403, "message": message }));
        }
        Route::Data => {
            request.headers_mut().remove("x-api-key");
            set(&mut request, "e2b-sandbox-id", &pin.id);
            let has_token = ["x-access-token", "e2b-traffic-access-token"]
                .iter()
                .any(|name| request.headers().contains_key(*name));
            if !has_token {
                set(&mut request, "x-access-token", &pin.access_token);
            }
        }
        Route::Control(to) => {
            request.headers_mut().remove("e2b-sandbox-id");
            set(&mut request, "x-api-key", &pin.api_key);
            match to.parse() {
                Ok(uri) => *request.uri_mut() = uri,
                Err(_) => {
                    let message = format!("cannot forward {path}");
                    return whole(400, &json!({ "code": 400, "message": message }));
                }
            }
        }
    }
    match forward(&pin.e2b_socket, request).await {
        Ok(mut response) => {
            for name in HOP_BY_HOP {
                response.headers_mut().remove(*name);
            }
            response.map(BodyExt::boxed)
        }
        Err(message) => {
            log::warn!("lease: {message}");
            whole(
                502,
                &json!({ "sandboxId": pin.id, "code": 502, "message": message }),
            )
        }
    }
}

/// Sends `request` to the daemon over a connection of its own (a Unix connect costs
/// microseconds, and one per request keeps a streamed answer from blocking the next).
async fn forward(
    socket: &PathBuf,
    request: Request<Incoming>,
) -> Result<Response<Incoming>, String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("the daemon's E2B socket {}: {e}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("the daemon's E2B socket {}: {e}", socket.display()))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            log::debug!("lease: daemon connection: {e}");
        }
    });
    sender
        .send_request(request)
        .await
        .map_err(|e| format!("the daemon's E2B API: {e}"))
}

/// Serves one client connection until it ends.
pub async fn serve(pin: Arc<Pin>, stream: tokio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |request| {
        let pin = Arc::clone(&pin);
        async move { Ok::<_, Infallible>(respond(&pin, request).await) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
        log::debug!("lease: client connection: {e}");
    }
}
