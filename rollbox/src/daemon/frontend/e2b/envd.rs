//! envd's data plane, translated to the rollbox agent: which sandbox and port a request is
//! for, the access token, and the routes: `process.Process` ([`super::process`]) and
//! `filesystem.Filesystem` ([`super::filesystem`]) Connect RPCs (JSON codec), `/files`
//! ([`super::files`]), `/health` and `/envs`. Other ports are the guest's own services
//! ([`super::forward`]): they take the envd or the traffic token, or anyone when the sandbox
//! is public (E2B's `allowPublicTraffic`, the default).
//!
//! Tokens are checked first: they are derived from the sandbox id, so a request without a
//! valid one is answered without a store write (a lookup touches the sandbox's idle TTL) and
//! resumes no paused sandbox; only a public sandbox's other ports and a token-less `/health`
//! read the store, and they write nothing.

use std::sync::Arc;

use base64::Engine as _;
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::json;

use super::super::super::api::{Action, ListQuery, Reply, Sandbox, State, MAX_BODY};
use super::super::transport::Out;
use super::call::{read_body, unary_error, Call};
use super::connect::{Code, RpcError};
use super::process::Stream;
use super::signature::{self, Operation};
use super::state::E2b;
use super::wire::{header, json, no_content, ENVD_PORT, PUBLIC_TRAFFIC_KEY, TRAFFIC_TOKEN_HEADER};
use crate::daemon::keys::same_secret;

/// The sandbox and port a data-plane request is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    id: String,
    port: Option<u16>,
}

pub fn data_plane_target(request: &Request<Incoming>, domain: &str) -> Option<Target> {
    if let Some(id) = header(request, "e2b-sandbox-id").filter(|id| !id.is_empty()) {
        let port = header(request, "e2b-sandbox-port").and_then(|p| p.trim().parse().ok());
        return Some(Target {
            id: id.to_string(),
            port: port.or(Some(ENVD_PORT)),
        });
    }
    let host = header(request, "host").or_else(|| request.uri().host())?;
    host_target(host, domain)
}

/// `{port}-{id}.{domain}[:p]` → the target.
fn host_target(host: &str, domain: &str) -> Option<Target> {
    let host = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    Some(Target {
        id: id.to_string(),
        port: Some(port.parse().ok()?),
    })
}

/// A data-plane request for a sandbox that is not there (the texts the SDK keys on).
fn proxy_error(id: &str, message: String) -> Response<Out> {
    json(
        502,
        &json!({ "sandboxId": id, "message": message, "code": 502 }),
    )
}

/// The credential a data-plane request carries for its sandbox, checked before anything is
/// looked up: every token is derived from the sandbox id, so an unauthenticated request costs
/// no store access (and resumes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Credential {
    /// The envd access token (`X-Access-Token`): envd and every other port.
    Access,
    /// The traffic access token (`e2b-traffic-access-token`): the other ports.
    Traffic,
    /// A token header that is present but wrong.
    Wrong,
    None,
}

/// What `request` carries for sandbox `id` (tokens compared in constant time; an empty
/// header is no header, as in envd).
fn credential(e2b: &E2b, id: &str, request: &Request<Incoming>) -> Credential {
    let sent = |name: &str| {
        header(request, name)
            .map(str::trim)
            .filter(|t| !t.is_empty())
    };
    let access = sent("x-access-token");
    let traffic = sent(TRAFFIC_TOKEN_HEADER);
    if access.is_some_and(|t| same_secret(t.as_bytes(), e2b.access_token(id).as_bytes())) {
        return Credential::Access;
    }
    if traffic.is_some_and(|t| same_secret(t.as_bytes(), e2b.traffic_token(id).as_bytes())) {
        return Credential::Traffic;
    }
    if access.is_some() || traffic.is_some() {
        Credential::Wrong
    } else {
        Credential::None
    }
}

pub async fn respond(e2b: &Arc<E2b>, target: Target, request: Request<Incoming>) -> Response<Out> {
    let id = target.id.clone();
    let credential = credential(e2b, &id, &request);
    // Other ports are the guest's own services, reached through the agent.
    match target.port {
        Some(ENVD_PORT) => {}
        Some(port) => return other_port(e2b, &id, port, credential, request).await,
        None => return proxy_error(&id, format!("sandbox {id}: port is not open (no port)")),
    }
    let path = request.uri().path().to_string();
    let method = request.method().as_str().to_string();
    if method == "GET" && path == "/health" {
        // envd's health takes no token; without one it reads the sandbox and resumes nothing.
        if credential != Credential::Access {
            return match peek(e2b, &id).await {
                Some(sandbox) if sandbox.state == State::Running => no_content(),
                Some(sandbox) if sandbox.state == State::Paused => paused_error(&id),
                _ => not_found(&id),
            };
        }
        return match live(e2b, &id).await {
            Ok(_) => no_content(),
            Err(response) => response,
        };
    }
    let rpc = path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
    // `/files` also takes a signed URL instead of the header (download_url()/upload_url()).
    let files_op = match (method.as_str(), path.as_str()) {
        ("GET", "/files") => Some(Operation::Read),
        ("POST", "/files") => Some(Operation::Write),
        _ => None,
    };
    let sent_access = header(&request, "x-access-token").is_some_and(|t| !t.trim().is_empty());
    if let (false, false, Some(operation)) =
        (credential == Credential::Access, sent_access, files_op)
    {
        let query = request.uri().query().unwrap_or("");
        let token = e2b.access_token(&id);
        if let Err(e) = signature::verify(query, operation, &token, signature::unix_now()) {
            return json(
                401,
                &json!({ "code": 401, "message": format!("sandbox {id}: {e}") }),
            );
        }
    } else if credential != Credential::Access {
        let message = format!("sandbox {id}: missing or wrong X-Access-Token (the envdAccessToken of the create answer)");
        return if rpc {
            unary_error(&RpcError::new(Code::Unauthenticated, message))
        } else {
            json(401, &json!({ "code": 401, "message": message }))
        };
    }
    let sandbox = match live(e2b, &id).await {
        Ok(sandbox) => sandbox,
        Err(response) => return response,
    };
    let call = match Call::for_user(Arc::clone(e2b), sandbox, basic_user(&request)).await {
        Ok(call) => call,
        Err(e) if rpc => return unary_error(&e),
        Err(e) => {
            let status = e.code.http_status();
            return json(status, &json!({ "code": status, "message": e.message }));
        }
    };
    match (method.as_str(), path.as_str()) {
        ("GET", "/envs") => json(200, &json!(call.env_vars())),
        ("GET", "/files") => call.download(request).await,
        ("POST", "/files") => call.upload(request).await,
        ("POST", "/process.Process/Start") => call.streaming(request, Stream::Start).await,
        ("POST", "/process.Process/Connect") => call.streaming(request, Stream::Connect).await,
        ("POST", "/process.Process/StreamInput") => call.stream_input(request).await,
        ("POST", "/filesystem.Filesystem/WatchDir") => call.watch_dir(request).await,
        ("POST", rpc_path) if rpc => call.unary(request, rpc_path).await,
        _ => json(
            404,
            &json!({ "code": 404, "message": format!("envd has no route {method} {path}") }),
        ),
    }
}

fn not_found(id: &str) -> Response<Out> {
    proxy_error(id, format!("The sandbox {id} was not found"))
}

fn paused_error(id: &str) -> Response<Out> {
    proxy_error(
        id,
        format!("The sandbox {id} is paused: connect to it (Sandbox.connect) to resume it"),
    )
}

/// Sandbox `id` as the store has it, read without a write (no API-call touch): for deciding
/// about a request that carries no token.
async fn peek(e2b: &E2b, id: &str) -> Option<Sandbox> {
    let query = ListQuery {
        ids: vec![id.to_string()],
        limit: 1,
        ..ListQuery::default()
    };
    match e2b.core.handle(Action::ListSandboxes(query)).await {
        Ok(Reply::Sandboxes(list)) => list.sandboxes.into_iter().find(|s| s.id == id),
        _ => None,
    }
}

/// An authorized request's sandbox: looked up (an API call on it, for its idle TTL) and, when
/// paused with `autoResume`, resumed. A paused VM answers nothing, `/health` included: the
/// SDK's `is_running()` is false on a 502. Connecting (the control plane's `/connect`) resumes
/// it; with `autoResume`, so does this request, which is then served.
async fn live(e2b: &E2b, id: &str) -> Result<Sandbox, Response<Out>> {
    let sandbox = match e2b.core.handle(Action::GetSandbox(id.to_string())).await {
        Ok(Reply::Sandbox { sandbox, .. }) if sandbox.state.is_live() => sandbox,
        _ => return Err(not_found(id)),
    };
    if sandbox.state != State::Paused {
        return Ok(sandbox);
    }
    if !sandbox.auto_resume {
        return Err(paused_error(id));
    }
    auto_resume(e2b, id)
        .await
        .map_err(|message| proxy_error(id, message))
}

/// Whether sandbox `sandbox` takes traffic to its other ports without a token: E2B's
/// `allowPublicTraffic`, true unless its create said false.
pub fn public_traffic(sandbox: &Sandbox) -> bool {
    sandbox.metadata.get(PUBLIC_TRAFFIC_KEY).map(String::as_str) != Some("false")
}

/// A request for guest `port`: with the envd or the traffic token, or to a public sandbox
/// (a read of the store decides that), it is forwarded; else a 403, as E2B's proxy answers.
async fn other_port(
    e2b: &Arc<E2b>,
    id: &str,
    port: u16,
    credential: Credential,
    request: Request<Incoming>,
) -> Response<Out> {
    if !matches!(credential, Credential::Access | Credential::Traffic) {
        let Some(sandbox) = peek(e2b, id).await.filter(|s| s.state.is_live()) else {
            return not_found(id);
        };
        if !public_traffic(&sandbox) {
            let what = if credential == Credential::Wrong {
                "is wrong"
            } else {
                "is missing"
            };
            return json(
                403,
                &json!({
                    "sandboxId": id,
                    "code": 403,
                    "message": format!("Sandbox {id} is secured with a traffic access token: the {TRAFFIC_TOKEN_HEADER} header {what} (the trafficAccessToken of the create answer)"),
                }),
            );
        }
    }
    if let Err(response) = live(e2b, id).await {
        return response;
    }
    forward_port(e2b, id, port, request).await
}

/// Resumes a paused `autoResume` sandbox for a request (the daemon's resume gives it its
/// create TTL again). Two requests may race: the one that loses finds it running.
async fn auto_resume(e2b: &E2b, id: &str) -> Result<Sandbox, String> {
    let resumed = e2b.core.handle(Action::Resume(id.to_string())).await;
    match e2b.core.handle(Action::GetSandbox(id.to_string())).await {
        Ok(Reply::Sandbox { sandbox, .. }) if sandbox.state == State::Running => Ok(sandbox),
        _ => Err(match resumed {
            Err(e) => format!("The sandbox {id} is paused and did not resume: {e}"),
            Ok(_) => format!("The sandbox {id} was not found"),
        }),
    }
}

/// A request for guest `port`, forwarded through the agent; 502 "port is not open" when
/// nothing listens there (the text the SDK keys on).
async fn forward_port(
    e2b: &Arc<E2b>,
    id: &str,
    port: u16,
    request: Request<Incoming>,
) -> Response<Out> {
    let not_open = |why: String| proxy_error(id, format!("sandbox {id}: port is not open ({why})"));
    match e2b.core.guest_tcp(id, port).await {
        Ok(pipe) => super::forward::forward(e2b, id, pipe, port, request)
            .await
            .unwrap_or_else(not_open),
        Err(e) => not_open(e.to_string()),
    }
}

/// The user of `Authorization: Basic base64("user:")`.
fn basic_user(request: &Request<Incoming>) -> Option<String> {
    let encoded = header(request, "authorization")?.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split(':').next().unwrap_or("");
    (!user.is_empty()).then(|| user.to_string())
}

impl Call {
    async fn unary(&self, request: Request<Incoming>, path: &str) -> Response<Out> {
        let body = match read_body(request, MAX_BODY).await {
            Ok(body) => body,
            Err(e) => return unary_error(&RpcError::new(Code::InvalidArgument, e)),
        };
        let method = path.rsplit('/').next().unwrap_or("");
        let result = if path.starts_with("/process.Process/") {
            self.process_call(method, &body).await
        } else {
            self.filesystem_call(method, &body).await
        };
        match result {
            Ok(value) => json(200, &value),
            Err(e) => unary_error(&e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_port_and_sandbox() {
        assert_eq!(
            host_target("49983-sb-0123.e2b.local:8443", "e2b.local"),
            Some(Target {
                id: "sb-0123".into(),
                port: Some(49983)
            })
        );
        assert_eq!(host_target("api.e2b.local", "e2b.local"), None);
        assert_eq!(host_target("127.0.0.1:3000", "e2b.local"), None);
        assert_eq!(host_target("x.49983-sb-1.e2b.local", "e2b.local"), None);
    }
}
