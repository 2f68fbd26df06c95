//! The E2B sandbox list (`GET /v2/sandboxes`, 1.x `GET /sandboxes`): as E2B, newest first
//! (`order=asc`: oldest first), ordered across running and paused before paging, with a
//! `nextToken` that is a creation cursor. The native REST list stays oldest first. Filters:
//! `metadata` (label keys only, 400 naming another), `state`, `template`, `startedAfter`.

use std::sync::Arc;

use hyper::Response;
use serde_json::{json, Value};

use super::super::super::api::{check_label_key, Action, ListQuery, Reply, Sandbox, State};
use super::super::super::keys::Caller;
use super::super::transport::Out;
use super::refusal::Refusal;
use super::state::E2b;
use super::wire::{json, parse_rfc3339, percent_decode, query_pairs, rfc3339, ENVD_VERSION};

/// Where a list page starts: after this sandbox in the list's order. Its text is
/// `{created_at_ms}-{id}`; sandboxes made or paused meanwhile do not move a page.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Cursor {
    created_at_ms: u64,
    id: String,
}

impl Cursor {
    fn of(sandbox: &Sandbox) -> Cursor {
        Cursor {
            created_at_ms: sandbox.created_at_ms,
            id: sandbox.id.clone(),
        }
    }

    fn parse(token: &str) -> Option<Cursor> {
        let (ms, id) = token.split_once('-')?;
        Some(Cursor {
            created_at_ms: ms.parse().ok()?,
            id: id.to_string(),
        })
        .filter(|c| !c.id.is_empty())
    }

    fn token(&self) -> String {
        format!("{}-{}", self.created_at_ms, self.id)
    }
}

/// Every sandbox the native list selects for `native` (its pages, one after another).
async fn list_all(
    e2b: &E2b,
    caller: &Caller,
    mut native: ListQuery,
) -> Result<Vec<Sandbox>, Refusal> {
    native.limit = 1000;
    let mut all = Vec::new();
    loop {
        let Reply::Sandboxes(page) = e2b
            .core
            .handle_as(caller, Action::ListSandboxes(native.clone()))
            .await?
        else {
            return Err(Refusal::new(500, "the list answered no sandboxes"));
        };
        all.extend(page.sandboxes);
        match page.next_page_token.and_then(|t| t.parse::<i64>().ok()) {
            Some(after) => native.after = Some(after),
            None => return Ok(all),
        }
    }
}

/// `GET /v2/sandboxes` (paged by `nextToken`/`X-Next-Token`) and 1.x `GET /sandboxes`: as
/// E2B, newest first (`order=asc`: oldest first), ordered across running and paused before
/// paging. The native list stays oldest first.
pub(super) async fn list(
    e2b: &Arc<E2b>,
    caller: &Caller,
    query: &str,
    v2: bool,
) -> Result<Response<Out>, Refusal> {
    let mut native = ListQuery::default();
    let mut limit: usize = if v2 { 100 } else { 1000 };
    let mut after = None;
    let mut newest_first = true;
    let mut states = vec![State::Running, State::Paused];
    let mut template = None;
    let mut started_after = None;
    for (name, value) in query_pairs(query) {
        match name.as_str() {
            "metadata" | "query" => {
                // The SDK quotes each key and value before it encodes the pairs, and the
                // pairs again as the parameter: three decodes in all.
                for (key, value) in query_pairs(&value) {
                    let (key, value) = (percent_decode(&key), percent_decode(&value));
                    if !check_label_key(&key) {
                        return Err(Refusal::new(
                            400,
                            format!("{name}: key {key:?} is not a metadata key rollbox can filter on (1-63 of A-Z a-z 0-9 . _ / -, starting with a letter or digit)"),
                        ));
                    }
                    native.labels.push((key, value));
                }
            }
            "startedAfter" if !value.is_empty() => {
                started_after = Some(parse_rfc3339(&value).ok_or_else(|| {
                    Refusal::new(
                        400,
                        format!("startedAfter: {value:?} is not an RFC 3339 time (2026-12-01T02:12:26Z)"),
                    )
                })?);
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
                limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| {
                        Refusal::new(400, format!("limit: {value:?} is not 1 to 1000"))
                    })?;
            }
            "nextToken" if !value.is_empty() => {
                after = Some(Cursor::parse(&value).ok_or_else(|| {
                    Refusal::new(
                        400,
                        format!("nextToken: {value:?} is not a token this server gave"),
                    )
                })?);
            }
            "order" => {
                newest_first = match value.as_str() {
                    "" | "desc" => true,
                    "asc" => false,
                    other => {
                        return Err(Refusal::new(
                            400,
                            format!("order: {other:?} is not asc or desc"),
                        ))
                    }
                }
            }
            "template" if !value.is_empty() => template = Some(value),
            _ => {}
        }
    }
    if let [only] = states.as_slice() {
        native.state = Some(*only);
    }
    let mut sandboxes: Vec<Sandbox> = list_all(e2b, caller, native)
        .await?
        .into_iter()
        .filter(|s| states.contains(&s.state))
        .filter(|s| template.as_ref().is_none_or(|t| *t == s.template))
        .filter(|s| started_after.is_none_or(|at| s.created_at_ms >= at))
        .collect();
    sandboxes.sort_by_key(Cursor::of);
    if newest_first {
        sandboxes.reverse();
    }
    let rest: Vec<&Sandbox> = sandboxes
        .iter()
        .filter(|s| {
            after.as_ref().is_none_or(|after| {
                let at = Cursor::of(s);
                if newest_first {
                    at < *after
                } else {
                    at > *after
                }
            })
        })
        .collect();
    let page = &rest[..rest.len().min(limit)];
    let listed: Vec<Value> = page.iter().map(|s| listed_json(e2b, s, false)).collect();
    let mut response = json(200, &Value::Array(listed));
    if v2 && rest.len() > page.len() {
        if let Some(last) = page.last() {
            if let Ok(value) = hyper::header::HeaderValue::from_str(&Cursor::of(last).token()) {
                response.headers_mut().insert("x-next-token", value);
            }
        }
    }
    Ok(response)
}

/// `ListedSandbox`, and with `detail` the `SandboxDetail` fields on top.
pub(super) fn listed_json(e2b: &E2b, sandbox: &Sandbox, detail: bool) -> Value {
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
        value["domain"] = json!(e2b.domain);
        value["lifecycle"] = json!({
            "onTimeout": sandbox.on_timeout.as_str(),
            "autoResume": sandbox.auto_resume,
        });
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_cursors_round_trip_and_order_by_creation_then_id() {
        let cursor = Cursor {
            created_at_ms: 1_700_000_000_123,
            id: "sb-00ff".into(),
        };
        assert_eq!(cursor.token(), "1700000000123-sb-00ff");
        assert_eq!(Cursor::parse(&cursor.token()), Some(cursor.clone()));
        let later = Cursor {
            created_at_ms: 1_700_000_000_124,
            id: "sb-0000".into(),
        };
        assert!(cursor < later);
        for bad in ["", "12", "x-sb-1", "12-", "-sb-1"] {
            assert_eq!(Cursor::parse(bad), None, "{bad:?}");
        }
    }
}
