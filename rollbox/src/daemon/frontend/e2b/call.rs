//! One data-plane request: the sandbox it is for and the envd user it runs as, with what every
//! envd call needs (paths resolved in the user's home, the sandbox's env, an agent connection,
//! request bodies, and failures as Connect errors).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::client::{AgentClient, ClientError};
use serde::Deserialize;

use super::super::super::api::{ApiError, Sandbox};
use super::super::transport::Out;
use super::connect::{Code, RpcError};
use super::state::E2b;
use super::wire::{header, json, query_pairs, ENV_VARS_KEY};

/// envd's default keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// One data-plane request: the sandbox and the envd user it runs as.
pub struct Call {
    pub e2b: Arc<E2b>,
    pub sandbox: Sandbox,
    pub user: Option<String>,
}

pub fn decode<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, RpcError> {
    let body = if body.is_empty() { &b"{}"[..] } else { body };
    serde_json::from_slice(body)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("{what}: {e}")))
}

pub async fn read_body(request: Request<Incoming>, limit: usize) -> Result<Bytes, String> {
    Limited::new(request.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                format!("the request body is over {limit} bytes")
            } else {
                format!("cannot read the request body: {e}")
            }
        })
}

pub fn unary_error(error: &RpcError) -> Response<Out> {
    json(error.code.http_status(), &error.body())
}

/// An agent failure as a Connect error.
pub fn rpc_error(id: &str, error: ClientError) -> RpcError {
    match error {
        ClientError::Agent(info) => {
            let code = match info.code.as_str() {
                "ENOENT" => Code::NotFound,
                "EEXIST" | "ENOTEMPTY" => Code::AlreadyExists,
                "EACCES" | "EPERM" => Code::PermissionDenied,
                "bad_request" | "EINVAL" | "EISDIR" | "ENOTDIR" | "ENAMETOOLONG" | "ELOOP" => {
                    Code::InvalidArgument
                }
                _ => Code::Internal,
            };
            RpcError::new(code, info.message)
        }
        other => RpcError::new(
            Code::Unavailable,
            format!("sandbox {id}: the agent: {other}"),
        ),
    }
}

/// A daemon refusal as a Connect error.
pub fn api_rpc_error(error: ApiError) -> RpcError {
    let code = match error.status() {
        400 => Code::InvalidArgument,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    RpcError::new(code, error.to_string())
}

/// The keepalive interval a stream asked for (`Keepalive-Ping-Interval`, seconds).
pub fn keepalive_of(request: &Request<Incoming>) -> Duration {
    header(request, "keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_KEEPALIVE, Duration::from_secs)
}

/// A 200 answer of Connect envelopes.
pub fn connect_stream_response(body: Out) -> Response<Out> {
    let mut response = Response::new(body);
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/connect+json"),
    );
    response
}

pub fn query_value(query: &str, name: &str) -> Option<String> {
    query_pairs(query)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

impl Call {
    pub fn id(&self) -> &str {
        &self.sandbox.id
    }

    /// The sandbox's env; sandboxes made before E2B envVars became the daemon's env kept
    /// them as JSON in metadata [`ENV_VARS_KEY`].
    pub fn env_vars(&self) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> = self
            .sandbox
            .metadata
            .get(ENV_VARS_KEY)
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        env.extend(self.sandbox.env.clone());
        env
    }

    /// The user's home: where relative paths and `~` resolve.
    pub fn home(&self) -> String {
        match self.user.as_deref() {
            None | Some("root") => "/root".to_string(),
            Some(user) => format!("/home/{user}"),
        }
    }

    pub fn resolve(&self, path: &str) -> String {
        let home = self.home();
        if path.is_empty() || path == "~" {
            home
        } else if let Some(rest) = path.strip_prefix("~/") {
            format!("{home}/{rest}")
        } else if path.starts_with('/') {
            path.to_string()
        } else {
            format!("{home}/{path}")
        }
    }

    pub async fn agent(&self) -> Result<AgentClient, RpcError> {
        self.e2b.core.agent(self.id()).await.map_err(api_rpc_error)
    }

    /// The same call as the `?username=` user, when the query names one.
    pub fn with_query_user(&self, query: &str) -> Call {
        Call {
            e2b: Arc::clone(&self.e2b),
            sandbox: self.sandbox.clone(),
            user: query_value(query, "username")
                .filter(|u| !u.is_empty())
                .or_else(|| self.user.clone()),
        }
    }
}
