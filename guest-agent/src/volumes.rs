//! Shared volumes (virtio-fs) named on the kernel command line and mounted at boot:
//! `rollbox.volume=TAG:/mnt/path[:ro]`, one argument per volume. Dotted kernel arguments are
//! not passed to init's argv or environment, so they are read from /proc/cmdline.

use crate::errors::SysError;

/// One volume to mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// The virtio-fs tag.
    pub tag: String,
    /// Absolute mount point in the guest.
    pub target: String,
    /// Mount read-only.
    pub read_only: bool,
}

/// Why a `rollbox.volume=` argument was not understood.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VolumeError {
    /// Not TAG:/absolute/path[:ro].
    #[error("rollbox.volume={0}: expected TAG:/absolute/path[:ro]")]
    Syntax(String),
}

const KEY: &str = "rollbox.volume=";

/// The volumes named in `cmdline`; malformed entries come back as errors beside them.
pub fn parse(cmdline: &str) -> Vec<Result<Volume, VolumeError>> {
    cmdline
        .split_whitespace()
        .filter_map(|arg| arg.strip_prefix(KEY))
        .map(|value| {
            let bad = || VolumeError::Syntax(value.to_string());
            let mut parts = value.split(':');
            let tag = parts.next().filter(|t| !t.is_empty()).ok_or_else(bad)?;
            let target = parts
                .next()
                .filter(|t| t.starts_with('/'))
                .ok_or_else(bad)?;
            let read_only = match parts.next() {
                None => false,
                Some("ro") => true,
                Some("rw") => false,
                Some(_) => return Err(bad()),
            };
            if parts.next().is_some() {
                return Err(bad());
            }
            Ok(Volume {
                tag: tag.to_string(),
                target: target.to_string(),
                read_only,
            })
        })
        .collect()
}

fn mount(volume: &Volume) -> Result<(), SysError> {
    let fail = |e| SysError::new("mount virtiofs", volume.target.as_str(), e);
    std::fs::create_dir_all(&volume.target).map_err(fail)?;
    let flags = if volume.read_only { libc::MS_RDONLY } else { 0 };
    crate::init::mount_fs(&volume.tag, &volume.target, "virtiofs", flags, "").map_err(fail)
}

/// Mounts every volume named on the kernel command line. Failures are logged, not fatal: the
/// agent still serves requests, and a test or a user sees the missing mount.
pub fn mount_from_cmdline() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    for volume in parse(&cmdline) {
        match volume.map_err(|e| e.to_string()).and_then(|v| {
            mount(&v).map_err(|e| e.to_string())?;
            Ok(v)
        }) {
            Ok(v) => log::info!("volume {} mounted at {}", v.tag, v.target),
            Err(e) => log::warn!("{e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_volumes_and_refuses_bad_ones() {
        let got = parse("console=ttyS0 rollbox.volume=data:/mnt/data rollbox.volume=ro:/srv:ro init=/x rollbox.volume=bad rollbox.volume=x:rel rollbox.volume=y:/a:rx");
        assert_eq!(
            got[0],
            Ok(Volume {
                tag: "data".into(),
                target: "/mnt/data".into(),
                read_only: false
            })
        );
        assert!(matches!(&got[1], Ok(v) if v.read_only && v.target == "/srv"));
        assert_eq!(got[2], Err(VolumeError::Syntax("bad".into())));
        assert!(got[3].is_err());
        assert!(got[4].is_err());
        assert_eq!(got.len(), 5);
        assert!(parse("console=ttyS0").is_empty());
    }
}
