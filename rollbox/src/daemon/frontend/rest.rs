//! The native frontend: accept, check the key (who the caller is), cap the body, parse into an
//! action, run it on the [`Core`] as that caller, and write the typed reply as JSON. Nothing
//! else happens here.

use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use super::super::api::{self, Action, ApiError, Reply, VolumeOp, MAX_BODY, MAX_UPLOAD};
use super::super::core::Core;
use super::super::keys::Caller;
use super::conn::{self, ConnLimits, Gate};
use super::transport::{BodyReader, Listener, Out};

/// Serves connections until `shutdown` completes, each held to `limits` (see [`conn`]); TCP
/// connections through `tls` when given.
pub async fn run(
    listener: Listener,
    core: Arc<Core>,
    limits: ConnLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let gate = Gate::new(limits.max_connections);
    tokio::pin!(shutdown);
    let handle = move |request| {
        let core = Arc::clone(&core);
        async move { respond(&core, request).await }
    };
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            () = conn::serve_next(&listener, tls.as_ref(), &gate, limits, handle.clone()) => {}
        }
    }
}

/// Who the request's `Authorization: Bearer KEY` belongs to, if anyone.
fn caller(core: &Core, request: &Request<Incoming>) -> Option<Caller> {
    request
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|given| core.authenticate(given))
}

async fn respond(core: &Core, request: Request<Incoming>) -> Response<Out> {
    if let Some(response) = probe(core, &request) {
        return response;
    }
    match handle(core, request).await {
        Ok(reply) => reply_response(reply),
        Err(error) => error_response(&error),
    }
}

/// `GET /livez` and `GET /readyz`, without a key and answering nothing but whether: the
/// process serves (livez) and takes new sandboxes (readyz: 503 while draining).
fn probe(core: &Core, request: &Request<Incoming>) -> Option<Response<Out>> {
    if request.method() != hyper::Method::GET {
        return None;
    }
    let (status, text) = match request.uri().path() {
        "/livez" => (200, "ok\n"),
        "/readyz" if core.ready() => (200, "ready\n"),
        "/readyz" => (503, "not ready\n"),
        _ => return None,
    };
    let mut response = Response::new(Out::Full(Some(Bytes::from_static(text.as_bytes()))));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain"),
    );
    Some(response)
}

/// Whether the request asks to turn the connection into a TCP stream.
fn asks_tcp_upgrade(request: &Request<Incoming>) -> bool {
    let has = |name, token: &str| {
        request
            .headers()
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|v| v.trim().eq_ignore_ascii_case(token))
    };
    has(hyper::header::CONNECTION, "upgrade") && has(hyper::header::UPGRADE, "tcp")
}

/// Answers 101 and, once hyper hands over the connection, pipes it to guest `port`.
async fn port_connect(
    core: &Core,
    caller: &Caller,
    request: &mut Request<Incoming>,
    id: &str,
    port: u16,
) -> Result<Reply, ApiError> {
    if !asks_tcp_upgrade(request) {
        return Err(ApiError::BadRequest(format!(
            "GET /sandboxes/{id}/ports/{port} is an HTTP upgrade: send `Connection: Upgrade` and `Upgrade: tcp`"
        )));
    }
    let pipe = core.guest_tcp_as(caller, id, port).await?;
    let upgrade = hyper::upgrade::on(request);
    let what = format!("sandbox {id} port {port}");
    tokio::spawn(async move {
        let mut pipe = pipe;
        match upgrade.await {
            Ok(upgraded) => {
                let mut client = TokioIo::new(upgraded);
                if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut pipe).await {
                    log::info!("{what}: the connection ended: {e}");
                }
            }
            Err(e) => log::info!("{what}: the upgrade failed: {e}"),
        }
    });
    Ok(Reply::SwitchingProtocols)
}

async fn handle(core: &Core, mut request: Request<Incoming>) -> Result<Reply, ApiError> {
    let Some(caller) = caller(core, &request) else {
        return Err(ApiError::Unauthorized);
    };
    let declared = request
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let method = request.method().as_str().to_string();
    let path = request.uri().path().to_string();
    let query = request.uri().query().map(str::to_string);
    if api::is_upload(&method, &path) {
        let action = api::parse(&method, &path, query.as_deref(), b"")?;
        if action == Action::ImportSnapshot {
            // Its manifest bounds each file, and a snapshot may be far over MAX_UPLOAD.
            let body = BodyReader::new(request.into_body(), usize::MAX);
            return core.import_snapshot_as(&caller, body).await;
        }
        if declared.is_some_and(|n| n > MAX_UPLOAD as u64) {
            return Err(ApiError::TooLarge(MAX_UPLOAD));
        }
        let body = BodyReader::new(request.into_body(), MAX_UPLOAD);
        return match action {
            Action::File { id, op } => core.upload_as(&caller, &id, op, body).await,
            Action::Volume {
                name,
                op: VolumeOp::Write { path },
            } => core.volume_upload_as(&caller, &name, path, body).await,
            _ => Err(ApiError::Internal(format!(
                "{method} {path} is not an upload"
            ))),
        };
    }
    if method == "GET" && path.contains("/ports/") {
        if let Action::PortConnect { id, port } = api::parse(&method, &path, query.as_deref(), b"")?
        {
            return port_connect(core, &caller, &mut request, &id, port).await;
        }
    }
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(ApiError::TooLarge(MAX_BODY));
    }
    let body = Limited::new(request.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::TooLarge(MAX_BODY)
            } else {
                ApiError::BadRequest(format!("cannot read the request body: {e}"))
            }
        })?
        .to_bytes();
    let action = api::parse(&method, &path, query.as_deref(), &body)?;
    core.handle_as(&caller, action).await
}

fn json_response(status: u16, value: &impl serde::Serialize) -> Response<Out> {
    let body = serde_json::to_vec(value)
        .unwrap_or_else(|e| format!(r#"{{"error":"cannot encode the reply: {e}"}}"#).into_bytes());
    let mut response = Response::new(Out::Full(Some(Bytes::from(body))));
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn reply_response(reply: Reply) -> Response<Out> {
    match reply {
        Reply::Health => json_response(200, &serde_json::json!({ "status": "ok" })),
        Reply::Node(node) => json_response(200, &node),
        Reply::Template { created, template } => {
            json_response(if created { 201 } else { 200 }, &template)
        }
        Reply::Templates(templates) => {
            json_response(200, &serde_json::json!({ "templates": templates }))
        }
        Reply::Sandbox { created, sandbox } => {
            json_response(if created { 201 } else { 200 }, &sandbox)
        }
        Reply::Sandboxes(list) => json_response(200, &list),
        Reply::Exec(result) => json_response(200, &result),
        Reply::Snapshot { created, snapshot } => {
            json_response(if created { 201 } else { 200 }, &snapshot)
        }
        Reply::Snapshots(snapshots) => {
            json_response(200, &serde_json::json!({ "snapshots": snapshots }))
        }
        Reply::Forked(results) => json_response(200, &serde_json::json!({ "results": results })),
        Reply::Deleted(ids) => json_response(200, &serde_json::json!({ "deleted": ids })),
        Reply::Usage(usage) => json_response(200, &usage),
        Reply::Key(key) => json_response(201, &key),
        Reply::Volume { created, volume } => {
            json_response(if created { 201 } else { 200 }, &volume)
        }
        Reply::Volumes(volumes) => json_response(200, &serde_json::json!({ "volumes": volumes })),
        Reply::Gpus(gpus) => json_response(200, &serde_json::json!({ "gpus": gpus })),
        Reply::Keys(keys) => json_response(200, &serde_json::json!({ "keys": keys })),
        Reply::Metrics(text) => {
            let mut response = Response::new(Out::Full(Some(Bytes::from(text))));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            response
        }
        Reply::File(info) => json_response(200, &info),
        Reply::Files(entries) => json_response(200, &serde_json::json!({ "entries": entries })),
        Reply::Written { path, bytes } => {
            json_response(201, &serde_json::json!({ "path": path, "bytes": bytes }))
        }
        Reply::Stream { content_type, body } => {
            let mut response = Response::new(Out::Stream(body));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(content_type),
            );
            response
        }
        Reply::NoContent => {
            let mut response = Response::new(Out::Full(None));
            *response.status_mut() = hyper::StatusCode::NO_CONTENT;
            response
        }
        Reply::SwitchingProtocols => {
            let mut response = Response::new(Out::Full(None));
            *response.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
            let headers = response.headers_mut();
            headers.insert(
                hyper::header::CONNECTION,
                hyper::header::HeaderValue::from_static("upgrade"),
            );
            headers.insert(
                hyper::header::UPGRADE,
                hyper::header::HeaderValue::from_static("tcp"),
            );
            response
        }
    }
}

fn error_response(error: &ApiError) -> Response<Out> {
    let body = match error {
        // Which of the node's limits refused it, for a scheduler to read.
        ApiError::Full { limit, .. } => {
            serde_json::json!({ "error": error.to_string(), "limit": limit })
        }
        _ => serde_json::json!({ "error": error.to_string() }),
    };
    let mut response = json_response(error.status(), &body);
    let headers = response.headers_mut();
    match error {
        ApiError::Overloaded(_) | ApiError::Full { .. } => {
            headers.insert(
                hyper::header::RETRY_AFTER,
                hyper::header::HeaderValue::from_static("1"),
            );
        }
        ApiError::Unauthorized => {
            headers.insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer"),
            );
        }
        // RFC 9110: a 405 names the methods the resource has.
        ApiError::MethodNotAllowed { path, .. } => {
            let allow = api::allowed_methods(path).join(", ");
            if let Ok(value) = hyper::header::HeaderValue::from_str(&allow) {
                headers.insert(hyper::header::ALLOW, value);
            }
        }
        _ => {}
    }
    response
}
