//! Layered roots: a sandbox of a template that shares its image's lower layers boots from a
//! writable top disk (/dev/vda) whose `/.rollbox/upper` goes over a shared, read-only base
//! disk. The kernel command line names the base with `rollbox.lower=DEV` (e.g. `/dev/vdb`);
//! as init, before anything else, the agent mounts the base at `/.rollbox/lower`, the overlay
//! at `/.rollbox/root`, and makes the overlay the root (pivot_root). The old root, with any
//! /proc or /dev mounted on it, is detached; `init::init_system` mounts fresh ones after.

use std::path::Path;

use crate::errors::SysError;
use crate::init;

const KEY: &str = "rollbox.lower=";
const LOWER: &str = "/.rollbox/lower";
const UPPER: &str = "/.rollbox/upper";
const WORK: &str = "/.rollbox/work";
const ROOT: &str = "/.rollbox/root";

/// Why a layered root was not set up.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// `rollbox.lower=` does not name a device under /dev/.
    #[error("layered root: rollbox.lower={0:?}: expected a device under /dev/, e.g. /dev/vdb")]
    Syntax(String),
    /// A system call failed.
    #[error("layered root: {0}")]
    Sys(#[from] SysError),
}

/// The base device named by the last `rollbox.lower=` in `cmdline` (like the kernel, the last
/// of repeated arguments wins); `None` when there is none.
pub fn parse(cmdline: &str) -> Result<Option<String>, LayerError> {
    let Some(value) = cmdline
        .split_whitespace()
        .filter_map(|arg| arg.strip_prefix(KEY))
        .next_back()
    else {
        return Ok(None);
    };
    match value.strip_prefix("/dev/") {
        Some(name) if !name.is_empty() && !name.split('/').any(|part| part == "..") => {
            Ok(Some(value.to_string()))
        }
        _ => Err(LayerError::Syntax(value.to_string())),
    }
}

/// The overlay's mount options: the top disk's upper and work directories over the base.
fn overlay_options() -> String {
    format!("lowerdir={LOWER},upperdir={UPPER},workdir={WORK}")
}

/// When the kernel command line has `rollbox.lower=DEV`, makes the overlay of the top disk's
/// upper over DEV the root. Does nothing without it. Run as init, before `init_system`.
pub fn enter_from_cmdline() -> Result<(), LayerError> {
    // The kernel does not mount /proc for init; mount it to read the command line.
    init::mount(&init::PROC)?;
    let cmdline = std::fs::read_to_string("/proc/cmdline")
        .map_err(|e| SysError::new("read", "/proc/cmdline", e))?;
    let Some(dev) = parse(&cmdline)? else {
        return Ok(());
    };
    // The kernel's devtmpfs automount normally provides /dev; without it, mount it here.
    if !Path::new(&dev).exists() {
        init::mount(&init::DEV)?;
    }
    init::mount_fs(&dev, LOWER, "ext4", libc::MS_RDONLY, "").map_err(|e| {
        SysError::new(
            "cannot mount the template's shared base",
            format!("{dev} at {LOWER}"),
            e,
        )
    })?;
    init::mount_fs("overlay", ROOT, "overlay", 0, &overlay_options()).map_err(|e| {
        SysError::new(
            "cannot mount the overlay",
            format!("of {UPPER} over {dev} at {ROOT}"),
            e,
        )
    })?;
    pivot_into(ROOT)?;
    log::info!("root: overlay of {UPPER} over {dev}");
    Ok(())
}

/// Makes the mount point `new_root` the root and detaches the old root (man 2 pivot_root:
/// with new_root and put_old both ".", the old root ends up stacked on the new one).
fn pivot_into(new_root: &str) -> Result<(), SysError> {
    std::env::set_current_dir(new_root).map_err(|e| SysError::new("chdir", new_root, e))?;
    let dot = c".";
    // SAFETY: pivot_root takes two NUL-terminated paths that live across the call.
    if unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) } != 0 {
        return Err(SysError::new(
            "pivot_root into",
            new_root,
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: umount2 takes a NUL-terminated path that lives across the call.
    if unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(SysError::new(
            "detach the old root from",
            new_root,
            std::io::Error::last_os_error(),
        ));
    }
    std::env::set_current_dir("/").map_err(|e| SysError::new("chdir", "/", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_lower_means_no_layers() {
        assert_eq!(parse("").ok(), Some(None));
        assert_eq!(
            parse("console=ttyS0 root=/dev/vda rw init=/.rollbox/rollbox-agent").ok(),
            Some(None)
        );
        // A prefix of the key is another argument.
        assert_eq!(parse("rollbox.lowerx=/dev/vdb").ok(), Some(None));
    }

    #[test]
    fn finds_the_device_among_other_arguments() {
        let got =
            parse("console=ttyS0 root=/dev/vda rw rollbox.lower=/dev/vdb rollbox.volume=a:/b");
        assert_eq!(got.ok(), Some(Some("/dev/vdb".to_string())));
        let last = parse("rollbox.lower=/dev/vdb rollbox.lower=/dev/vdc");
        assert_eq!(last.ok(), Some(Some("/dev/vdc".to_string())));
    }

    #[test]
    fn refuses_empty_and_non_dev_values() {
        for bad in [
            "",
            "vdb",
            "/dev/",
            "/tmp/base.img",
            "/dev/../etc/x",
            "dev/vdb",
        ] {
            let err = parse(&format!("root=/dev/vda rollbox.lower={bad} rw")).err();
            assert!(
                matches!(&err, Some(LayerError::Syntax(v)) if v == bad),
                "{bad:?}: {err:?}"
            );
        }
        let message = parse("rollbox.lower=").err().map(|e| e.to_string());
        assert_eq!(
            message.as_deref(),
            Some("layered root: rollbox.lower=\"\": expected a device under /dev/, e.g. /dev/vdb")
        );
    }

    #[test]
    fn overlay_puts_the_top_disk_over_the_base() {
        assert_eq!(
            overlay_options(),
            "lowerdir=/.rollbox/lower,upperdir=/.rollbox/upper,workdir=/.rollbox/work"
        );
    }

    #[test]
    fn errors_name_the_device_and_mount_point() {
        let err = LayerError::from(SysError::new(
            "cannot mount the template's shared base",
            format!("/dev/vdb at {LOWER}"),
            std::io::Error::from_raw_os_error(libc::ENOENT),
        ));
        assert_eq!(
            err.to_string(),
            "layered root: cannot mount the template's shared base /dev/vdb at /.rollbox/lower: No such file or directory"
        );
    }
}
