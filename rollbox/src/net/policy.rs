//! The egress policy of a sandbox: `none`, `all`, or an allow-list of destinations.
//!
//! Allow-list syntax: comma-separated entries `CIDR[:PORT[-PORT]]`; a bare address means /32.
//! With ports an entry allows TCP and UDP to those ports; without, any protocol (ICMP too).
//! Example: `10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90`.
//!
//! `all` forwards everything but [`DENIED_UNDER_ALL`] (private, shared and link-local ranges,
//! cloud metadata among them). Entries beside `all` (`all,10.1.0.0/16:5432`) are the
//! operator's opt-ins: they are allowed before those ranges are dropped.
//!
//! An entry may name a host instead of a CIDR (`pypi.org:443`, `*.pythonhosted.org:443`):
//! the addresses the daemon's resolver answers for it are allowed, with the entry's ports
//! (`rollbox::net::resolver`; docs/networking.md, "Hostnames").

use std::fmt;
use std::str::FromStr;

use super::cidr::Ipv4Net;

/// What `all` does not forward unless an entry beside it names it: RFC 1918 (10/8,
/// 172.16/12, 192.168/16), shared address space (100.64/10, carrier NAT and some clouds'
/// internal services) and link-local (169.254/16, the cloud metadata service
/// 169.254.169.254 among them). IPv6 (fc00::/7, fe80::/10 included) is dropped for every
/// policy: guests are IPv4 only.
pub const DENIED_UNDER_ALL: [&str; 5] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
];

/// Addresses a hostname's answer may never add unless a CIDR entry names them (DNS
/// rebinding): [`DENIED_UNDER_ALL`] and these.
pub const REBINDING_ALSO: [&str; 2] = ["127.0.0.0/8", "0.0.0.0/8"];

/// A hostname entry: at most this many bytes.
pub const MAX_HOSTNAME: usize = 253;

/// Why an egress policy did not parse: names the token and the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("egress policy is empty (use none, all, or CIDR[:PORT[-PORT]],...)")]
    Empty,
    #[error("egress policy token `{token}`: {reason}")]
    Token { token: String, reason: String },
}

/// Where an entry points: addresses, or a host the resolver answers for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    Net(Ipv4Net),
    /// Lowercase, no trailing dot; `*.example.com` matches every name under example.com (not
    /// example.com itself).
    Host(String),
}

/// One allowed destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    pub dest: Dest,
    /// An inclusive TCP/UDP port range; `None` allows every protocol and port.
    pub ports: Option<(u16, u16)>,
}

/// What a sandbox may reach beyond the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Egress {
    /// Nothing is forwarded from the sandbox.
    None,
    /// Everything is forwarded except [`DENIED_UNDER_ALL`] (and what every sandbox is denied;
    /// see docs/networking.md); these entries, the operator's opt-ins, are allowed even there.
    All(Vec<Allow>),
    /// Only these destinations.
    Allow(Vec<Allow>),
}

fn port(token: &str, text: &str) -> Result<u16, PolicyError> {
    text.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| PolicyError::Token {
            token: token.to_string(),
            reason: format!("port `{text}` is not a number from 1 to 65535"),
        })
}

/// Checks and normalises a hostname entry: RFC 1123 labels (letters, digits, inner
/// hyphens; 1-63 bytes each), at least two of them, at most 253 bytes, lowercased, one
/// trailing dot dropped, not all-numeric at the end (that is an address); `*.` may lead.
pub fn hostname(text: &str) -> Result<String, String> {
    let lower = text.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    let rest = name.strip_prefix("*.").unwrap_or(name);
    if name.len() > MAX_HOSTNAME {
        return Err(format!(
            "hostname is {} bytes, over {MAX_HOSTNAME}",
            name.len()
        ));
    }
    let labels: Vec<&str> = rest.split('.').collect();
    for label in &labels {
        if label.is_empty() || label.len() > 63 {
            return Err(format!(
                "hostname `{text}`: each label is 1 to 63 bytes between dots"
            ));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-'))
        {
            return Err(format!(
                "hostname `{text}` has `{c}`; labels are letters, digits and hyphens (a wildcard is only `*.` at the start)"
            ));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!(
                "hostname `{text}`: a label may not start or end with `-`"
            ));
        }
    }
    if labels.len() < 2 {
        return Err(format!(
            "hostname `{text}` needs at least two labels (such as example.com)"
        ));
    }
    if labels
        .last()
        .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()))
    {
        return Err(format!("`{text}` is not an IPv4 address nor a hostname"));
    }
    Ok(name.to_string())
}

/// Whether `name` (lowercase, no trailing dot) is what hostname entry `pattern` names.
pub fn host_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(domain) => name
            .strip_suffix(domain)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => pattern == name,
    }
}

fn allow(token: &str) -> Result<Allow, PolicyError> {
    let (net_text, ports_text) = match token.split_once(':') {
        Some((net, ports)) => (net, Some(ports)),
        None => (token, None),
    };
    let bad = |reason: String| PolicyError::Token {
        token: token.to_string(),
        reason,
    };
    // A letter or `*` makes it a hostname; anything else is read as a CIDR.
    let dest = if net_text
        .chars()
        .any(|c| c.is_ascii_alphabetic() || c == '*')
    {
        Dest::Host(hostname(net_text).map_err(bad)?)
    } else {
        Dest::Net(
            net_text
                .parse::<Ipv4Net>()
                .map_err(|e| bad(e.to_string()))?,
        )
    };
    let ports = match ports_text {
        None => None,
        Some(text) => {
            let (lo, hi) = match text.split_once('-') {
                Some((lo, hi)) => (port(token, lo)?, port(token, hi)?),
                None => {
                    let p = port(token, text)?;
                    (p, p)
                }
            };
            if lo > hi {
                return Err(PolicyError::Token {
                    token: token.to_string(),
                    reason: format!("port range {lo}-{hi} runs backwards"),
                });
            }
            Some((lo, hi))
        }
    };
    Ok(Allow { dest, ports })
}

impl Egress {
    /// The entries: an allow-list's, or the opt-ins beside `all`.
    pub fn entries(&self) -> &[Allow] {
        match self {
            Egress::None => &[],
            Egress::All(entries) | Egress::Allow(entries) => entries,
        }
    }

    /// The hostname entries, in order (the resolver's set `dns<i>_<tap>` is the i-th's).
    pub fn hosts(&self) -> Vec<(&str, Option<(u16, u16)>)> {
        self.entries()
            .iter()
            .filter_map(|entry| match &entry.dest {
                Dest::Host(name) => Some((name.as_str(), entry.ports)),
                Dest::Net(_) => None,
            })
            .collect()
    }

    /// Whether an entry names a hostname.
    pub fn has_hosts(&self) -> bool {
        !self.hosts().is_empty()
    }

    /// Whether a CIDR entry contains `addr` (which lets a hostname's answer hold it even when
    /// it is private; see [`rebinding_guarded`]).
    pub fn names_address(&self, addr: std::net::Ipv4Addr) -> bool {
        self.entries()
            .iter()
            .any(|entry| matches!(&entry.dest, Dest::Net(net) if net.contains(addr)))
    }
}

/// Whether `addr` is in a range a hostname's answer may not add by itself (DNS rebinding):
/// private, shared, link-local, loopback, 0/8.
pub fn rebinding_guarded(addr: std::net::Ipv4Addr) -> bool {
    DENIED_UNDER_ALL
        .iter()
        .chain(REBINDING_ALSO.iter())
        .filter_map(|range| range.parse::<Ipv4Net>().ok())
        .any(|net| net.contains(addr))
}

impl FromStr for Egress {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" => Err(PolicyError::Empty),
            "none" => Ok(Egress::None),
            "all" => Ok(Egress::All(Vec::new())),
            list => {
                let mut entries = Vec::new();
                let mut all = false;
                for token in list.split(',') {
                    let token = token.trim();
                    if token.is_empty() {
                        return Err(PolicyError::Token {
                            token: list.to_string(),
                            reason: "empty entry between commas".to_string(),
                        });
                    }
                    if token == "none" {
                        return Err(PolicyError::Token {
                            token: token.to_string(),
                            reason: "`none` stands alone, not in a list".to_string(),
                        });
                    }
                    if token == "all" {
                        if all {
                            return Err(PolicyError::Token {
                                token: token.to_string(),
                                reason: "`all` appears twice".to_string(),
                            });
                        }
                        all = true;
                        continue;
                    }
                    entries.push(allow(token)?);
                }
                Ok(if all {
                    Egress::All(entries)
                } else {
                    Egress::Allow(entries)
                })
            }
        }
    }
}

impl fmt::Display for Allow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dest {
            Dest::Net(net) if net.prefix() == 32 => write!(f, "{}", net.network())?,
            Dest::Net(net) => write!(f, "{net}")?,
            Dest::Host(name) => f.write_str(name)?,
        }
        match self.ports {
            Some((lo, hi)) if lo == hi => write!(f, ":{lo}"),
            Some((lo, hi)) => write!(f, ":{lo}-{hi}"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for Egress {
    /// The canonical form, which parses back to the same policy.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Egress::None => f.write_str("none"),
            Egress::All(entries) => {
                f.write_str("all")?;
                entries.iter().try_for_each(|entry| write!(f, ",{entry}"))
            }
            Egress::Allow(entries) => {
                let parts: Vec<String> = entries.iter().map(Allow::to_string).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!("none".parse::<Egress>(), Ok(Egress::None));
        assert_eq!(" all ".parse::<Egress>(), Ok(Egress::All(Vec::new())));
        let policy: Egress = "10.0.0.0/8:443, 1.1.1.1,192.168.0.0/16:80-90"
            .parse()
            .unwrap();
        let Egress::Allow(entries) = &policy else {
            panic!("{policy:?}")
        };
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].ports, Some((443, 443)));
        assert_eq!(entries[1].dest, Dest::Net("1.1.1.1/32".parse().unwrap()));
        assert_eq!(entries[1].ports, None);
        assert_eq!(entries[2].ports, Some((80, 90)));
        assert_eq!(
            policy.to_string(),
            "10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90"
        );
        assert_eq!(policy.to_string().parse::<Egress>(), Ok(policy));
    }

    #[test]
    fn errors_name_the_token_and_the_reason() {
        let error = |s: &str| s.parse::<Egress>().unwrap_err().to_string();
        assert_eq!(
            error("1.1.1.1,10.0.0.0/33"),
            "egress policy token `10.0.0.0/33`: `10.0.0.0/33`: the prefix length must be a number from 0 to 32"
        );
        assert_eq!(
            error("10.0.0.0/8:0"),
            "egress policy token `10.0.0.0/8:0`: port `0` is not a number from 1 to 65535"
        );
        assert_eq!(
            error("10.0.0.0/8:90-80"),
            "egress policy token `10.0.0.0/8:90-80`: port range 90-80 runs backwards"
        );
        assert_eq!(
            error("exa_mple.com:443"),
            "egress policy token `exa_mple.com:443`: hostname `exa_mple.com` has `_`; labels are letters, digits and hyphens (a wildcard is only `*.` at the start)"
        );
        assert!(error("1.1.1.1,,2.2.2.2").contains("empty entry"));
        assert!(error("none,1.1.1.1").contains("stands alone"));
        assert!(error("all,1.1.1.1,all").contains("`all` appears twice"));
        assert!(error("10.0.0.1/8").contains("did you mean 10.0.0.0/8"));
        assert!(error("1.1.1.1:65536").contains("port `65536`"));
        assert_eq!(error(""), PolicyError::Empty.to_string());
    }

    #[test]
    fn entries_beside_all_are_opt_ins() {
        let policy: Egress = "10.1.0.0/16:5432, all ,169.254.169.254".parse().unwrap();
        let Egress::All(entries) = &policy else {
            panic!("{policy:?}")
        };
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].ports, Some((5432, 5432)));
        assert_eq!(policy.to_string(), "all,10.1.0.0/16:5432,169.254.169.254");
        assert_eq!(policy.to_string().parse::<Egress>(), Ok(policy));
        assert_eq!(Egress::All(Vec::new()).to_string(), "all");
    }

    #[test]
    fn hostnames_are_entries_with_ports() {
        let policy: Egress =
            "PyPI.org.:443,files.pythonhosted.org:443,10.0.0.0/8,*.Example.com:80-90"
                .parse()
                .unwrap();
        assert_eq!(
            policy.to_string(),
            "pypi.org:443,files.pythonhosted.org:443,10.0.0.0/8,*.example.com:80-90"
        );
        assert_eq!(policy.to_string().parse::<Egress>(), Ok(policy.clone()));
        assert_eq!(
            policy.hosts(),
            [
                ("pypi.org", Some((443, 443))),
                ("files.pythonhosted.org", Some((443, 443))),
                ("*.example.com", Some((80, 90)))
            ]
        );
        assert!(policy.names_address("10.1.2.3".parse().unwrap()));
        assert!(!policy.names_address("192.168.0.1".parse().unwrap()));
        let all: Egress = "all,db.internal.example:5432".parse().unwrap();
        assert_eq!(all.hosts(), [("db.internal.example", Some((5432, 5432)))]);
        assert!(!Egress::All(Vec::new()).has_hosts());
    }

    #[test]
    fn bad_hostnames_are_refused() {
        let reason = |s: &str| s.parse::<Egress>().unwrap_err().to_string();
        assert!(reason("localhost").contains("at least two labels"));
        assert!(reason("a..com").contains("1 to 63 bytes"));
        assert!(reason(&format!("{}.com", "a".repeat(64))).contains("1 to 63 bytes"));
        let long = format!("{}.com", vec!["a".repeat(60); 5].join("."));
        assert!(reason(&long).contains("over 253"), "{}", reason(&long));
        assert!(reason("-a.com").contains("start or end with `-`"));
        assert!(reason("a.*.com").contains("`*`"));
        assert!(reason("**.a.com").contains("`*`"));
        assert!(reason("1.2.3.4x.5").contains("not an IPv4 address nor a hostname"));
        assert!(reason("ex ample.com").contains("` `"));
        assert!(reason("example.com:0").contains("port `0`"));
        assert!(reason("*.com").contains("at least two labels"));
    }

    #[test]
    fn wildcards_match_names_under_the_domain_only() {
        assert!(host_matches("example.com", "example.com"));
        assert!(!host_matches("example.com", "www.example.com"));
        assert!(host_matches("*.example.com", "www.example.com"));
        assert!(host_matches("*.example.com", "a.b.example.com"));
        assert!(!host_matches("*.example.com", "example.com"));
        assert!(!host_matches("*.example.com", "badexample.com"));
        assert!(!host_matches("*.example.com", ".example.com"));
    }

    #[test]
    fn rebinding_ranges() {
        for addr in [
            "10.1.1.1",
            "127.0.0.1",
            "0.1.2.3",
            "169.254.169.254",
            "100.64.0.1",
            "192.168.1.1",
            "172.16.0.1",
        ] {
            assert!(rebinding_guarded(addr.parse().unwrap()), "{addr}");
        }
        for addr in ["1.1.1.1", "151.101.0.223", "172.32.0.1"] {
            assert!(!rebinding_guarded(addr.parse().unwrap()), "{addr}");
        }
    }
}
