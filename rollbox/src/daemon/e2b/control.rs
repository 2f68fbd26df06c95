//! E2B's control plane: REST with `X-API-KEY`, for SDK 2.51+ (`/v2/sandboxes`), 2.0-2.50
//! (`POST /sandboxes`, `/connect`, `/resume`) and 1.x (`GET /sandboxes`). Each route runs the
//! daemon's own actions; every error body is `{"code","message"}`.

use std::collections::BTreeMap;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::api::{self, Action, ApiError, ListQuery, Sandbox, State, MAX_BODY, MAX_TTL_S};
use super::super::http::Out;
use super::super::{now_ms, Reply};
use super::{
    json, no_content, query_pairs, rfc3339, E2b, DEFAULT_TIMEOUT_S, ENVD_VERSION, ENV_VARS_KEY,
};

/// E2B calls rollbox does not serve (yet), answered 501 with this reason.
const REFUSED: &[(&str, &str)] = &[
    ("fork", "fork through the E2B API is not served yet; use rollbox's POST /sandboxes/{id}/fork"),
    ("snapshots", "snapshots through the E2B API are not served yet; use rollbox's POST /sandboxes/{id}/snapshots"),
    ("metrics", "sandbox metrics are not served yet"),
    ("network", "network updates are not served: rollbox sandboxes have no E2B network policy"),
    ("refreshes", "refreshes are not served; use POST /sandboxes/{id}/timeout"),
];

/// A refused control-plane call.
#[derive(Debug)]
struct Refusal {
    status: u16,
    message: String,
    /// `Should-Retry: false`: a retry could make a second sandbox.
    no_retry: bool,
}

impl Refusal {
    fn new(status: u16, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
            no_retry: false,
        }
    }

    fn not_found(id: &str) -> Refusal {
        Refusal::new(404, format!("sandbox {id:?} not found"))
    }
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Refusal {
        Refusal::new(error.status(), error.to_string())
    }
}

pub(super) async fn respond(e2b: &Arc<E2b>, request: Request<Incoming>) -> Response<Out> {
    match route(e2b, request).await {
        Ok(response) => response,
        Err(refusal) => {
            let mut response = json(
                refusal.status,
                &json!({ "code": refusal.status, "message": refusal.message }),
            );
            if refusal.no_retry {
                response.headers_mut().insert(
                    "should-retry",
                    hyper::header::HeaderValue::from_static("false"),
                );
            }
            if refusal.status == 429 {
                response.headers_mut().insert(
                    hyper::header::RETRY_AFTER,
                    hyper::header::HeaderValue::from_static("1"),
                );
            }
            response
        }
    }
}

fn authorized(request: &Request<Incoming>, key: &str) -> bool {
    let given = super::header(request, "x-api-key").or_else(|| {
        super::header(request, "authorization").and_then(|v| v.strip_prefix("Bearer "))
    });
    given.is_some_and(|given| {
        let (given, key) = (given.trim().as_bytes(), key.trim().as_bytes());
        given.len() == key.len()
            && given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    })
}

async fn route(e2b: &Arc<E2b>, request: Request<Incoming>) -> Result<Response<Out>, Refusal> {
    if !authorized(&request, &e2b.daemon.options.api_key) {
        return Err(Refusal::new(
            401,
            "missing or wrong API key: send the rollbox daemon's key as X-API-KEY (E2B_API_KEY)",
        ));
    }
    let method = request.method().as_str().to_string();
    let path = request.uri().path().trim_end_matches('/').to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let idempotency_key = super::header(&request, "idempotency-key").map(str::to_string);
    let body = Limited::new(request.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| Refusal::new(400, format!("cannot read the request body: {e}")))?
        .to_bytes();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let segments = match segments.as_slice() {
        ["v2", rest @ ..] => rest.to_vec(),
        other => other.to_vec(),
    };
    let v2 = path.starts_with("/v2/");
    match (method.as_str(), segments.as_slice()) {
        ("POST", ["sandboxes"]) => create(e2b, &body, idempotency_key).await,
        ("GET", ["sandboxes"]) => list(e2b, &query, v2).await,
        ("GET", ["sandboxes", id]) => detail(e2b, id).await,
        ("DELETE", ["sandboxes", id]) => kill(e2b, id).await,
        ("POST", ["sandboxes", id, "timeout"]) => set_timeout(e2b, id, &body).await,
        ("POST", ["sandboxes", id, "pause"]) => pause(e2b, id).await,
        ("POST", ["sandboxes", id, "resume"]) => connect(e2b, id, &body, true).await,
        ("POST", ["sandboxes", id, "connect"]) => connect(e2b, id, &body, false).await,
        (_, ["sandboxes", _, what, ..]) => match REFUSED.iter().find(|(name, _)| name == what) {
            Some((_, why)) => Err(Refusal::new(501, *why)),
            None => Err(no_route(&method, &path)),
        },
        _ => Err(no_route(&method, &path)),
    }
}

fn no_route(method: &str, path: &str) -> Refusal {
    Refusal::new(404, format!("no E2B route {method} {path} on rollbox"))
}

/// The fields of `NewSandbox` (v1) and `NewSandboxV2` rollbox uses; the rest (`secure`,
/// `autoPause`, `allow_internet_access`, `network`, ...) is accepted and ignored.
#[derive(Deserialize)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars")]
    env_vars: Option<BTreeMap<String, String>>,
}

fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, Refusal> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, format!("{what}: the JSON body is not valid: {e}")))
}

fn check_timeout(timeout: i64) -> Result<u64, Refusal> {
    u64::try_from(timeout)
        .ok()
        .filter(|t| (1..=MAX_TTL_S).contains(t))
        .ok_or_else(|| {
            Refusal::new(
                400,
                format!("timeout: {timeout} s is out of range (1 to {MAX_TTL_S} s)"),
            )
        })
}

async fn create(
    e2b: &Arc<E2b>,
    body: &[u8],
    idempotency_key: Option<String>,
) -> Result<Response<Out>, Refusal> {
    let new: NewSandbox = parse_json(body, "NewSandbox")?;
    let template = new
        .template_id
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Refusal::new(400, "templateID: required"))?;
    let ttl_s = match new.timeout {
        Some(t) => check_timeout(t)?,
        None => DEFAULT_TIMEOUT_S,
    };
    match e2b
        .daemon
        .handle(Action::GetTemplate(template.clone()))
        .await
    {
        Ok(_) => {}
        Err(ApiError::NotFound(_)) => {
            return Err(Refusal::new(
                404,
                format!(
                    "template {template:?} not found (rollbox templates: `rollbox template ls`)"
                ),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    let mut metadata = BTreeMap::new();
    if let Some(envs) = new.env_vars.filter(|e| !e.is_empty()) {
        let envs =
            serde_json::to_string(&envs).map_err(|e| Refusal::new(400, format!("envVars: {e}")))?;
        metadata.insert(ENV_VARS_KEY.to_string(), envs);
    }
    // E2B metadata is what lists filter on: rollbox labels.
    let native = json!({
        "template": template,
        "ttl_s": ttl_s,
        "labels": new.metadata.unwrap_or_default(),
        "metadata": metadata,
        "idempotency_key": idempotency_key,
    });
    let action =
        api::parse("POST", "/sandboxes", None, native.to_string().as_bytes()).map_err(|e| {
            let message = e.to_string().replacen("labels", "metadata", 1);
            let message = message.replacen("idempotency_key", "Idempotency-Key", 1);
            Refusal::new(e.status(), message)
        })?;
    let sandbox = match e2b.daemon.handle(action).await {
        Ok(Reply::Sandbox { sandbox, .. }) => sandbox,
        Ok(other) => {
            return Err(Refusal {
                no_retry: true,
                ..Refusal::new(500, format!("create answered {other:?}"))
            })
        }
        Err(e) => {
            let mut refusal = Refusal::from(e);
            // Nothing was made when the daemon was full; anything else may have made a VM.
            refusal.no_retry = refusal.status != 429;
            return Err(refusal);
        }
    };
    if sandbox.state != State::Running {
        return Err(Refusal {
            no_retry: true,
            ..Refusal::new(
                500,
                format!(
                    "sandbox {} is {}: {}",
                    sandbox.id,
                    sandbox.state.as_str(),
                    sandbox
                        .end_reason
                        .as_deref()
                        .unwrap_or("no reason recorded")
                ),
            )
        });
    }
    Ok(json(201, &sandbox_json(e2b, &sandbox)))
}

/// `Sandbox` (create, connect, resume).
fn sandbox_json(e2b: &E2b, sandbox: &Sandbox) -> Value {
    json!({
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "alias": sandbox.template,
        "clientID": "rollbox",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b.access_token(&sandbox.id),
        "domain": e2b.options.domain,
    })
}

/// `ListedSandbox`, and with `detail` the `SandboxDetail` fields on top.
fn listed_json(e2b: &E2b, sandbox: &Sandbox, detail: bool) -> Value {
    let mut value = json!({
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "alias": sandbox.template,
        "clientID": "rollbox",
        "startedAt": rfc3339(sandbox.created_at_ms),
        "endAt": rfc3339(sandbox.expires_at_ms),
        "envdVersion": ENVD_VERSION,
        "cpuCount": sandbox.vcpus,
        "memoryMB": sandbox.memory_mib,
        "diskSizeMB": 0,
        "state": if sandbox.state == State::Paused { "paused" } else { "running" },
        "metadata": sandbox.labels,
    });
    if detail {
        value["envdAccessToken"] = json!(e2b.access_token(&sandbox.id));
        value["domain"] = json!(e2b.options.domain);
    }
    value
}

/// A sandbox that is running or paused, else 404.
async fn live(e2b: &E2b, id: &str) -> Result<Sandbox, Refusal> {
    match e2b.daemon.handle(Action::GetSandbox(id.to_string())).await {
        Ok(Reply::Sandbox { sandbox, .. })
            if matches!(sandbox.state, State::Running | State::Paused) =>
        {
            Ok(sandbox)
        }
        Ok(_) | Err(ApiError::NotFound(_)) => Err(Refusal::not_found(id)),
        Err(e) => Err(e.into()),
    }
}

async fn detail(e2b: &Arc<E2b>, id: &str) -> Result<Response<Out>, Refusal> {
    let sandbox = live(e2b, id).await?;
    Ok(json(200, &listed_json(e2b, &sandbox, true)))
}

async fn kill(e2b: &Arc<E2b>, id: &str) -> Result<Response<Out>, Refusal> {
    live(e2b, id).await?;
    e2b.daemon
        .handle(Action::DeleteSandbox(id.to_string()))
        .await?;
    e2b.forget_processes(id);
    Ok(no_content())
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: Option<i64>,
}

async fn set_timeout(e2b: &Arc<E2b>, id: &str, body: &[u8]) -> Result<Response<Out>, Refusal> {
    let body: TimeoutBody = parse_json(body, "timeout body")?;
    let ttl_s = check_timeout(
        body.timeout
            .ok_or_else(|| Refusal::new(400, "timeout: required"))?,
    )?;
    live(e2b, id).await?;
    e2b.daemon
        .handle(Action::Keepalive {
            id: id.to_string(),
            ttl_s,
        })
        .await?;
    Ok(no_content())
}

async fn pause(e2b: &Arc<E2b>, id: &str) -> Result<Response<Out>, Refusal> {
    if live(e2b, id).await?.state == State::Paused {
        return Err(Refusal::new(
            409,
            format!("sandbox {id:?} is already paused"),
        ));
    }
    e2b.daemon.handle(Action::Pause(id.to_string())).await?;
    Ok(no_content())
}

/// Connect (2.1+) and resume (2.0): a paused sandbox resumes (201), a running one is
/// returned as it is (200; resume answers 409). A `timeout` moves the TTL only later.
async fn connect(
    e2b: &Arc<E2b>,
    id: &str,
    body: &[u8],
    resume_only: bool,
) -> Result<Response<Out>, Refusal> {
    let body: TimeoutBody = parse_json(body, "connect body")?;
    let ttl_s = body.timeout.map(check_timeout).transpose()?;
    let sandbox = live(e2b, id).await?;
    let resumed = sandbox.state == State::Paused;
    if resumed {
        e2b.daemon.handle(Action::Resume(id.to_string())).await?;
    } else if resume_only {
        return Err(Refusal::new(
            409,
            format!("sandbox {id:?} is already running"),
        ));
    }
    if let Some(ttl_s) = ttl_s {
        let wanted = now_ms().saturating_add(ttl_s.saturating_mul(1000));
        if wanted > sandbox.expires_at_ms {
            e2b.daemon
                .handle(Action::Keepalive {
                    id: id.to_string(),
                    ttl_s,
                })
                .await?;
        }
    }
    let sandbox = live(e2b, id).await?;
    Ok(json(
        if resumed { 201 } else { 200 },
        &sandbox_json(e2b, &sandbox),
    ))
}

/// `GET /v2/sandboxes` (paged by `nextToken`/`X-Next-Token`) and 1.x `GET /sandboxes`.
async fn list(e2b: &Arc<E2b>, query: &str, v2: bool) -> Result<Response<Out>, Refusal> {
    let mut native = ListQuery {
        limit: if v2 { 100 } else { 1000 },
        ..ListQuery::default()
    };
    let mut states = vec![State::Running, State::Paused];
    let mut template = None;
    for (name, value) in query_pairs(query) {
        match name.as_str() {
            "metadata" | "query" => {
                for (key, value) in query_pairs(&value) {
                    native.labels.push((key, value));
                }
            }
            "state" => {
                states = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| match s {
                        "running" => Ok(State::Running),
                        "paused" => Ok(State::Paused),
                        other => Err(Refusal::new(
                            400,
                            format!("state: {other:?} is not running or paused"),
                        )),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "limit" => {
                native.limit = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| {
                        Refusal::new(400, format!("limit: {value:?} is not 1 to 1000"))
                    })?;
            }
            "nextToken" if !value.is_empty() => {
                native.after = Some(value.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(
                    || {
                        Refusal::new(
                            400,
                            format!("nextToken: {value:?} is not a token this server gave"),
                        )
                    },
                )?);
            }
            "template" if !value.is_empty() => template = Some(value),
            _ => {}
        }
    }
    if let [only] = states.as_slice() {
        native.state = Some(*only);
    }
    let Reply::Sandboxes(page) = e2b.daemon.handle(Action::ListSandboxes(native)).await? else {
        return Err(Refusal::new(500, "the list answered no sandboxes"));
    };
    let listed: Vec<Value> = page
        .sandboxes
        .iter()
        .filter(|s| states.contains(&s.state))
        .filter(|s| template.as_ref().is_none_or(|t| *t == s.template))
        .map(|s| listed_json(e2b, s, false))
        .collect();
    let mut response = json(200, &Value::Array(listed));
    if let Some(next) = page.next_page_token.filter(|_| v2) {
        if let Ok(value) = hyper::header::HeaderValue::from_str(&next) {
            response.headers_mut().insert("x-next-token", value);
        }
    }
    Ok(response)
}
