//! E2B's network options on the daemon's networks: `allow_internet_access` and
//! `network.allowOut`/`denyOut` on a create, and `PUT /sandboxes/{id}/network` (the SDK's
//! network update), turned into the native egress policy (`none`, `all`, an allow-list).
//!
//! E2B's rules: `allowOut` entries win over `denyOut` ones, and `allow_internet_access: false`
//! is `denyOut: ["0.0.0.0/0"]`. rollbox serves the deny-everything-else form only: a `denyOut`
//! entry other than `0.0.0.0/0` is refused, as are an egress proxy and transform rules.
//! `allowOut` domains are the native policy's hostname entries (`pypi.org`, `*.example.com`),
//! resolved by the sandbox's resolver.

use std::sync::Arc;

use hyper::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::super::api::{self, Action};
use super::super::super::keys::Caller;
use super::super::transport::Out;
use super::refusal::Refusal;
use super::state::E2b;
use super::wire::no_content;

/// What every E2B network body may hold (`SandboxNetworkConfig` on create,
/// `SandboxNetworkUpdateConfig` on update); fields rollbox does not serve are refused when
/// set.
#[derive(Debug, Default, Deserialize)]
pub struct NetworkOptions {
    #[serde(default, rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    #[serde(default, rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    /// The update's form of `allow_internet_access`.
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    #[serde(default, rename = "egressProxy")]
    pub egress_proxy: Option<Value>,
    #[serde(default)]
    pub rules: Option<Value>,
}

/// The native egress E2B's options ask for; None when they ask nothing (the template's
/// egress then holds).
pub fn egress(
    allow_internet_access: Option<bool>,
    options: &NetworkOptions,
) -> Result<Option<String>, Refusal> {
    for (field, value) in [
        ("egressProxy", &options.egress_proxy),
        ("rules", &options.rules),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(Refusal::new(
                400,
                format!("network.{field}: not served by rollbox (its egress policy is nftables rules on the sandbox's tap)"),
            ));
        }
    }
    let allow = options.allow_out.clone().unwrap_or_default();
    let deny = options.deny_out.clone().unwrap_or_default();
    if let Some(other) = deny.iter().find(|d| d.as_str() != "0.0.0.0/0") {
        return Err(Refusal::new(
            400,
            format!("network.denyOut: {other:?}: only 0.0.0.0/0 (deny everything not in allowOut) is served; name what may be reached in allowOut"),
        ));
    }
    let internet = allow_internet_access.or(options.allow_internet_access);
    let deny_all = internet == Some(false) || !deny.is_empty();
    Ok(match (deny_all, allow.is_empty()) {
        (true, true) => Some("none".into()),
        (true, false) => Some(allow.join(",")),
        // Allowed entries beside `all` reach even the ranges `all` keeps out.
        (false, false) => Some(format!("all,{}", allow.join(","))),
        (false, true) => internet.map(|_| "all".to_string()),
    })
}

/// `PUT /sandboxes/{id}/network`: the sandbox's egress replaced (omitted fields clear: an
/// empty body is `all`); 204, or 409 for a sandbox without a network.
pub async fn update(
    e2b: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &[u8],
) -> Result<Response<Out>, Refusal> {
    let options: NetworkOptions = super::refusal::parse_json(body, "SandboxNetworkUpdateConfig")?;
    let egress = egress(None, &options)?.unwrap_or_else(|| "all".to_string());
    let native = json!({ "egress": egress }).to_string();
    let action = api::parse(
        "PATCH",
        &format!("/sandboxes/{id}/network"),
        None,
        native.as_bytes(),
    )
    .map_err(|e| {
        Refusal::new(
            e.status(),
            e.to_string()
                .replacen("network.egress", "network.allowOut", 1),
        )
    })?;
    debug_assert!(matches!(action, Action::SetNetwork { .. }));
    e2b.core.handle_as(caller, action).await?;
    Ok(no_content())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(allow: &[&str], deny: &[&str]) -> NetworkOptions {
        NetworkOptions {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            ..NetworkOptions::default()
        }
    }

    #[test]
    fn e2b_options_map_onto_the_native_policy() {
        let none = NetworkOptions::default();
        assert_eq!(egress(None, &none).ok(), Some(None));
        assert_eq!(egress(Some(true), &none).ok(), Some(Some("all".into())));
        assert_eq!(egress(Some(false), &none).ok(), Some(Some("none".into())));
        let listed = options(&["1.1.1.1", "10.0.0.0/8"], &["0.0.0.0/0"]);
        assert_eq!(
            egress(None, &listed).ok(),
            Some(Some("1.1.1.1,10.0.0.0/8".into()))
        );
        assert_eq!(
            egress(None, &options(&["10.1.0.0/16"], &[])).ok(),
            Some(Some("all,10.1.0.0/16".into()))
        );
        // Domains are hostname entries of the native policy.
        assert_eq!(
            egress(
                None,
                &options(&["pypi.org", "*.pythonhosted.org"], &["0.0.0.0/0"])
            )
            .ok(),
            Some(Some("pypi.org,*.pythonhosted.org".into()))
        );
        let err = egress(None, &options(&[], &["8.8.8.8"])).expect_err("a deny entry");
        assert!(
            err.message.starts_with("network.denyOut: \"8.8.8.8\""),
            "{}",
            err.message
        );
        let proxy = NetworkOptions {
            egress_proxy: Some(json!({"address": "socks5://x"})),
            ..NetworkOptions::default()
        };
        assert!(egress(None, &proxy).is_err());
    }
}
