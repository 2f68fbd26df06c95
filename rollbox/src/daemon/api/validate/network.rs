//! `network` of a create or a template: the egress policy, checked.

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::super::limits::{MAX_EGRESS_ALLOW, MAX_EXPOSE};
use super::super::model::NetworkRequest;
use super::{bad, check_id, from_json};

/// `network` of a create or a template.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkBody {
    egress: Option<serde_json::Value>,
    expose: Option<Vec<serde_json::Value>>,
}

/// `network: {egress, expose}`: `expose` lists guest TCP ports (1-65535, each once); `egress`
/// is `"none"`, `"all"`, `{"allow": ["CIDR|HOST[:PORT[-PORT]]", ...]}`, or the same as one
/// string, `"CIDR|HOST[:PORT[-PORT]],..."` (`rollbox::net`'s policy, checked here; a
/// hostname must be RFC 1123 labels).
pub fn network_request(body: NetworkBody) -> Result<NetworkRequest, ApiError> {
    let form = r#""none", "all" or {"allow": ["CIDR|HOST[:PORT[-PORT]]", ...]}"#;
    let egress = match body.egress {
        None => None,
        Some(serde_json::Value::String(text)) => Some(text),
        Some(serde_json::Value::Object(object)) => {
            let entries = match (object.get("allow"), object.len()) {
                (Some(serde_json::Value::Array(entries)), 1) => entries,
                _ => return Err(bad(format!("network.egress: want {form}"))),
            };
            let mut texts = Vec::with_capacity(entries.len());
            for entry in entries {
                match entry.as_str() {
                    Some(text) if !text.is_empty() && !text.contains(',') => {
                        texts.push(text.to_string())
                    }
                    _ => {
                        return Err(bad(format!(
                            "network.egress.allow: {entry} is not CIDR|HOST[:PORT[-PORT]]"
                        )))
                    }
                }
            }
            if texts.is_empty() || texts.len() > MAX_EGRESS_ALLOW {
                return Err(bad(format!(
                    "network.egress.allow: 1 to {MAX_EGRESS_ALLOW} entries (for nothing, use \"none\")"
                )));
            }
            Some(texts.join(","))
        }
        Some(other) => return Err(bad(format!("network.egress: {other} is not {form}"))),
    };
    if let Some(text) = &egress {
        text.parse::<crate::net::Egress>()
            .map_err(|e| bad(format!("network.egress: {e}")))?;
    }
    let mut expose = Vec::new();
    for entry in body.expose.unwrap_or_default() {
        let port = entry
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| {
                bad(format!(
                    "network.expose: {entry} is not a TCP port (1 to 65535)"
                ))
            })?;
        if expose.contains(&port) {
            return Err(bad(format!("network.expose: port {port} is given twice")));
        }
        expose.push(port);
    }
    if expose.len() > MAX_EXPOSE {
        return Err(bad(format!(
            "network.expose: at most {MAX_EXPOSE} ports per sandbox"
        )));
    }
    Ok(NetworkRequest { egress, expose })
}

/// PATCH /sandboxes/{id}/network: `{"egress": ...}` (required).
pub fn parse_patch(id: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let network = network_request(from_json(body)?)?;
    if !network.expose.is_empty() {
        return Err(bad(
            "expose: a live sandbox's exposed ports cannot change (give them at create)",
        ));
    }
    if network.egress.is_none() {
        return Err(bad("egress: required (none, all, or an allow-list)"));
    }
    Ok(Action::SetNetwork { id, network })
}
