//! The egress policy of a sandbox: `none`, `all`, or an allow-list of destinations.
//!
//! Allow-list syntax: comma-separated entries `CIDR[:PORT[-PORT]]`; a bare address means /32.
//! With ports an entry allows TCP and UDP to those ports; without, any protocol (ICMP too).
//! Example: `10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90`.
//!
//! `all` forwards everything but [`DENIED_UNDER_ALL`] (private, shared and link-local ranges,
//! cloud metadata among them). Entries beside `all` (`all,10.1.0.0/16:5432`) are the
//! operator's opt-ins: they are allowed before those ranges are dropped.

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

/// Why an egress policy did not parse: names the token and the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("egress policy is empty (use none, all, or CIDR[:PORT[-PORT]],...)")]
    Empty,
    #[error("egress policy token `{token}`: {reason}")]
    Token { token: String, reason: String },
}

/// One allowed destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    pub net: Ipv4Net,
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

fn allow(token: &str) -> Result<Allow, PolicyError> {
    let (net_text, ports_text) = match token.split_once(':') {
        Some((net, ports)) => (net, Some(ports)),
        None => (token, None),
    };
    let net = net_text
        .parse::<Ipv4Net>()
        .map_err(|e| PolicyError::Token {
            token: token.to_string(),
            reason: e.to_string(),
        })?;
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
    Ok(Allow { net, ports })
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
        if self.net.prefix() == 32 {
            write!(f, "{}", self.net.network())?;
        } else {
            write!(f, "{}", self.net)?;
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
        assert_eq!(entries[1].net.to_string(), "1.1.1.1/32");
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
            error("example.com:443"),
            "egress policy token `example.com:443`: `example.com` is not an IPv4 address"
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
}
