//! One data-plane request: the sandbox it is for and the envd user it runs as, with what every
//! envd call needs (paths resolved in the user's home, the sandbox's env, an agent connection,
//! request bodies, and failures as Connect errors).
//!
//! Who a request runs as follows envd 0.4+: a request that names no user runs as E2B's
//! default `user` (home `/home/user`) when the sandbox's rootfs has that account (image
//! builds add it, `images/account.rs`), else as root in /root; a named user runs as its own
//! account. Accounts come from the agent (`LookupUser`), once per sandbox and name.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::client::{AgentClient, ClientError};
use rollbox_agent_protocol::Account;
use serde::Deserialize;

use super::super::super::api::{ApiError, Sandbox};
use super::super::transport::Out;
use super::connect::{Code, RpcError};
use super::state::{E2b, RunAs};
use super::wire::{header, json, query_pairs, ENV_VARS_KEY};

/// envd's default keepalive interval when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// The account a request that names no user runs as, when the sandbox has it.
pub const DEFAULT_USER: &str = "user";

/// One data-plane request: the sandbox and the envd user it runs as.
pub struct Call {
    pub e2b: Arc<E2b>,
    pub sandbox: Sandbox,
    /// The account the agent runs processes as and gives uploads to; None: the agent's own
    /// (root), for a sandbox without the accounts asked for.
    pub user: Option<String>,
    /// The user's home: where relative paths and `~` resolve.
    pub home: String,
}

/// The request for `name` given its account (None: the sandbox has none). Root without an
/// account is the agent itself in /root; any other missing name keeps `/home/NAME`, and the
/// agent refuses to run as it with an error naming it.
pub fn run_as(name: &str, account: Option<Account>) -> RunAs {
    match account {
        Some(account) => RunAs {
            user: Some(name.to_string()),
            home: account.home,
        },
        None if name == "root" => RunAs {
            user: None,
            home: "/root".to_string(),
        },
        None => RunAs {
            user: Some(name.to_string()),
            home: format!("/home/{name}"),
        },
    }
}

/// The account `name` in the sandbox; None when the agent has none (or is too old to say).
async fn account(client: &AgentClient, id: &str, name: &str) -> Result<Option<Account>, RpcError> {
    match client.lookup_user(name).await {
        Ok(account) => Ok(Some(account)),
        Err(ClientError::Agent(_)) => Ok(None),
        Err(other) => Err(rpc_error(id, other)),
    }
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
    /// The request as `asked` (the `Authorization: Basic` or `?username=` user) runs it.
    pub async fn for_user(
        e2b: Arc<E2b>,
        sandbox: Sandbox,
        asked: Option<String>,
    ) -> Result<Call, RpcError> {
        let key = (sandbox.id.clone(), asked.clone());
        let cached = e2b.accounts().get(&key).cloned();
        let resolved = match cached {
            Some(resolved) => resolved,
            None => {
                let client = e2b.core.agent(&sandbox.id).await.map_err(api_rpc_error)?;
                let id = sandbox.id.as_str();
                let resolved = match asked.as_deref() {
                    Some(name) => run_as(name, account(&client, id, name).await?),
                    None => match account(&client, id, DEFAULT_USER).await? {
                        Some(found) => run_as(DEFAULT_USER, Some(found)),
                        None => run_as("root", account(&client, id, "root").await?),
                    },
                };
                let _ = client.close().await;
                e2b.remember_account(key, resolved.clone());
                resolved
            }
        };
        Ok(Call {
            e2b,
            sandbox,
            user: resolved.user,
            home: resolved.home,
        })
    }

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
        self.home.clone()
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
    pub async fn with_query_user(&self, query: &str) -> Result<Call, RpcError> {
        match query_value(query, "username").filter(|u| !u.is_empty()) {
            Some(user) => {
                Call::for_user(Arc::clone(&self.e2b), self.sandbox.clone(), Some(user)).await
            }
            None => Ok(Call {
                e2b: Arc::clone(&self.e2b),
                sandbox: self.sandbox.clone(),
                user: self.user.clone(),
                home: self.home.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(home: &str) -> Account {
        Account {
            name: "x".into(),
            uid: 1000,
            gid: 1000,
            home: home.into(),
            shell: "/bin/sh".into(),
        }
    }

    #[test]
    fn users_resolve_to_their_accounts_homes() {
        assert_eq!(
            run_as("user", Some(account("/home/user"))),
            RunAs {
                user: Some("user".into()),
                home: "/home/user".into()
            }
        );
        // The host agent's test mapping: `user` with a scratch home.
        assert_eq!(run_as("user", Some(account("/tmp/s"))).home, "/tmp/s");
        assert_eq!(
            run_as("root", Some(account("/root"))).user.as_deref(),
            Some("root")
        );
    }

    #[test]
    fn missing_accounts_fall_back() {
        // No root in passwd: the agent's own user, in /root.
        assert_eq!(
            run_as("root", None),
            RunAs {
                user: None,
                home: "/root".into()
            }
        );
        // Another missing name is kept: the agent refuses it, naming it.
        assert_eq!(
            run_as("alice", None),
            RunAs {
                user: Some("alice".into()),
                home: "/home/alice".into()
            }
        );
    }
}
