//! A tap device opened with a virtio-net header, the backend of virtio-net.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Mutex, PoisonError};

/// Longest interface name Linux accepts (IFNAMSIZ minus the NUL).
pub const MAX_NAME_LEN: usize = 15;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Offloads the host may hand the guest (`TUNSETOFFLOAD`).
pub mod offload {
    /// Partial checksums.
    pub const CSUM: u32 = 0x01;
    /// TCP segmentation over IPv4.
    pub const TSO4: u32 = 0x02;
    /// TCP segmentation over IPv6.
    pub const TSO6: u32 = 0x04;
    /// TSO with ECN.
    pub const TSO_ECN: u32 = 0x08;
}

/// Errors opening or using a tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The name is empty, too long or has characters Linux refuses.
    #[error("tap name {0:?} is invalid: use 1-15 bytes without '/', ':' or whitespace")]
    Name(String),
    /// /dev/net/tun could not be opened.
    #[error("tap {name}: cannot open /dev/net/tun: {source}")]
    OpenTun {
        /// Tap name.
        name: String,
        /// Why.
        source: std::io::Error,
    },
    /// Another process holds the tap.
    #[error("tap {0} is in use by another process (one VM per tap)")]
    Busy(String),
    /// No permission to attach to or create the tap.
    #[error("tap {0}: permission denied (creating or attaching a tap needs CAP_NET_ADMIN, or a persistent tap owned by this user)")]
    Permission(String),
    /// A descriptor handed down for the tap is not that tap, opened the way virtio-net needs.
    #[error("tap {name}: the descriptor handed down for it is {found} (want a tap opened with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)")]
    NotThatTap {
        /// Tap name.
        name: String,
        /// What the descriptor is.
        found: String,
    },
    /// Another ioctl failed.
    #[error("tap {name}: {what}: {source}")]
    Ioctl {
        /// Tap name.
        name: String,
        /// The operation.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// Checks an interface name the way Linux's `dev_valid_name` does.
pub fn check_name(name: &str) -> Result<(), TapError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b == 0);
    if ok {
        Ok(())
    } else {
        Err(TapError::Name(name.into()))
    }
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open tap queue.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to tap `name` (creating it if it does not exist, which needs CAP_NET_ADMIN),
    /// non-blocking, with a 12-byte virtio-net header in front of every frame.
    pub fn open(name: &str) -> Result<Self, TapError> {
        check_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|source| TapError::OpenTun {
                name: name.into(),
                source,
            })?;
        let mut req = IfReq {
            name: [0; 16],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq; `req` is a 40-byte ifreq-shaped
        // struct that lives for the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::EBUSY) => TapError::Busy(name.into()),
                Some(libc::EPERM) | Some(libc::EACCES) => TapError::Permission(name.into()),
                _ => TapError::Ioctl {
                    name: name.into(),
                    what: "TUNSETIFF",
                    source: err,
                },
            });
        }
        let tap = Tap {
            file,
            name: name.into(),
        };
        let hdr_len: libc::c_int = super::VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int through the pointer, which lives for the call.
        let rc = unsafe { libc::ioctl(tap.file.as_raw_fd(), TUNSETVNETHDRSZ, &hdr_len) };
        if rc < 0 {
            return Err(tap.ioctl_err("TUNSETVNETHDRSZ"));
        }
        Ok(tap)
    }

    /// The tap `name`: the descriptor the caller attached already when `attached` has one
    /// ([`AttachedTaps`]), else [`Tap::open`].
    pub fn open_or_attached(name: &str, attached: &AttachedTaps) -> Result<Self, TapError> {
        match attached.take(name) {
            Some(file) => Tap::adopt(name, file),
            None => Tap::open(name),
        }
    }

    /// Takes a descriptor already attached to tap `name` (`TUNSETIFF` done by whoever handed
    /// it down, in its own network namespace): checks it is that tap with virtio-net's flags,
    /// makes it non-blocking and sets the header size.
    fn adopt(name: &str, file: File) -> Result<Self, TapError> {
        check_name(name)?;
        let mut req = IfReq {
            name: [0; 16],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes an ifreq; `req` is a 40-byte ifreq-shaped struct that
        // lives for the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNGETIFF, &mut req) };
        let found = if rc < 0 {
            Some(format!(
                "not an attached tap ({})",
                std::io::Error::last_os_error()
            ))
        } else {
            let len = req.name.iter().position(|&b| b == 0).unwrap_or(16);
            let got = String::from_utf8_lossy(&req.name[..len]).into_owned();
            let want = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
            (got != name || req.flags & want != want)
                .then(|| format!("tap {got:?} with flags {:#x}", req.flags))
        };
        if let Some(found) = found {
            return Err(TapError::NotThatTap {
                name: name.into(),
                found,
            });
        }
        let tap = Tap {
            file,
            name: name.into(),
        };
        // SAFETY: F_GETFL/F_SETFL on a descriptor we own; no memory is shared.
        let rc = unsafe {
            let flags = libc::fcntl(tap.file.as_raw_fd(), libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(
                    tap.file.as_raw_fd(),
                    libc::F_SETFL,
                    flags | libc::O_NONBLOCK,
                )
            }
        };
        if rc < 0 {
            return Err(tap.ioctl_err("F_SETFL O_NONBLOCK"));
        }
        let hdr_len: libc::c_int = super::VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int through the pointer, which lives for the call.
        let rc = unsafe { libc::ioctl(tap.file.as_raw_fd(), TUNSETVNETHDRSZ, &hdr_len) };
        if rc < 0 {
            return Err(tap.ioctl_err("TUNSETVNETHDRSZ"));
        }
        Ok(tap)
    }

    fn ioctl_err(&self, what: &'static str) -> TapError {
        TapError::Ioctl {
            name: self.name.clone(),
            what,
            source: std::io::Error::last_os_error(),
        }
    }

    /// Tells the kernel which offloads the guest accepts on frames it receives.
    pub fn set_offload(&self, flags: u32) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value; no memory is shared.
        let rc = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if rc < 0 {
            return Err(self.ioctl_err("TUNSETOFFLOAD"));
        }
        Ok(())
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame (with its virtio-net header); `WouldBlock` when none is queued.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.file.read(buf)
    }

    /// Writes one frame (with its virtio-net header).
    pub fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        self.file.write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Taps a caller attached already, by name, on descriptors it handed down (`rollbox-vmm
/// --tap-fd NAME=FD`). A jailed VMM sits in an empty network namespace, where the host's taps
/// are out of reach by name; whoever made the tap attaches it in the host's namespace and
/// passes the descriptor in, so no other process can attach it. Each is taken once, by the
/// interface (boot or restore) on that tap; clones share the map.
#[derive(Debug, Clone, Default)]
pub struct AttachedTaps(Arc<Mutex<HashMap<String, File>>>);

impl AttachedTaps {
    /// Adds the descriptor of tap `name`.
    pub fn insert(&self, name: String, file: File) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name, file);
    }

    /// Takes the descriptor of tap `name`, if one was handed down and not taken yet.
    pub fn take(&self, name: &str) -> Option<File> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name)
    }

    /// The taps not taken yet, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }
}

/// Equal when the same taps wait to be taken (descriptors are not compared).
impl PartialEq for AttachedTaps {
    fn eq(&self, other: &Self) -> bool {
        self.names() == other.names()
    }
}

impl Eq for AttachedTaps {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_linux_refuses_are_refused() {
        for bad in ["", "a/b", "has space", "sixteen-chars-xx", ".", "..", "a:b"] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
        check_name("tap0").expect("tap0");
        check_name("fifteen-chars-x").expect("15 bytes");
    }

    #[test]
    fn ifreq_has_the_kernel_size() {
        assert_eq!(std::mem::size_of::<IfReq>(), 40);
    }

    #[test]
    fn a_descriptor_that_is_not_the_tap_is_refused_by_name() {
        let taps = AttachedTaps::default();
        let file = File::open("/dev/null").expect("/dev/null");
        taps.insert("rbxtest0".into(), file);
        assert_eq!(taps.names(), vec!["rbxtest0".to_string()]);
        let err = Tap::open_or_attached("rbxtest0", &taps).expect_err("/dev/null is no tap");
        assert!(
            err.to_string().starts_with(
                "tap rbxtest0: the descriptor handed down for it is not an attached tap"
            ),
            "{err}"
        );
        assert!(taps.take("rbxtest0").is_none(), "taken once");
    }
}
