//! E2B's control plane: REST with `X-API-KEY`, for SDK 2.51+ (`/v2/sandboxes`), 2.0-2.50
//! (`POST /sandboxes`, `/connect`, `/resume`) and 1.x (`GET /sandboxes`), and volumes
//! (`volumes.rs`). Each route runs the daemon's own actions; every error body is
//! `{"code","message"}`.

use std::collections::BTreeMap;
use std::sync::Arc;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::super::api::{
    self, Action, ApiError, Reply, Sandbox, State, MAX_BODY, MAX_TTL_S,
};
use super::super::super::keys::Caller;
use super::super::super::supervisor;
use super::super::super::util::now_ms;
use super::super::transport::Out;
use super::envd::public_traffic;
use super::list::listed_json;
use super::refusal::{parse_json, Refusal};
use super::state::E2b;
use super::wire::{
    header, json, no_content, query_pairs, rfc3339, DEFAULT_TIMEOUT_S, ENVD_VERSION,
    PUBLIC_TRAFFIC_KEY,
};

/// Forks per E2B fork call (the SDK checks 1 to 20 itself).
const MAX_E2B_FORK: i64 = 20;

pub async fn respond(e2b: &Arc<E2b>, request: Request<Incoming>) -> Response<Out> {
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

/// Who the request's `X-API-KEY` (or `Authorization: Bearer`) belongs to, if anyone.
fn caller(e2b: &E2b, request: &Request<Incoming>) -> Option<Caller> {
    let given = header(request, "x-api-key")
        .or_else(|| header(request, "authorization").and_then(|v| v.strip_prefix("Bearer ")));
    given.and_then(|given| e2b.core.authenticate(given))
}

/// Every route: the key is checked first, before the body is read or any state is touched;
/// each handler then runs its actions as the key's caller.
async fn route(e2b: &Arc<E2b>, request: Request<Incoming>) -> Result<Response<Out>, Refusal> {
    // Volume content calls carry a volume's token (or a key) and stream their bodies.
    if request.uri().path().starts_with("/volumecontent/") {
        return super::volumes::content(e2b, request).await;
    }
    let Some(caller) = caller(e2b, &request) else {
        return Err(Refusal::new(
            401,
            "missing or wrong API key: send a rollbox API key as X-API-KEY (E2B_API_KEY)",
        ));
    };
    let caller = &caller;
    let method = request.method().as_str().to_string();
    let path = request.uri().path().trim_end_matches('/').to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let idempotency_key = header(&request, "idempotency-key").map(str::to_string);
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
        ("POST", ["sandboxes"]) => create(e2b, caller, &body, idempotency_key).await,
        ("GET", ["sandboxes"]) => super::list::list(e2b, caller, &query, v2).await,
        ("GET", ["sandboxes", "metrics"]) => metrics_of_many(e2b, caller, &query).await,
        ("GET", ["sandboxes", id, "metrics"]) => metrics(e2b, caller, id, &query).await,
        ("POST", ["sandboxes", id, "fork"]) => fork(e2b, caller, id, &body).await,
        ("POST", ["sandboxes", id, "snapshots"]) => snapshot(e2b, caller, id, &body).await,
        ("POST", ["sandboxes", id, "refreshes"]) => refresh(e2b, caller, id, &body).await,
        ("POST", ["volumes"]) => super::volumes::create(e2b, caller, &body).await,
        ("GET", ["volumes"]) => super::volumes::list(e2b, caller).await,
        ("GET", ["volumes", id]) => super::volumes::get(e2b, caller, id).await,
        ("DELETE", ["volumes", id]) => super::volumes::delete(e2b, caller, id).await,
        ("GET", ["snapshots"]) => list_snapshots(e2b, caller, &query).await,
        ("DELETE", ["templates", id]) => delete_snapshot(e2b, caller, id).await,
        ("GET", ["sandboxes", id]) => detail(e2b, caller, id).await,
        ("DELETE", ["sandboxes", id]) => kill(e2b, caller, id).await,
        ("POST", ["sandboxes", id, "timeout"]) => set_timeout(e2b, caller, id, &body).await,
        ("POST", ["sandboxes", id, "pause"]) => pause(e2b, caller, id).await,
        ("POST", ["sandboxes", id, "resume"]) => connect(e2b, caller, id, &body, true).await,
        ("POST", ["sandboxes", id, "connect"]) => connect(e2b, caller, id, &body, false).await,
        ("PUT", ["sandboxes", id, "network"]) => {
            super::network::update(e2b, caller, id, &body).await
        }
        _ => Err(no_route(&method, &path)),
    }
}

fn no_route(method: &str, path: &str) -> Refusal {
    Refusal::new(404, format!("no E2B route {method} {path} on rollbox"))
}

/// The fields of `NewSandbox` (v1) and `NewSandboxV2` rollbox uses; the rest (`secure`: envd
/// always takes its token, `mcp`, ...) is accepted and ignored.
#[derive(Deserialize)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars")]
    env_vars: Option<BTreeMap<String, String>>,
    /// `lifecycle.on_timeout: "pause"`.
    #[serde(rename = "autoPause")]
    auto_pause: Option<bool>,
    /// false: the timeout's pause keeps only the filesystem (not served).
    #[serde(rename = "autoPauseMemory")]
    auto_pause_memory: Option<bool>,
    #[serde(rename = "autoResume")]
    auto_resume: Option<AutoResume>,
    network: Option<Network>,
    /// false: no egress (`network.rs`).
    allow_internet_access: Option<bool>,
    /// Named volumes (the daemon's own, POST /volumes) mounted at their paths.
    #[serde(default, rename = "volumeMounts")]
    volume_mounts: Option<Vec<VolumeMount>>,
}

/// `SandboxVolumeMount`.
#[derive(Deserialize)]
struct VolumeMount {
    name: String,
    path: String,
}

/// `SandboxNetworkConfig`: `allowPublicTraffic` (null or absent: public), and the egress
/// options of `network.rs`.
#[derive(Deserialize)]
struct Network {
    #[serde(rename = "allowPublicTraffic", alias = "allow_public_traffic")]
    allow_public_traffic: Option<bool>,
    #[serde(flatten)]
    egress: super::network::NetworkOptions,
}

/// `SandboxAutoResumeConfig`.
#[derive(Deserialize)]
struct AutoResume {
    enabled: bool,
}

/// The native `on_timeout` and `auto_resume` of a create's lifecycle fields.
fn lifecycle(new: &NewSandbox) -> Result<(&'static str, bool), Refusal> {
    let pause = new.auto_pause == Some(true);
    if new.auto_pause_memory == Some(false) {
        return Err(Refusal::new(
            400,
            "autoPauseMemory: false (a filesystem-only pause on timeout) is not served: a rollbox pause keeps the VM's memory and disk; leave the mode unset or \"full\"",
        ));
    }
    let resume = new.auto_resume.as_ref().is_some_and(|r| r.enabled);
    if resume && !pause {
        return Err(Refusal::new(
            400,
            "autoResume: enabled needs autoPause: true (lifecycle on_timeout \"pause\")",
        ));
    }
    Ok((if pause { "pause" } else { "kill" }, resume))
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
    caller: &Caller,
    body: &[u8],
    idempotency_key: Option<String>,
) -> Result<Response<Out>, Refusal> {
    let new: NewSandbox = parse_json(body, "NewSandbox")?;
    let (on_timeout, auto_resume) = lifecycle(&new)?;
    // A sandbox that is not public keeps that in its native metadata (envd.rs reads it).
    let public = new
        .network
        .as_ref()
        .and_then(|n| n.allow_public_traffic)
        .unwrap_or(true);
    let native_metadata = if public {
        json!({})
    } else {
        json!({ PUBLIC_TRAFFIC_KEY: "false" })
    };
    let template = new
        .template_id
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Refusal::new(400, "templateID: required"))?;
    let ttl_s = match new.timeout {
        // E2B's 0 keeps the sandbox until it is killed; every rollbox sandbox has a TTL.
        Some(0) => {
            return Err(Refusal::new(
                400,
                format!(
                    "timeout: 0 (keep the sandbox until it is killed) is not served: every rollbox sandbox has a TTL; pass 1 to {MAX_TTL_S} s and extend it with set_timeout"
                ),
            ))
        }
        Some(t) => check_timeout(t)?,
        None => DEFAULT_TIMEOUT_S,
    };
    // `templateID` is a template's name, or (`Sandbox.create(snapshot_id)`) a snapshot's id
    // or name: a template's name first, as E2B's one namespace of both.
    // Whether the template (or snapshot) gives its sandboxes a network.
    let mut networked = false;
    let snapshot = if api::check_snapshot_id(&template, "templateID").is_ok() {
        Some(snapshot_of(e2b, caller, &template).await?)
    } else {
        match e2b.core.handle_as(caller, Action::GetTemplate(template.clone())).await {
            Ok(Reply::Template { template, .. }) => {
                networked = template.network.is_some();
                None
            }
            Ok(_) => None,
            Err(ApiError::NotFound(_)) => {
                Some(snapshot_of(e2b, caller, &template).await.map_err(|refusal| match refusal.status {
                    404 => Refusal::new(
                        404,
                        format!("template {template:?} not found (rollbox templates: `rollbox template ls`; snapshots: GET /snapshots)"),
                    ),
                    _ => refusal,
                })?)
            }
            Err(e) => return Err(e.into()),
        }
    };
    // A restore keeps the env its sandbox had (E2B's envd holds envVars in the memory the
    // snapshot saved); the create's envVars go on top.
    let mut env = match &snapshot {
        Some(snapshot) => {
            match e2b
                .core
                .handle_as(caller, Action::GetSandbox(snapshot.sandbox.clone()))
                .await
            {
                Ok(Reply::Sandbox { sandbox, .. }) => sandbox.env,
                _ => BTreeMap::new(),
            }
        }
        None => BTreeMap::new(),
    };
    env.extend(new.env_vars.unwrap_or_default());
    networked |= snapshot.as_ref().is_some_and(|s| s.network.is_some());
    // E2B's egress options set the network's policy. A template without a network keeps
    // its sandboxes without one (no internet, whatever is asked) unless allowOut names
    // destinations: then the sandbox gets a network (and boots).
    let options = new.network.as_ref().map(|n| &n.egress);
    let egress = super::network::egress(
        new.allow_internet_access,
        options.unwrap_or(&Default::default()),
    )?;
    let wants_reach = options.is_some_and(|o| o.allow_out.as_ref().is_some_and(|a| !a.is_empty()));
    let native_network = egress
        .filter(|_| networked || wants_reach)
        .map(|egress| json!({ "egress": egress }));
    // E2B metadata is what lists filter on: rollbox labels. envVars are the sandbox's env,
    // which the daemon merges under every exec's own (forks inherit it).
    let (template, snapshot) = match snapshot {
        Some(snapshot) => (None, Some(snapshot.id)),
        None => (Some(template), None),
    };
    let volumes: Vec<Value> = new
        .volume_mounts
        .unwrap_or_default()
        .into_iter()
        .map(|m| json!({"name": m.name, "mount_path": m.path}))
        .collect();
    let mut native = json!({
        "template": template,
        "snapshot": snapshot,
        "ttl_s": ttl_s,
        "labels": new.metadata.unwrap_or_default(),
        "metadata": native_metadata,
        "env": env,
        "idempotency_key": idempotency_key,
        "on_timeout": on_timeout,
        "auto_resume": auto_resume,
    });
    if !volumes.is_empty() {
        native["volumes"] = Value::Array(volumes);
    }
    if let Some(network) = native_network {
        native["network"] = network;
    }
    let action = api::parse("POST", "/sandboxes", None, native.to_string().as_bytes())
        .map_err(|e| Refusal::new(e.status(), e2b_fields(&e.to_string())))?;
    let sandbox = match e2b.core.handle_as(caller, action).await {
        Ok(Reply::Sandbox { sandbox, .. }) => sandbox,
        Ok(other) => {
            return Err(Refusal {
                no_retry: true,
                ..Refusal::new(500, format!("create answered {other:?}"))
            })
        }
        Err(e) => {
            let mut refusal = Refusal::from(e);
            // The create's own words for its fields (`volumes[0].name: no volume ...`).
            if refusal.status == 400 {
                refusal.message = e2b_fields(&refusal.message);
            }
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

/// A native create's refusal in E2B's field names (the field is what precedes the ':').
fn e2b_fields(message: &str) -> String {
    match message.split_once(':') {
        Some((field, rest)) => {
            let field = field
                .replacen("labels", "metadata", 1)
                .replacen("env", "envVars", 1)
                .replacen("idempotency_key", "Idempotency-Key", 1)
                .replacen("volumes", "volumeMounts", 1)
                .replacen("mount_path", "path", 1)
                .replacen("network.egress", "network.allowOut", 1);
            format!("{field}:{rest}")
        }
        None => message.to_string(),
    }
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
        "trafficAccessToken": (!public_traffic(sandbox)).then(|| e2b.traffic_token(&sandbox.id)),
        "domain": e2b.domain,
    })
}

/// A snapshot by id or name, else 404.
async fn snapshot_of(
    e2b: &E2b,
    caller: &Caller,
    id_or_name: &str,
) -> Result<api::Snapshot, Refusal> {
    match e2b
        .core
        .handle_as(caller, Action::GetSnapshot(id_or_name.to_string()))
        .await
    {
        Ok(Reply::Snapshot { snapshot, .. }) => Ok(snapshot),
        Ok(other) => Err(Refusal::new(
            500,
            format!("snapshot lookup answered {other:?}"),
        )),
        Err(ApiError::NotFound(_)) => Err(Refusal::new(
            404,
            format!("snapshot {id_or_name:?} not found (rollbox snapshots: GET /snapshots)"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// A running sandbox; a paused one is a 409 that says to resume it `before` the call, and any
/// other a 404.
async fn running(e2b: &E2b, caller: &Caller, id: &str, before: &str) -> Result<Sandbox, Refusal> {
    let sandbox = live(e2b, caller, id).await?;
    if sandbox.state != State::Running {
        return Err(Refusal::new(
            409,
            format!("sandbox {id:?} is paused: connect to resume it before {before}"),
        ));
    }
    Ok(sandbox)
}

/// A sandbox that is running or paused, else 404.
async fn live(e2b: &E2b, caller: &Caller, id: &str) -> Result<Sandbox, Refusal> {
    match e2b
        .core
        .handle_as(caller, Action::GetSandbox(id.to_string()))
        .await
    {
        Ok(Reply::Sandbox { sandbox, .. })
            if matches!(sandbox.state, State::Running | State::Paused) =>
        {
            Ok(sandbox)
        }
        Ok(_) | Err(ApiError::NotFound(_)) => Err(Refusal::not_found(id)),
        Err(e) => Err(e.into()),
    }
}

async fn detail(e2b: &Arc<E2b>, caller: &Caller, id: &str) -> Result<Response<Out>, Refusal> {
    let sandbox = live(e2b, caller, id).await?;
    Ok(json(200, &listed_json(e2b, &sandbox, true)))
}

async fn kill(e2b: &Arc<E2b>, caller: &Caller, id: &str) -> Result<Response<Out>, Refusal> {
    live(e2b, caller, id).await?;
    e2b.core
        .handle_as(caller, Action::DeleteSandbox(id.to_string()))
        .await?;
    e2b.forget_processes(id);
    Ok(no_content())
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: Option<i64>,
}

async fn set_timeout(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let body: TimeoutBody = parse_json(body, "timeout body")?;
    let ttl_s = check_timeout(
        body.timeout
            .ok_or_else(|| Refusal::new(400, "timeout: required"))?,
    )?;
    live(e2b, caller, id).await?;
    e2b.core
        .handle_as(
            caller,
            Action::Keepalive {
                id: id.to_string(),
                ttl_s,
            },
        )
        .await?;
    Ok(no_content())
}

async fn pause(e2b: &Arc<E2b>, caller: &Caller, id: &str) -> Result<Response<Out>, Refusal> {
    if live(e2b, caller, id).await?.state == State::Paused {
        return Err(Refusal::new(
            409,
            format!("sandbox {id:?} is already paused"),
        ));
    }
    e2b.core
        .handle_as(caller, Action::Pause(id.to_string()))
        .await?;
    Ok(no_content())
}

/// Connect (2.1+) and resume (2.0): a paused sandbox resumes (201), a running one is
/// returned as it is (200; resume answers 409). A `timeout` moves the TTL only later.
async fn connect(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
    resume_only: bool,
) -> Result<Response<Out>, Refusal> {
    let body: TimeoutBody = parse_json(body, "connect body")?;
    let ttl_s = body.timeout.map(check_timeout).transpose()?;
    let mut sandbox = live(e2b, caller, id).await?;
    let resumed = sandbox.state == State::Paused;
    if resumed {
        // The daemon's resume gives an `on_timeout: pause` sandbox its create TTL again.
        e2b.core
            .handle_as(caller, Action::Resume(id.to_string()))
            .await?;
        sandbox = live(e2b, caller, id).await?;
    } else if resume_only {
        return Err(Refusal::new(
            409,
            format!("sandbox {id:?} is already running"),
        ));
    }
    if let Some(ttl_s) = ttl_s {
        let wanted = now_ms().saturating_add(ttl_s.saturating_mul(1000));
        if wanted > sandbox.expires_at_ms {
            e2b.core
                .handle_as(
                    caller,
                    Action::Keepalive {
                        id: id.to_string(),
                        ttl_s,
                    },
                )
                .await?;
        }
    }
    let sandbox = live(e2b, caller, id).await?;
    Ok(json(
        if resumed { 201 } else { 200 },
        &sandbox_json(e2b, &sandbox),
    ))
}

#[derive(Deserialize)]
struct ForkRequest {
    timeout: Option<i64>,
    count: Option<i64>,
}

/// `POST /sandboxes/{id}/fork`: the daemon's fork (one snapshot, `count` restores). Without a
/// `timeout` the forks get what the parent has left; they keep its metadata and envVars.
async fn fork(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let request: ForkRequest = parse_json(body, "SandboxForkRequest")?;
    let count = request.count.unwrap_or(1);
    let count = u32::try_from(count)
        .ok()
        .filter(|c| (1..=MAX_E2B_FORK).contains(&i64::from(*c)))
        .ok_or_else(|| {
            Refusal::new(
                400,
                format!("count: {count} is out of range (1 to {MAX_E2B_FORK})"),
            )
        })?;
    let ttl_s = request.timeout.map(check_timeout).transpose()?;
    let parent = running(e2b, caller, id, "forking").await?;
    let reply = e2b
        .core
        .handle_as(
            caller,
            Action::Fork {
                id: id.to_string(),
                count,
                ttl_s,
                labels: parent.labels.clone(),
            },
        )
        .await?;
    let Reply::Forked(results) = reply else {
        return Err(Refusal::new(500, format!("fork answered {reply:?}")));
    };
    let results: Vec<Value> = results
        .iter()
        .map(|result| match (&result.sandbox, &result.error) {
            (Some(sandbox), None) => json!({ "sandbox": sandbox_json(e2b, sandbox) }),
            (_, error) => json!({ "error": {
                "code": 500,
                "message": error.as_deref().unwrap_or("the fork made no sandbox"),
            }}),
        })
        .collect();
    Ok(json(201, &Value::Array(results)))
}

#[derive(Deserialize)]
struct SnapshotRequest {
    name: Option<String>,
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`: a full (memory and disk) snapshot; the sandbox runs on.
async fn snapshot(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let request: SnapshotRequest = parse_json(body, "SandboxSnapshotRequest")?;
    let name = request
        .name
        .map(|n| api::check_snapshot_name(&n, "name"))
        .transpose()?;
    if request.memory == Some(false) {
        return Err(Refusal::new(
            400,
            "memory: false (filesystem-only snapshots) is not served; rollbox snapshots keep memory and disk",
        ));
    }
    running(e2b, caller, id, "a snapshot").await?;
    let reply = e2b
        .core
        .handle_as(
            caller,
            Action::Snapshot {
                id: id.to_string(),
                stop: false,
                ttl_s: None,
                name,
            },
        )
        .await?;
    let Reply::Snapshot { snapshot, .. } = reply else {
        return Err(Refusal::new(500, format!("snapshot answered {reply:?}")));
    };
    Ok(json(201, &snapshot_json(&snapshot)))
}

/// `SnapshotInfo`: its id, and its name (the id when it has none).
fn snapshot_json(snapshot: &api::Snapshot) -> Value {
    json!({
        "snapshotID": snapshot.id,
        "names": [snapshot.name.as_deref().unwrap_or(&snapshot.id)],
    })
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`, oldest first; the token is an offset.
async fn list_snapshots(
    e2b: &Arc<E2b>,
    caller: &Caller,
    query: &str,
) -> Result<Response<Out>, Refusal> {
    let (mut sandbox, mut name, mut limit, mut offset) = (None, None, 100usize, 0usize);
    for (key, value) in query_pairs(query) {
        match key.as_str() {
            "sandboxID" if !value.is_empty() => sandbox = Some(value),
            "name" if !value.is_empty() => name = Some(value),
            "limit" => {
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| {
                        Refusal::new(400, format!("limit: {value:?} is not 1 to 1000"))
                    })?;
            }
            "nextToken" if !value.is_empty() => {
                offset = value.parse().map_err(|_| {
                    Refusal::new(
                        400,
                        format!("nextToken: {value:?} is not a token this server gave"),
                    )
                })?;
            }
            _ => {}
        }
    }
    let Reply::Snapshots(mut snapshots) = e2b
        .core
        .handle_as(caller, Action::ListSnapshots { sandbox })
        .await?
    else {
        return Err(Refusal::new(500, "the snapshot list answered no snapshots"));
    };
    // By id or name; a tag (`name:latest`, E2B's only one here) names the snapshot itself.
    let name = name.map(|n| n.strip_suffix(":latest").map(str::to_string).unwrap_or(n));
    snapshots.retain(|s| {
        name.as_ref()
            .is_none_or(|n| *n == s.id || s.name.as_ref() == Some(n))
    });
    snapshots.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    let page: Vec<Value> = snapshots
        .iter()
        .skip(offset)
        .take(limit)
        .map(snapshot_json)
        .collect();
    let mut response = json(200, &Value::Array(page));
    if offset.saturating_add(limit) < snapshots.len() {
        let next = (offset + limit).to_string();
        if let Ok(value) = hyper::header::HeaderValue::from_str(&next) {
            response.headers_mut().insert("x-next-token", value);
        }
    }
    Ok(response)
}

/// `DELETE /templates/{id}`, which the SDK's `delete_snapshot` calls: snapshots only, by
/// id or name.
async fn delete_snapshot(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
) -> Result<Response<Out>, Refusal> {
    // The native delete is idempotent; E2B's answers 404 for a snapshot that is gone.
    let snapshot = snapshot_of(e2b, caller, id).await.map_err(|refusal| match refusal.status {
        404 => Refusal::new(
            404,
            format!("snapshot {id:?} not found (rollbox deletes only snapshots, by id or name, through the E2B API; templates with `rollbox template rm`)"),
        ),
        _ => refusal,
    })?;
    e2b.core
        .handle_as(caller, Action::DeleteSnapshot(snapshot.id))
        .await?;
    Ok(no_content())
}

#[derive(Deserialize)]
struct RefreshRequest {
    duration: Option<i64>,
}

/// `POST /sandboxes/{id}/refreshes`: keep it alive `duration` s from now (never shorter).
async fn refresh(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let request: RefreshRequest = parse_json(body, "SandboxRefreshRequest")?;
    let ttl_s = match request.duration {
        Some(d) => check_timeout(d).map_err(|r| Refusal {
            message: r.message.replacen("timeout", "duration", 1),
            ..r
        })?,
        None => DEFAULT_TIMEOUT_S,
    };
    let sandbox = live(e2b, caller, id).await?;
    if now_ms().saturating_add(ttl_s.saturating_mul(1000)) > sandbox.expires_at_ms {
        e2b.core
            .handle_as(
                caller,
                Action::Keepalive {
                    id: id.to_string(),
                    ttl_s,
                },
            )
            .await?;
    }
    Ok(no_content())
}

/// One `SandboxMetric` now, from the host: CPU is the VMM's CPU time over its running time
/// (an average since start, in % of its vCPUs), memory the VMM's resident set (guest pages
/// it touched), disk the sandbox's rootfs file (allocated and apparent size; 0 without one).
async fn metric_now(e2b: &E2b, caller: &Caller, sandbox: &Sandbox) -> Result<Value, Refusal> {
    let usage = match e2b
        .core
        .handle_as(caller, Action::Usage(sandbox.id.clone()))
        .await?
    {
        Reply::Usage(usage) => usage,
        other => return Err(Refusal::new(500, format!("usage answered {other:?}"))),
    };
    let capacity_s = (usage.running_s as f64) * f64::from(sandbox.vcpus.max(1));
    let cpu_used_pct = if capacity_s > 0.0 {
        (usage.cpu_seconds / capacity_s * 100.0).clamp(0.0, 100.0)
    } else {
        0.0
    };
    let mem_used = sandbox.pid.and_then(resident_bytes).unwrap_or(0);
    let (disk_used, disk_total) = supervisor::rootfs_usage(&sandbox.dir).unwrap_or((0, 0));
    let now = now_ms();
    Ok(json!({
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": sandbox.vcpus,
        "cpuUsedPct": (cpu_used_pct * 100.0).round() / 100.0,
        "memUsed": mem_used,
        "memTotal": u64::from(sandbox.memory_mib) * 1024 * 1024,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": disk_total,
    }))
}

/// VmRSS of process `pid`, in bytes.
fn resident_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: rollbox keeps no history, so the answer is the
/// one sample of now, or none when now is outside [start, end].
async fn metrics(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    query: &str,
) -> Result<Response<Out>, Refusal> {
    let now_s = now_ms() / 1000;
    for (key, value) in query_pairs(query) {
        let bound = || {
            value
                .parse::<u64>()
                .map_err(|_| Refusal::new(400, format!("{key}: {value:?} is not unix seconds")))
        };
        match key.as_str() {
            "start" if bound()? > now_s => return Ok(json(200, &json!([]))),
            "end" if bound()? < now_s => return Ok(json(200, &json!([]))),
            _ => {}
        }
    }
    let sandbox = live(e2b, caller, id).await?;
    Ok(json(
        200,
        &json!([metric_now(e2b, caller, &sandbox).await?]),
    ))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: `{"sandboxes": {id: SandboxMetric}}` for the
/// live ones among them.
async fn metrics_of_many(
    e2b: &Arc<E2b>,
    caller: &Caller,
    query: &str,
) -> Result<Response<Out>, Refusal> {
    let ids: Vec<String> = query_pairs(query)
        .into_iter()
        .filter(|(key, _)| key == "sandbox_ids")
        .flat_map(|(_, value)| {
            value
                .split(',')
                .filter(|id| !id.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    if ids.is_empty() {
        return Err(Refusal::new(
            400,
            "sandbox_ids: required (comma-separated sandbox ids)",
        ));
    }
    let mut sandboxes = serde_json::Map::new();
    for id in ids {
        match live(e2b, caller, &id).await {
            Ok(sandbox) => {
                sandboxes.insert(id, metric_now(e2b, caller, &sandbox).await?);
            }
            Err(refusal) if refusal.status == 404 => {}
            Err(refusal) => return Err(refusal),
        }
    }
    Ok(json(200, &json!({ "sandboxes": sandboxes })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lifecycle_of(body: &str) -> Result<(&'static str, bool), String> {
        let new: NewSandbox = parse_json(body.as_bytes(), "NewSandbox").map_err(|r| r.message)?;
        lifecycle(&new).map_err(|r| format!("{} {}", r.status, r.message))
    }

    #[test]
    fn lifecycle_fields_become_on_timeout_and_auto_resume() {
        for (body, want) in [
            (r#"{"templateID":"t"}"#, ("kill", false)),
            (r#"{"templateID":"t","autoPause":false}"#, ("kill", false)),
            (r#"{"templateID":"t","autoPause":true}"#, ("pause", false)),
            (
                r#"{"templateID":"t","autoPause":true,"autoPauseMemory":true,"autoResume":{"enabled":true}}"#,
                ("pause", true),
            ),
            (
                r#"{"templateID":"t","autoPause":false,"autoResume":{"enabled":false}}"#,
                ("kill", false),
            ),
        ] {
            assert_eq!(lifecycle_of(body), Ok(want), "{body}");
        }
        for (body, field) in [
            (
                r#"{"templateID":"t","autoPause":true,"autoPauseMemory":false}"#,
                "400 autoPauseMemory",
            ),
            (
                r#"{"templateID":"t","autoResume":{"enabled":true}}"#,
                "400 autoResume",
            ),
        ] {
            let message = lifecycle_of(body).expect_err(body);
            assert!(message.starts_with(field), "{body}: {message}");
        }
    }
}
