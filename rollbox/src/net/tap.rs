//! Host-side interfaces: persistent taps made with ioctls on /dev/net/tun, their IPv4 address
//! and link state (ioctls on an AF_INET socket), the veth stand-in tests use, the host's
//! routes, and the forwarding sysctl.

use std::fs::{self, File, OpenOptions};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::cidr::Ipv4Net;

/// Interface failures, each naming the interface.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("interface {name} already exists (left over from an earlier sandbox? `rollbox net gc` removes ours)")]
    Exists { name: String },
    #[error("cannot open /dev/net/tun: {0} (is the tun module loaded? `modprobe tun`; this needs root or CAP_NET_ADMIN)")]
    NoTun(std::io::Error),
    #[error("{op} on {name}: {source}")]
    Ioctl {
        op: &'static str,
        name: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
    #[error("{path}: {source}")]
    Sysctl {
        path: String,
        source: std::io::Error,
    },
}

/// The tap's flags: a tap without packet info and with a virtio-net header, as the VMM opens it.
const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

/// `struct ifreq`: the interface name and a 24-byte union (flags or a sockaddr here).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> IfReq {
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        // Names are checked to be under IFNAMSIZ by the caller; a longer one is cut, and the
        // kernel then names a different interface, which the ioctls report.
        let len = name.len().min(libc::IFNAMSIZ - 1);
        req.name[..len].copy_from_slice(&name.as_bytes()[..len]);
        req
    }

    fn with_flags(name: &str, flags: libc::c_int) -> IfReq {
        let mut req = IfReq::new(name);
        // ifr_flags is a short.
        req.data[..2].copy_from_slice(&(flags as i16).to_ne_bytes());
        req
    }

    fn flags(&self) -> i16 {
        i16::from_ne_bytes([self.data[0], self.data[1]])
    }

    fn with_addr(name: &str, addr: Ipv4Addr) -> IfReq {
        let mut req = IfReq::new(name);
        // struct sockaddr_in: family (host order), port (network order), address (network order).
        let family = libc::AF_INET as u16;
        req.data[..2].copy_from_slice(&family.to_ne_bytes());
        req.data[4..8].copy_from_slice(&addr.octets());
        req
    }
}

/// `ioctl(fd, request, &mut req)`.
fn ioctl(
    fd: &OwnedFd,
    request: libc::Ioctl,
    req: &mut IfReq,
    op: &'static str,
    name: &str,
) -> Result<(), TapError> {
    // SAFETY: `req` is a live, writable struct laid out like the kernel's `struct ifreq`
    // (40 bytes), which every request used here reads and at most writes back.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, req as *mut IfReq) };
    if rc < 0 {
        return Err(TapError::Ioctl {
            op,
            name: name.to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn open_tun() -> Result<OwnedFd, TapError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map(OwnedFd::from)
        .map_err(TapError::NoTun)
}

/// Whether an interface of that name exists in this network namespace.
pub fn exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// The interfaces in this network namespace.
pub fn interfaces() -> Vec<String> {
    fs::read_dir("/sys/class/net")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Creates the persistent tap `name`; fails with [`TapError::Exists`] if any interface of
/// that name exists (IFF_TUN_EXCL makes the check and the creation one step).
pub fn create_tap(name: &str) -> Result<(), TapError> {
    if exists(name) {
        return Err(TapError::Exists {
            name: name.to_string(),
        });
    }
    let tun = open_tun()?;
    let mut req = IfReq::with_flags(name, TAP_FLAGS | libc::IFF_TUN_EXCL);
    match ioctl(&tun, libc::TUNSETIFF, &mut req, "TUNSETIFF", name) {
        Err(TapError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
            return Err(TapError::Exists {
                name: name.to_string(),
            })
        }
        other => other?,
    }
    set_persist(&tun, name, true)
}

/// TUNSETPERSIST on the tap `tun` is attached to.
fn set_persist(tun: &OwnedFd, name: &str, persist: bool) -> Result<(), TapError> {
    // SAFETY: TUNSETPERSIST takes its argument by value; no memory is passed.
    let rc = unsafe {
        libc::ioctl(
            tun.as_raw_fd(),
            libc::TUNSETPERSIST,
            libc::c_ulong::from(persist),
        )
    };
    if rc < 0 {
        return Err(TapError::Ioctl {
            op: "TUNSETPERSIST",
            name: name.to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Deletes the persistent tap `name` (attach, clear persistence, close), or, when a VMM still
/// has it open, with `ip link del`. Missing is fine.
pub fn delete_tap(name: &str) -> Result<(), TapError> {
    if !exists(name) {
        return Ok(());
    }
    let tun = open_tun()?;
    let mut req = IfReq::with_flags(name, TAP_FLAGS);
    match ioctl(&tun, libc::TUNSETIFF, &mut req, "TUNSETIFF", name) {
        // A VMM still has it open (one queue, one user): unregister it instead; the VMM's
        // descriptor then stops working.
        Err(TapError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::EBUSY) => {
            run_ip(&["link", "del", name], None)
        }
        other => {
            other?;
            set_persist(&tun, name, false)
        }
    }
}

fn inet_socket() -> Result<OwnedFd, TapError> {
    // SAFETY: plain socket(2) call; the returned descriptor is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(TapError::Ioctl {
            op: "socket(AF_INET)",
            name: String::new(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Gives `name` the address `addr/prefix` and brings it up; turns IPv6 off on it (guests are
/// IPv4 only, and a link-local IPv6 address would be a second way to reach the host).
pub fn configure(name: &str, addr: Ipv4Addr, netmask: Ipv4Addr) -> Result<(), TapError> {
    let sock = inet_socket()?;
    ioctl(
        &sock,
        libc::SIOCSIFADDR as libc::Ioctl,
        &mut IfReq::with_addr(name, addr),
        "SIOCSIFADDR",
        name,
    )?;
    ioctl(
        &sock,
        libc::SIOCSIFNETMASK as libc::Ioctl,
        &mut IfReq::with_addr(name, netmask),
        "SIOCSIFNETMASK",
        name,
    )?;
    let ipv6 = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    if Path::new(&ipv6).exists() {
        fs::write(&ipv6, "1").map_err(|source| TapError::Sysctl { path: ipv6, source })?;
    }
    let mut req = IfReq::new(name);
    ioctl(
        &sock,
        libc::SIOCGIFFLAGS as libc::Ioctl,
        &mut req,
        "SIOCGIFFLAGS",
        name,
    )?;
    let flags = libc::c_int::from(req.flags()) | libc::IFF_UP;
    ioctl(
        &sock,
        libc::SIOCSIFFLAGS as libc::Ioctl,
        &mut IfReq::with_flags(name, flags),
        "SIOCSIFFLAGS",
        name,
    )
}

/// The host's IPv4 routes in the main table (`/proc/net/route`): interface and destination.
pub fn routes() -> Vec<(String, Ipv4Net)> {
    fs::read_to_string("/proc/net/route")
        .map(|text| parse_routes(&text))
        .unwrap_or_default()
}

/// `/proc/net/route`'s lines: addresses are hex of the address's bytes as a native u32.
fn parse_routes(text: &str) -> Vec<(String, Ipv4Net)> {
    let hex = |field: &str| u32::from_str_radix(field, 16).ok().map(u32::to_ne_bytes);
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (iface, dest, mask) = (fields.first()?, hex(fields.get(1)?)?, hex(fields.get(7)?)?);
            let prefix = u8::try_from(u32::from_be_bytes(mask).count_ones()).ok()?;
            let net = Ipv4Net::new(Ipv4Addr::from(dest), prefix)?;
            Some((iface.to_string(), net))
        })
        .collect()
}

/// Turns on IPv4 forwarding (a host-wide setting) unless it is on; never turns it off.
/// Lets `name` route packets from and to 127.0.0.0/8 (`route_localnet`): what a port exposed
/// on 127.0.0.1 needs, DNAT-ed to the guest from the host's own loopback connections. The
/// input chain still drops every packet a guest sends to 127.0.0.0/8.
pub fn route_localnet(name: &str) -> Result<(), TapError> {
    let path = format!("/proc/sys/net/ipv4/conf/{name}/route_localnet");
    fs::write(&path, "1").map_err(|source| TapError::Sysctl { path, source })
}

pub fn enable_forwarding() -> Result<(), TapError> {
    let path = "/proc/sys/net/ipv4/ip_forward";
    let sysctl = |source| TapError::Sysctl {
        path: path.to_string(),
        source,
    };
    if fs::read_to_string(path).map_err(sysctl)?.trim() == "1" {
        return Ok(());
    }
    fs::write(path, "1").map_err(sysctl)
}

fn run_ip(args: &[&str], stdin: Option<&str>) -> Result<(), TapError> {
    let command = format!("ip {}", args.join(" "));
    let out = super::tool::run_piped(std::path::Path::new("ip"), args, stdin).map_err(|e| {
        TapError::Command {
            command: command.clone(),
            detail: e.to_string(),
        }
    })?;
    if !out.status.success() {
        return Err(TapError::Command {
            command,
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// The guest-side name of a veth stand-in.
pub fn veth_peer(name: &str) -> String {
    format!("{name}g")
}

/// Creates the veth pair `name` (host side) / `name`g (in `netns`, configured as the guest
/// would configure its eth0: `guest/prefix`, default route via `host`).
pub fn create_veth(
    name: &str,
    netns: &str,
    guest: Ipv4Addr,
    host: Ipv4Addr,
    prefix: u8,
) -> Result<(), TapError> {
    if exists(name) {
        return Err(TapError::Exists {
            name: name.to_string(),
        });
    }
    let peer = veth_peer(name);
    run_ip(
        &[
            "link", "add", name, "type", "veth", "peer", "name", &peer, "netns", netns,
        ],
        None,
    )?;
    let batch = format!(
        "addr add {guest}/{prefix} dev {peer}\nlink set {peer} up\nlink set lo up\nroute add default via {host}\n"
    );
    let configured = run_ip(&["-n", netns, "-batch", "-"], Some(&batch));
    if configured.is_err() {
        let _ = run_ip(&["link", "del", name], None);
    }
    configured
}

/// Deletes a veth pair by its host side (missing is fine).
pub fn delete_veth(name: &str) -> Result<(), TapError> {
    if !exists(name) {
        return Ok(());
    }
    match run_ip(&["link", "del", name], None) {
        Err(_) if !exists(name) => Ok(()),
        other => other,
    }
}

/// Opens the tap `name` as the VMM does (TUNSETIFF with the same flags); closing the file
/// leaves the persistent tap in place.
pub fn open_tap(name: &str) -> Result<File, TapError> {
    let tun = open_tun()?;
    let mut req = IfReq::with_flags(name, TAP_FLAGS);
    ioctl(&tun, libc::TUNSETIFF, &mut req, "TUNSETIFF", name)?;
    Ok(File::from(tun))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifreq_is_the_kernels_size_and_layout() {
        assert_eq!(std::mem::size_of::<IfReq>(), 40);
        let req = IfReq::with_addr("rbx0", Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(&req.name[..5], b"rbx0\0");
        assert_eq!(&req.data[4..8], &[10, 200, 0, 1]);
        let req = IfReq::with_flags("x", TAP_FLAGS);
        assert_eq!(req.flags(), 0x5002);
    }

    #[test]
    fn parses_proc_net_route() {
        let text =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        let routes = parse_routes(text);
        assert_eq!(routes.len(), 2);
        assert_eq!(routes[0].1.to_string(), "0.0.0.0/0");
        assert_eq!(routes[1].0, "docker0");
        if cfg!(target_endian = "little") {
            assert_eq!(routes[1].1.to_string(), "172.17.0.0/16");
        }
    }

    #[test]
    fn missing_interfaces_are_fine_to_delete() {
        assert!(delete_tap("rbxnosuchtap0").is_ok());
        assert!(delete_veth("rbxnosuchveth").is_ok());
        assert!(!exists("rbxnosuchtap0"));
    }
}
