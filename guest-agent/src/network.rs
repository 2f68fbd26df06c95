//! Guest networking at boot: `lo` up, and the interface named by the kernel's `ip=` argument
//! (the syntax of Linux's IP autoconfiguration, which Firecracker users already write):
//! `ip=<client>:<server>:<gateway>:<netmask>:<hostname>:<device>:<autoconf>:<dns0>:<dns1>`.
//! Only static addresses (`off` or `none`) are configured; the agent does it with ioctls, so
//! images without iproute2 work.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Errors from parsing `ip=` or configuring an interface.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NetworkError {
    /// `ip=` does not parse.
    #[error("kernel argument ip={value}: {why}")]
    Parse {
        /// The argument's value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// An ioctl failed.
    #[error("{what} on {device}: {detail}")]
    Ioctl {
        /// The operation.
        what: &'static str,
        /// The interface.
        device: String,
        /// The OS error.
        detail: String,
    },
}

/// A static IPv4 configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticConfig {
    /// Interface name (default `eth0`).
    pub device: String,
    /// The guest's address.
    pub address: Ipv4Addr,
    /// Network mask (default from the address class is not guessed: /24).
    pub netmask: Ipv4Addr,
    /// Default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// DNS servers for /etc/resolv.conf.
    pub dns: Vec<Ipv4Addr>,
}

fn parse_addr(value: &str, field: &str, text: &str) -> Result<Option<Ipv4Addr>, NetworkError> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| NetworkError::Parse {
        value: value.into(),
        why: format!("{field} {text:?} is not an IPv4 address"),
    })
}

/// Parses the value of `ip=`; `None` for DHCP-style or empty values that need no static set-up.
pub fn parse_ip_arg(value: &str) -> Result<Option<StaticConfig>, NetworkError> {
    let fields: Vec<&str> = value.split(':').collect();
    let field = |i: usize| fields.get(i).copied().unwrap_or("");
    let autoconf = field(6);
    if !matches!(autoconf, "" | "off" | "none") || matches!(value, "dhcp" | "on" | "any" | "off") {
        return Ok(None);
    }
    let Some(address) = parse_addr(value, "client address", field(0))? else {
        return Err(NetworkError::Parse {
            value: value.into(),
            why: "no client address".into(),
        });
    };
    let netmask =
        parse_addr(value, "netmask", field(3))?.unwrap_or(Ipv4Addr::new(255, 255, 255, 0));
    let mask = u32::from(netmask);
    if mask.leading_ones() + mask.trailing_zeros() != 32 {
        return Err(NetworkError::Parse {
            value: value.into(),
            why: format!("netmask {netmask} is not contiguous"),
        });
    }
    let device = match field(5) {
        "" => "eth0".to_string(),
        name => name.to_string(),
    };
    let mut dns = Vec::new();
    for i in [7, 8] {
        if let Some(server) = parse_addr(value, "DNS server", field(i))? {
            dns.push(server);
        }
    }
    Ok(Some(StaticConfig {
        device,
        address,
        netmask,
        gateway: parse_addr(value, "gateway", field(2))?,
        dns,
    }))
}

/// The `ip=` value on a kernel command line, if any.
pub fn ip_arg(cmdline: &str) -> Option<&str> {
    cmdline
        .split_whitespace()
        .filter_map(|arg| arg.strip_prefix("ip="))
        .next_back()
}

#[repr(C)]
struct IfReqFlags {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[repr(C)]
struct IfReqAddr {
    name: [u8; 16],
    addr: libc::sockaddr_in,
    _pad: [u8; 8],
}

fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn ifname(device: &str) -> Result<[u8; 16], NetworkError> {
    let mut name = [0u8; 16];
    if device.is_empty() || device.len() > 15 {
        return Err(NetworkError::Ioctl {
            what: "interface name",
            device: device.into(),
            detail: "must be 1-15 bytes".into(),
        });
    }
    name[..device.len()].copy_from_slice(device.as_bytes());
    Ok(name)
}

/// An AF_INET datagram socket: the handle network ioctls go through.
fn control_socket() -> Result<OwnedFd, NetworkError> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os_err("socket", "AF_INET"));
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn os_err(what: &'static str, device: &str) -> NetworkError {
    NetworkError::Ioctl {
        what,
        device: device.into(),
        detail: std::io::Error::last_os_error().to_string(),
    }
}

/// Sets `device` up (IFF_UP), keeping its other flags.
pub fn link_up(device: &str) -> Result<(), NetworkError> {
    set_link(device, true)
}

fn set_link(device: &str, up: bool) -> Result<(), NetworkError> {
    let sock = control_socket()?;
    let mut req = IfReqFlags {
        name: ifname(device)?,
        flags: 0,
        _pad: [0; 22],
    };
    // SAFETY: SIOCGIFFLAGS fills an ifreq; `req` is ifreq-sized and lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(os_err("SIOCGIFFLAGS", device));
    }
    if up {
        req.flags |= libc::IFF_UP as libc::c_short;
    } else {
        req.flags &= !(libc::IFF_UP as libc::c_short);
    }
    // SAFETY: SIOCSIFFLAGS reads the ifreq filled above.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(os_err("SIOCSIFFLAGS", device));
    }
    Ok(())
}

fn set_addr(
    sock: &OwnedFd,
    request: libc::c_ulong,
    what: &'static str,
    device: &str,
    addr: Ipv4Addr,
) -> Result<(), NetworkError> {
    let req = IfReqAddr {
        name: ifname(device)?,
        addr: sockaddr(addr),
        _pad: [0; 8],
    };
    // SAFETY: SIOCSIFADDR/SIOCSIFNETMASK read an ifreq holding a sockaddr_in; `req` is
    // ifreq-sized and lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, &req) } < 0 {
        return Err(os_err(what, device));
    }
    Ok(())
}

#[repr(C)]
struct IfReqHwAddr {
    name: [u8; 16],
    addr: libc::sockaddr,
    _pad: [u8; 8],
}

fn set_mac(sock: &OwnedFd, device: &str, mac: [u8; 6]) -> Result<(), NetworkError> {
    let mut req = IfReqHwAddr {
        name: ifname(device)?,
        addr: libc::sockaddr {
            sa_family: libc::ARPHRD_ETHER,
            sa_data: [0; 14],
        },
        _pad: [0; 8],
    };
    for (dst, src) in req.addr.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCSIFHWADDR reads an ifreq holding a sockaddr; `req` is ifreq-sized and lives
    // for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFHWADDR, &req) } < 0 {
        return Err(os_err("SIOCSIFHWADDR", device));
    }
    Ok(())
}

/// Removes every IPv4 default route.
fn delete_default_routes(sock: &OwnedFd, device: &str) -> Result<(), NetworkError> {
    // At most a handful exist; the bound keeps a kernel that never says ESRCH from looping.
    for _ in 0..16 {
        // SAFETY: rtentry is plain data; all-zero is a valid value.
        let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
        let any = sockaddr(Ipv4Addr::UNSPECIFIED);
        // SAFETY: sockaddr_in and sockaddr have the same size; both are plain data.
        unsafe {
            route.rt_dst = std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(any);
            route.rt_genmask = std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(any);
        }
        // SAFETY: SIOCDELRT reads the rtentry, which lives for the call.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCDELRT, &route) } < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ESRCH) {
                return Ok(());
            }
            return Err(NetworkError::Ioctl {
                what: "SIOCDELRT (default route)",
                device: device.into(),
                detail: err.to_string(),
            });
        }
    }
    Ok(())
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().filter(|p| p.len() == 2)?;
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    (parts.next().is_none() && mac[0] & 1 == 0).then_some(mac)
}

/// Turns an agent request into a static configuration plus an optional new MAC.
pub fn from_request(
    req: &rollbox_agent_protocol::NetworkConfig,
) -> Result<(StaticConfig, Option<[u8; 6]>), String> {
    let (addr, prefix) = req
        .address
        .split_once('/')
        .ok_or_else(|| format!("address {:?}: expected ADDRESS/PREFIX", req.address))?;
    let address: Ipv4Addr = addr
        .parse()
        .map_err(|_| format!("address {:?}: not an IPv4 address", req.address))?;
    let prefix: u32 = prefix
        .parse()
        .ok()
        .filter(|p| (1..=32).contains(p))
        .ok_or_else(|| format!("address {:?}: prefix must be 1-32", req.address))?;
    let netmask = Ipv4Addr::from(u32::MAX << (32 - prefix));
    let gateway = req
        .gateway
        .as_deref()
        .map(|g| {
            g.parse::<Ipv4Addr>()
                .map_err(|_| format!("gateway {g:?}: not an IPv4 address"))
        })
        .transpose()?;
    let dns = req
        .dns
        .iter()
        .map(|d| {
            d.parse::<Ipv4Addr>()
                .map_err(|_| format!("dns {d:?}: not an IPv4 address"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mac = req
        .mac
        .as_deref()
        .map(|m| {
            parse_mac(m).ok_or_else(|| format!("mac {m:?}: expected a unicast aa:bb:cc:dd:ee:ff"))
        })
        .transpose()?;
    Ok((
        StaticConfig {
            device: req.device.clone().unwrap_or_else(|| "eth0".into()),
            address,
            netmask,
            gateway,
            dns,
        },
        mac,
    ))
}

/// Re-addresses an interface: new MAC (with the link down), address, default route, DNS.
pub fn reconfigure(
    config: &StaticConfig,
    mac: Option<[u8; 6]>,
    etc_dir: &std::path::Path,
) -> Result<(), NetworkError> {
    let sock = control_socket()?;
    let dev = config.device.as_str();
    if let Some(mac) = mac {
        set_link(dev, false)?;
        set_mac(&sock, dev, mac)?;
    }
    if config.gateway.is_some() {
        delete_default_routes(&sock, dev)?;
    }
    configure(config, etc_dir)
}

fn add_default_route(sock: &OwnedFd, device: &str, gateway: Ipv4Addr) -> Result<(), NetworkError> {
    // SAFETY: rtentry is plain data; all-zero is a valid value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    let any = sockaddr(Ipv4Addr::UNSPECIFIED);
    let gw = sockaddr(gateway);
    // SAFETY: sockaddr_in and sockaddr have the same size; both are plain data.
    unsafe {
        route.rt_dst = std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(any);
        route.rt_genmask = std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(any);
        route.rt_gateway = std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(gw);
    }
    route.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: SIOCADDRT reads the rtentry, which lives for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT, &route) } < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EEXIST) {
            return Err(NetworkError::Ioctl {
                what: "SIOCADDRT (default route)",
                device: device.into(),
                detail: err.to_string(),
            });
        }
    }
    Ok(())
}

/// Brings `config.device` up with its address, mask and default route, and writes
/// `etc/resolv.conf` under `etc_dir` when DNS servers are given.
pub fn configure(config: &StaticConfig, etc_dir: &std::path::Path) -> Result<(), NetworkError> {
    let sock = control_socket()?;
    let dev = config.device.as_str();
    set_addr(&sock, libc::SIOCSIFADDR, "SIOCSIFADDR", dev, config.address)?;
    set_addr(
        &sock,
        libc::SIOCSIFNETMASK,
        "SIOCSIFNETMASK",
        dev,
        config.netmask,
    )?;
    link_up(dev)?;
    if let Some(gateway) = config.gateway {
        add_default_route(&sock, dev, gateway)?;
    }
    if !config.dns.is_empty() {
        let text: String = config
            .dns
            .iter()
            .map(|s| format!("nameserver {s}\n"))
            .collect();
        let path = etc_dir.join("resolv.conf");
        // resolv.conf is often a dangling symlink (systemd-resolved); replace it.
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, text).map_err(|e| NetworkError::Ioctl {
            what: "writing resolv.conf",
            device: dev.into(),
            detail: e.to_string(),
        })?;
    }
    Ok(())
}

/// At boot as init: `lo` up, then the `ip=` interface. Failures are logged, not fatal.
pub fn setup_at_boot() {
    if let Err(e) = link_up("lo") {
        log::warn!("{e}");
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let Some(value) = ip_arg(&cmdline) else {
        return;
    };
    match parse_ip_arg(value) {
        Ok(Some(config)) => match configure(&config, std::path::Path::new("/etc")) {
            Ok(()) => log::info!(
                "network: {} is {}/{} via {}",
                config.device,
                config.address,
                u32::from(config.netmask).leading_ones(),
                config
                    .gateway
                    .map(|g| g.to_string())
                    .unwrap_or_else(|| "no gateway".into())
            ),
            Err(e) => log::warn!("network: {e}"),
        },
        Ok(None) => log::info!("network: ip={value} asks for autoconfiguration; not configured"),
        Err(e) => log::warn!("network: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firecracker_style_ip_argument() {
        let cmdline =
            "console=ttyS0 ip=172.16.0.2::172.16.0.1:255.255.255.252::eth0:off:1.1.1.1 quiet";
        let config = parse_ip_arg(ip_arg(cmdline).expect("ip="))
            .expect("parses")
            .expect("static");
        assert_eq!(
            config,
            StaticConfig {
                device: "eth0".into(),
                address: Ipv4Addr::new(172, 16, 0, 2),
                netmask: Ipv4Addr::new(255, 255, 255, 252),
                gateway: Some(Ipv4Addr::new(172, 16, 0, 1)),
                dns: vec![Ipv4Addr::new(1, 1, 1, 1)],
            }
        );
    }

    #[test]
    fn autoconf_and_bad_values() {
        assert_eq!(parse_ip_arg("dhcp"), Ok(None));
        assert_eq!(
            parse_ip_arg("10.0.0.2::10.0.0.1:255.255.255.0::eth0:dhcp"),
            Ok(None)
        );
        let err = parse_ip_arg("10.0.0.300").expect_err("bad address");
        assert!(
            err.to_string().contains("client address \"10.0.0.300\""),
            "{err}"
        );
        let err = parse_ip_arg("10.0.0.2:::255.0.255.0").expect_err("bad mask");
        assert!(err.to_string().contains("not contiguous"), "{err}");
        let defaults = parse_ip_arg("10.0.0.2").expect("ok").expect("static");
        assert_eq!(defaults.device, "eth0");
        assert_eq!(defaults.netmask, Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(defaults.gateway, None);
    }

    #[test]
    fn ifreq_layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<IfReqFlags>(), 40);
        assert_eq!(std::mem::size_of::<IfReqAddr>(), 40);
        assert_eq!(std::mem::size_of::<IfReqHwAddr>(), 40);
    }

    #[test]
    fn configure_network_requests() {
        let req = rollbox_agent_protocol::NetworkConfig {
            device: None,
            address: "10.200.0.6/30".into(),
            gateway: Some("10.200.0.5".into()),
            dns: vec!["10.200.0.5".into()],
            mac: Some("06:00:0a:c8:00:06".into()),
        };
        let (config, mac) = from_request(&req).expect("valid");
        assert_eq!(config.netmask, Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(config.device, "eth0");
        assert_eq!(mac, Some([6, 0, 10, 200, 0, 6]));
        for (field, bad) in [
            ("address", "10.200.0.6"),
            ("address", "10.200.0.6/33"),
            ("address", "10.200.0.x/30"),
        ] {
            let err = from_request(&rollbox_agent_protocol::NetworkConfig {
                address: bad.into(),
                ..req.clone()
            })
            .expect_err(bad);
            assert!(err.starts_with(field), "{err}");
        }
        let err = from_request(&rollbox_agent_protocol::NetworkConfig {
            mac: Some("01:00:00:00:00:01".into()),
            ..req.clone()
        })
        .expect_err("multicast");
        assert!(err.contains("unicast"), "{err}");
    }
}
