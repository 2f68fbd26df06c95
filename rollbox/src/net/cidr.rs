//! IPv4 addresses and CIDR blocks: parsing and the little arithmetic the pool and the egress
//! policy need.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// Why a CIDR block did not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CidrError {
    #[error("`{0}` is not an IPv4 address")]
    BadAddress(String),
    #[error("`{0}`: the prefix length must be a number from 0 to 32")]
    BadPrefix(String),
    #[error("`{input}` has host bits set; did you mean {suggested}?")]
    HostBitsSet { input: String, suggested: String },
}

/// An IPv4 network: an address with its host bits clear, and a prefix length (0-32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Net {
    addr: u32,
    prefix: u8,
}

/// The netmask of a prefix length, as a host-order integer.
pub fn mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p.min(32))),
    }
}

impl Ipv4Net {
    /// A network from an address and prefix length; `None` when the address has host bits set
    /// or the prefix is over 32.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Ipv4Net> {
        let addr = u32::from(addr);
        (prefix <= 32 && addr & !mask(prefix) == 0).then_some(Ipv4Net { addr, prefix })
    }

    /// The first address.
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr)
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The netmask in dotted form.
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(mask(self.prefix))
    }

    /// How many addresses the block spans (2^(32 - prefix)).
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix) == self.addr
    }

    /// Whether the two blocks share any address.
    pub fn overlaps(&self, other: &Ipv4Net) -> bool {
        let shorter = self.prefix.min(other.prefix);
        self.addr & mask(shorter) == other.addr & mask(shorter)
    }

    /// The `index`-th subnet of length `prefix` inside this block, if there is one.
    pub fn subnet(&self, prefix: u8, index: u64) -> Option<Ipv4Net> {
        if prefix < self.prefix || prefix > 32 {
            return None;
        }
        let count = 1u64 << (prefix - self.prefix);
        if index >= count {
            return None;
        }
        let step = 1u64 << (32 - u32::from(prefix));
        let addr = u64::from(self.addr) + index * step;
        Some(Ipv4Net {
            addr: u32::try_from(addr).ok()?,
            prefix,
        })
    }

    /// The address `offset` past the network address (no bounds check beyond u32).
    pub fn nth(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(self.addr.wrapping_add(offset))
    }
}

impl FromStr for Ipv4Net {
    type Err = CidrError;

    /// `A.B.C.D/N`, or a bare address meaning /32.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr_text, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => {
                let prefix = prefix
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 32)
                    .ok_or_else(|| CidrError::BadPrefix(s.to_string()))?;
                (addr, prefix)
            }
            None => (s, 32),
        };
        let addr: Ipv4Addr = addr_text
            .parse()
            .map_err(|_| CidrError::BadAddress(s.to_string()))?;
        Ipv4Net::new(addr, prefix).ok_or_else(|| CidrError::HostBitsSet {
            input: s.to_string(),
            suggested: format!(
                "{}/{prefix}",
                Ipv4Addr::from(u32::from(addr) & mask(prefix))
            ),
        })
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn parses_blocks_and_bare_addresses() {
        assert_eq!(net("10.200.0.0/16").to_string(), "10.200.0.0/16");
        assert_eq!(net("1.1.1.1").to_string(), "1.1.1.1/32");
        assert_eq!(net("0.0.0.0/0").size(), 1 << 32);
        assert_eq!(
            net("10.0.0.0/30").netmask(),
            Ipv4Addr::new(255, 255, 255, 252)
        );
    }

    #[test]
    fn rejects_bad_blocks_naming_them() {
        assert_eq!(
            "10.0.0.0/33".parse::<Ipv4Net>(),
            Err(CidrError::BadPrefix("10.0.0.0/33".into()))
        );
        assert_eq!(
            "10.0.0/8".parse::<Ipv4Net>(),
            Err(CidrError::BadAddress("10.0.0/8".into()))
        );
        assert_eq!(
            "10.1.2.3/8".parse::<Ipv4Net>(),
            Err(CidrError::HostBitsSet {
                input: "10.1.2.3/8".into(),
                suggested: "10.0.0.0/8".into()
            })
        );
        let message = "10.1.2.3/8".parse::<Ipv4Net>().unwrap_err().to_string();
        assert_eq!(
            message,
            "`10.1.2.3/8` has host bits set; did you mean 10.0.0.0/8?"
        );
        assert!("x/8".parse::<Ipv4Net>().is_err());
        assert!("10.0.0.0/".parse::<Ipv4Net>().is_err());
    }

    #[test]
    fn subnets_contains_and_overlaps() {
        let pool = net("10.200.0.0/16");
        assert_eq!(pool.subnet(30, 0), Some(net("10.200.0.0/30")));
        assert_eq!(pool.subnet(30, 1), Some(net("10.200.0.4/30")));
        assert_eq!(pool.subnet(30, 16383), Some(net("10.200.255.252/30")));
        assert_eq!(pool.subnet(30, 16384), None);
        assert_eq!(pool.subnet(8, 0), None);
        assert!(pool.contains(Ipv4Addr::new(10, 200, 9, 9)));
        assert!(!pool.contains(Ipv4Addr::new(10, 201, 0, 0)));
        assert!(pool.overlaps(&net("10.0.0.0/8")));
        assert!(net("10.0.0.0/8").overlaps(&pool));
        assert!(!pool.overlaps(&net("10.201.0.0/16")));
        assert_eq!(
            net("255.255.255.252/30").subnet(30, 0),
            Some(net("255.255.255.252/30"))
        );
        assert_eq!(net("10.0.0.4/30").nth(2), Ipv4Addr::new(10, 0, 0, 6));
    }
}
