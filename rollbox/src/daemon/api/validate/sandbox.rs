//! Sandboxes: create (one, or a batch), list and bulk-delete queries, keepalive, ports.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::super::limits::{
    DEFAULT_LIST_LIMIT, MAX_BATCH, MAX_GPU_COUNT, MAX_GPU_WAIT_S, MAX_IDS, MAX_LIST_LIMIT,
    MAX_MEMORY_MIB, MAX_METADATA, MAX_VCPUS, MIN_CPU_LIMIT,
};
use super::super::model::{CreateSandbox, GpuRequest, ListQuery, OnTimeout, State, VolumeMount};
use super::template::check_template_name;
use super::{
    bad, check_env, check_id, check_label_key, check_labels, check_snapshot_id, from_json,
    in_range, percent_decode, ttl,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    template: Option<String>,
    snapshot: Option<String>,
    vcpus: Option<i64>,
    memory_mib: Option<i64>,
    ttl_s: Option<i64>,
    idle_ttl_s: Option<i64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    idempotency_key: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cpu_limit: Option<f64>,
    #[serde(default)]
    deterministic: bool,
    on_timeout: Option<String>,
    #[serde(default)]
    auto_resume: bool,
    #[serde(default)]
    volumes: Vec<VolumeMount>,
    gpu: Option<String>,
    gpu_count: Option<i64>,
    gpu_wait_s: Option<i64>,
    network: Option<super::network::NetworkBody>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeepaliveBody {
    ttl_s: i64,
}

/// POST /sandboxes: from a template (boot) or a snapshot (restore).
pub fn parse_create(body: &[u8]) -> Result<CreateSandbox, ApiError> {
    let body: CreateBody = from_json(body)?;
    check_labels(&body.labels)?;
    check_env(&body.env)?;
    if body.metadata.len() > MAX_METADATA
        || body
            .metadata
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > 4096)
    {
        return Err(bad(format!(
            "metadata: at most {MAX_METADATA} entries, keys of 1-128 bytes, values of at most 4096"
        )));
    }
    if let Some(key) = &body.idempotency_key {
        if key.is_empty() || key.len() > 128 || key.chars().any(char::is_control) {
            return Err(bad(
                "idempotency_key: must be 1-128 bytes with no control characters",
            ));
        }
    }
    let on_timeout = match body.on_timeout.as_deref() {
        None => OnTimeout::Kill,
        Some(text) => OnTimeout::parse(text)
            .ok_or_else(|| bad(format!("on_timeout: {text:?} is not kill or pause")))?,
    };
    if body.auto_resume && on_timeout != OnTimeout::Pause {
        return Err(bad(
            "auto_resume: true needs on_timeout: pause (only a sandbox its TTL pauses can be resumed by a request)",
        ));
    }
    super::volume::check_mounts(&body.volumes)?;
    let gpu = gpu_request(body.gpu.as_deref(), body.gpu_count, body.gpu_wait_s)?;
    let network = body
        .network
        .map(super::network::network_request)
        .transpose()?;
    let (template, snapshot) = match (body.template, body.snapshot) {
        (Some(t), None) => (check_template_name(&t, "template")?, None),
        (None, Some(s)) => {
            if body.gpu.is_some() || body.gpu_count.is_some() || body.gpu_wait_s.is_some() {
                return Err(bad(
                    "gpu: a sandbox with a GPU boots; a restore of a snapshot cannot take one",
                ));
            }
            if !body.volumes.is_empty() {
                return Err(bad(
                    "volumes: a restore mounts its snapshot's volumes; leave them out",
                ));
            }
            if body.vcpus.is_some() || body.memory_mib.is_some() {
                return Err(bad(
                    "vcpus, memory_mib: a restore keeps its snapshot's shape; leave them out",
                ));
            }
            (String::new(), Some(check_snapshot_id(&s, "snapshot")?))
        }
        _ => {
            return Err(bad(
                "template: give exactly one of template (boot) and snapshot (restore)",
            ))
        }
    };
    Ok(CreateSandbox {
        template,
        snapshot,
        vcpus: in_range(body.vcpus, "vcpus", 1, MAX_VCPUS)?,
        memory_mib: in_range(body.memory_mib, "memory_mib", 1, MAX_MEMORY_MIB)?,
        ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
        idle_ttl_s: body.idle_ttl_s.map(|v| ttl(v, "idle_ttl_s")).transpose()?,
        labels: body.labels,
        metadata: body.metadata,
        idempotency_key: body.idempotency_key,
        env: body.env,
        cpu_limit: body
            .cpu_limit
            .map(|c| {
                if c.is_finite() && (MIN_CPU_LIMIT..=f64::from(MAX_VCPUS)).contains(&c) {
                    Ok(c)
                } else {
                    Err(bad(format!(
                        "cpu_limit: {c} is out of range ({MIN_CPU_LIMIT}-{MAX_VCPUS} cores)"
                    )))
                }
            })
            .transpose()?,
        deterministic: body.deterministic,
        on_timeout,
        auto_resume: body.auto_resume,
        tenant: None,
        volumes: body.volumes,
        gpu,
        network,
    })
}

/// `gpu` (a name, `any`, or a PCI address), `gpu_count` (default 1; alone, any GPU) and
/// `gpu_wait_s` (default 0).
fn gpu_request(
    name: Option<&str>,
    count: Option<i64>,
    wait_s: Option<i64>,
) -> Result<Option<GpuRequest>, ApiError> {
    if name.is_none() && count.is_none() {
        if wait_s.is_some() {
            return Err(bad("gpu_wait_s: needs gpu or gpu_count"));
        }
        return Ok(None);
    }
    let name = name.unwrap_or("any");
    if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
        return Err(bad(format!(
            "gpu: {name:?} is not a GPU name (1-64 characters: a name such as H100, any, or a PCI address)"
        )));
    }
    let count = in_range(count, "gpu_count", 1, MAX_GPU_COUNT)?.unwrap_or(1);
    let wait_s = in_range(wait_s, "gpu_wait_s", 0, MAX_GPU_WAIT_S)?.unwrap_or(0);
    Ok(Some(GpuRequest {
        name: name.to_string(),
        count,
        wait_s: u64::from(wait_s),
    }))
}

/// POST /sandboxes/batch: `count` and the fields of POST /sandboxes.
pub fn parse_batch(body: &[u8]) -> Result<Action, ApiError> {
    let mut fields: serde_json::Map<String, serde_json::Value> = from_json(body)?;
    let count = match fields.remove("count") {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(other) => return Err(bad(format!("count: {other} is not a whole number"))),
        None => return Err(bad("count: required (how many sandboxes)")),
    };
    let count = in_range(count, "count", 1, MAX_BATCH)?
        .ok_or_else(|| bad(format!("count: not a whole number 1-{MAX_BATCH}")))?;
    let spec = serde_json::to_vec(&fields).map_err(|e| bad(format!("bad JSON body: {e}")))?;
    let create = parse_create(&spec)?;
    if let Some(key) = &create.idempotency_key {
        if key.len() > 120 {
            return Err(bad(
                "idempotency_key: a batch's key must be at most 120 bytes (items get KEY/INDEX)",
            ));
        }
    }
    Ok(Action::CreateBatch { count, create })
}

/// GET (and DELETE) /sandboxes query: ids, labels, state, limit, page token.
pub fn parse_query(query: Option<&str>) -> Result<ListQuery, ApiError> {
    let mut out = ListQuery {
        limit: DEFAULT_LIST_LIMIT,
        ..ListQuery::default()
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name, "query")?;
        let value = percent_decode(value, &name)?;
        match name.as_str() {
            "ids" => {
                for id in value.split(',').filter(|i| !i.is_empty()) {
                    out.ids.push(check_id(id)?);
                }
                if out.ids.len() > MAX_IDS {
                    return Err(bad(format!("ids: more than {MAX_IDS}")));
                }
            }
            "label" => {
                let (key, want) = value
                    .split_once('=')
                    .ok_or_else(|| bad(format!("label: {value:?} is not KEY=VALUE")))?;
                if !check_label_key(key) {
                    return Err(bad(format!("label: {key:?} is not a label key")));
                }
                out.labels.push((key.to_string(), want.to_string()));
            }
            "state" => {
                out.state = Some(State::parse(&value).ok_or_else(|| {
                    bad(format!(
                        "state: {value:?} is not one of creating, running, paused, exited, failed, deleted, expired"
                    ))
                })?)
            }
            "limit" => {
                out.limit = value
                    .parse::<u32>()
                    .ok()
                    .filter(|l| (1..=MAX_LIST_LIMIT).contains(l))
                    .ok_or_else(|| bad(format!("limit: {value:?} is not 1-{MAX_LIST_LIMIT}")))?
            }
            "page_token" => {
                out.after = Some(
                    value
                        .parse::<i64>()
                        .ok()
                        .filter(|v| *v >= 0)
                        .ok_or_else(|| bad(format!("page_token: {value:?} is not a page token")))?,
                )
            }
            other => {
                return Err(bad(format!(
                    "{other}: unknown query parameter (ids, label, state, limit, page_token)"
                )))
            }
        }
    }
    Ok(out)
}

/// DELETE /sandboxes: by ids or labels, never every sandbox.
pub fn parse_delete(query: Option<&str>) -> Result<Action, ApiError> {
    let query = parse_query(query)?;
    if query.ids.is_empty() && query.labels.is_empty() {
        return Err(bad(
            "ids, label: DELETE /sandboxes needs ids=ID,ID or label=KEY=VALUE (it never ends every sandbox)",
        ));
    }
    if query.state.is_some() || query.after.is_some() {
        return Err(bad(
            "state, page_token: DELETE /sandboxes takes only ids and label",
        ));
    }
    Ok(Action::DeleteSandboxes(query))
}

/// POST /sandboxes/{id}/keepalive.
pub fn parse_keepalive(id: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let body: KeepaliveBody = from_json(body)?;
    Ok(Action::Keepalive {
        id,
        ttl_s: ttl(body.ttl_s, "ttl_s")?,
    })
}

/// GET /sandboxes/{id}/ports/{port} (an upgrade to a guest TCP connection).
pub fn parse_port_connect(id: &str, port: &str) -> Result<Action, ApiError> {
    Ok(Action::PortConnect {
        id: check_id(id)?,
        port: check_port(port)?,
    })
}

fn check_port(port: &str) -> Result<u16, ApiError> {
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad(format!("port: {port:?} is not a TCP port (1-65535)")))
}

#[cfg(test)]
mod tests {
    use crate::daemon::api::routes::{err, parse};
    use crate::daemon::api::{Action, ListQuery, NetworkRequest, OnTimeout, State};

    #[test]
    fn create_parses_and_defaults() {
        let action = parse(
            "POST",
            "/sandboxes",
            None,
            br#"{"template":"t1","ttl_s":60,"labels":{"run":"a"},"idempotency_key":"k"}"#,
        )
        .expect("parse");
        let Action::CreateSandbox(c) = action else {
            panic!("{action:?}")
        };
        assert_eq!(c.template, "t1");
        assert_eq!(c.ttl_s, Some(60));
        assert_eq!(c.vcpus, None);
        assert_eq!(c.labels.get("run").map(String::as_str), Some("a"));
        assert_eq!((c.on_timeout, c.auto_resume), (OnTimeout::Kill, false));
        let action = parse(
            "POST",
            "/sandboxes",
            None,
            br#"{"template":"t1","ttl_s":3,"on_timeout":"pause","auto_resume":true}"#,
        )
        .expect("parse");
        let Action::CreateSandbox(c) = action else {
            panic!("{action:?}")
        };
        assert_eq!((c.on_timeout, c.auto_resume), (OnTimeout::Pause, true));
        assert_eq!(c.network, None);
        let network = |body: &str| match parse("POST", "/sandboxes", None, body.as_bytes()) {
            Ok(Action::CreateSandbox(c)) => c.network,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            network(r#"{"template":"t","network":{}}"#),
            Some(NetworkRequest::default())
        );
        assert_eq!(
            network(r#"{"template":"t","network":{"egress":"all"}}"#),
            Some(NetworkRequest {
                egress: Some("all".into()),
                expose: Vec::new(),
            })
        );
        assert_eq!(
            network(
                r#"{"template":"t","network":{"egress":{"allow":["10.0.0.0/8:443","1.1.1.1"]}}}"#
            ),
            Some(NetworkRequest {
                egress: Some("10.0.0.0/8:443,1.1.1.1".into()),
                expose: Vec::new(),
            })
        );
        assert_eq!(
            network(r#"{"template":"t","network":{"expose":[8080,22]}}"#),
            Some(NetworkRequest {
                egress: None,
                expose: vec![8080, 22],
            })
        );
    }

    #[test]
    fn bad_create_bodies_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"template":"t","memory_mib":-5}"#, "memory_mib"),
            (r#"{"template":"t","memory_mib":0}"#, "memory_mib"),
            (r#"{"template":"t","vcpus":999}"#, "vcpus"),
            (r#"{"template":"t","ttl_s":0}"#, "ttl_s"),
            (r#"{"template":"t","idle_ttl_s":-1}"#, "idle_ttl_s"),
            (r#"{"template":"t","labels":{"bad key":"v"}}"#, "labels"),
            (r#"{"template":"t","labels":{"k":7}}"#, "labels.k"),
            (r#"{"template":"t","colour":"red"}"#, "colour"),
            (r#"{"template":"T!"}"#, "template"),
            (r#"{"ttl_s":5}"#, "template"),
            (
                r#"{"template":"t","idempotency_key":""}"#,
                "idempotency_key",
            ),
            (r#"{"template":"t"} trailing"#, "JSON"),
            (r#"{"template":"t","env":{"A=B":"x"}}"#, "env"),
            (r#"{"template":"t","env":{"A":7}}"#, "env.A"),
            (r#"{"template":"t","cpu_limit":0}"#, "cpu_limit"),
            (r#"{"template":"t","cpu_limit":-1}"#, "cpu_limit"),
            (r#"{"template":"t","cpu_limit":"half"}"#, "cpu_limit"),
            (r#"{"template":"t","on_timeout":"stop"}"#, "on_timeout"),
            (r#"{"template":"t","auto_resume":true}"#, "auto_resume"),
            (
                r#"{"template":"t","network":{"egress":"some"}}"#,
                "network.egress",
            ),
            (
                r#"{"template":"t","network":{"egress":{"allow":[]}}}"#,
                "network.egress.allow",
            ),
            (
                r#"{"template":"t","network":{"egress":{"allow":["10.0.0.0/33"]}}}"#,
                "network.egress",
            ),
            (
                r#"{"template":"t","network":{"egress":{"allow":["a,b"]}}}"#,
                "network.egress.allow",
            ),
            (
                r#"{"template":"t","network":{"egress":{"deny":["1.1.1.1"]}}}"#,
                "network.egress",
            ),
            (r#"{"template":"t","network":{"colour":"red"}}"#, "colour"),
            (
                r#"{"template":"t","network":{"expose":[0]}}"#,
                "network.expose",
            ),
            (
                r#"{"template":"t","network":{"expose":[65536]}}"#,
                "network.expose",
            ),
            (
                r#"{"template":"t","network":{"expose":["80"]}}"#,
                "network.expose",
            ),
            (
                r#"{"template":"t","network":{"expose":[80,80]}}"#,
                "network.expose",
            ),
            (
                r#"{"template":"t","network":{"expose":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}}"#,
                "network.expose",
            ),
            (
                r#"{"template":"t","on_timeout":"kill","auto_resume":true}"#,
                "auto_resume",
            ),
        ];
        for (body, field) in cases {
            let message = err(parse("POST", "/sandboxes", None, body.as_bytes()));
            assert!(
                message.contains(field),
                "{body}: {message:?} does not name {field}"
            );
        }
        assert!(err(parse("POST", "/sandboxes", None, b"")).contains("JSON body"));
    }

    #[test]
    fn list_query_parses() {
        let q = parse(
            "GET",
            "/sandboxes",
            Some("label=run%3Da%3Db&state=running&limit=5&page_token=12"),
            b"",
        )
        .expect("parse");
        assert_eq!(
            q,
            Action::ListSandboxes(ListQuery {
                ids: Vec::new(),
                labels: vec![("run".into(), "a=b".into())],
                state: Some(State::Running),
                limit: 5,
                after: Some(12),
                tenant: None,
            })
        );
        for (query, field) in [
            ("label=novalue", "label"),
            // A key that would break out of a JSON path: refused before any SQL.
            ("label=a%22%29%20OR%201%3D1--%3Dv", "label"),
            ("state=zombie", "state"),
            ("limit=0", "limit"),
            ("limit=abc", "limit"),
            ("page_token=-3", "page_token"),
            ("colour=red", "colour"),
        ] {
            let message = err(parse("GET", "/sandboxes", Some(query), b""));
            assert!(message.starts_with(field), "{query}: {message:?}");
        }
        assert!(err(parse("GET", "/templates", Some("x=1"), b"")).contains("no query"));
    }

    #[test]
    fn batches_and_bulk_deletes_parse() {
        let action = parse(
            "POST",
            "/sandboxes/batch",
            None,
            br#"{"count":3,"template":"t","ttl_s":9,"idempotency_key":"k"}"#,
        )
        .expect("batch");
        let Action::CreateBatch { count, create } = action else {
            panic!("{action:?}")
        };
        assert_eq!((count, create.template.as_str()), (3, "t"));
        assert_eq!(create.idempotency_key.as_deref(), Some("k"));
        for (body, field) in [
            (r#"{"template":"t"}"#, "count"),
            (r#"{"count":0,"template":"t"}"#, "count"),
            (r#"{"count":"2","template":"t"}"#, "count"),
            (r#"{"count":2,"template":"t","colour":1}"#, "colour"),
            (r#"{"count":2}"#, "template"),
        ] {
            let message = err(parse("POST", "/sandboxes/batch", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        let ids = "sb-0123456789abcdef,sb-00000000000000aa";
        assert!(matches!(
            parse("DELETE", "/sandboxes", Some(&format!("ids={ids}")), b""),
            Ok(Action::DeleteSandboxes(ListQuery { ref ids, .. })) if ids.len() == 2
        ));
        assert!(err(parse("DELETE", "/sandboxes", None, b"")).contains("ids"));
        assert!(err(parse("DELETE", "/sandboxes", Some("ids=sb-x"), b"")).contains("id"));
        assert!(err(parse(
            "DELETE",
            "/sandboxes",
            Some("label=a%3Db&state=running"),
            b""
        ))
        .contains("state"));
    }

    #[test]
    fn keepalive_needs_a_ttl() {
        let id = "sb-0123456789abcdef";
        let path = format!("/sandboxes/{id}/keepalive");
        assert_eq!(
            parse("POST", &path, None, br#"{"ttl_s":30}"#).expect("parse"),
            Action::Keepalive {
                id: id.into(),
                ttl_s: 30
            }
        );
        assert!(err(parse("POST", &path, None, br#"{"ttl_s":-30}"#)).contains("ttl_s"));
        assert!(err(parse("POST", &path, None, br#"{}"#)).contains("ttl_s"));
    }
}
