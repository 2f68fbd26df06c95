//! Entry metadata: mode, owner, mtime and xattrs read from the tar header and its PAX
//! extensions, and applied to an entry once it exists.

use std::fs::{self, Permissions};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::context::LayerCtx;
use super::error::LayerError;
use crate::images::sys::{lsetxattr, set_times_nofollow};

/// Entry metadata that is applied after the entry itself is created.
pub(super) struct Meta {
    pub(super) mode: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) mtime: (i64, u32),
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The entry's metadata: its header's, with PAX `uid`, `gid` and `mtime` over them and PAX
/// `SCHILY.xattr.*` as the xattrs.
pub(super) fn read_meta<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<Meta> {
    let header = entry.header();
    let mut meta = Meta {
        mode: header.mode()?,
        uid: u32::try_from(header.uid()?).unwrap_or(u32::MAX),
        gid: u32::try_from(header.gid()?).unwrap_or(u32::MAX),
        mtime: (i64::try_from(header.mtime()?).unwrap_or(0), 0),
        xattrs: Vec::new(),
    };
    if let Some(extensions) = entry.pax_extensions()? {
        for extension in extensions {
            let extension = extension?;
            let key = extension.key_bytes();
            let value = extension.value_bytes();
            let number = || {
                std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u32>().ok())
            };
            if key == b"uid" {
                meta.uid = number().unwrap_or(meta.uid);
            } else if key == b"gid" {
                meta.gid = number().unwrap_or(meta.gid);
            } else if key == b"mtime" {
                meta.mtime = parse_pax_time(value).unwrap_or(meta.mtime);
            } else if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                meta.xattrs.push((name.to_vec(), value.to_vec()));
            }
        }
    }
    Ok(meta)
}

/// PAX times are decimal seconds with an optional fraction: `1700000000.123456789`.
fn parse_pax_time(value: &[u8]) -> Option<(i64, u32)> {
    let text = std::str::from_utf8(value).ok()?;
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let secs = secs.parse::<i64>().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let nanos = if digits.is_empty() {
        0
    } else {
        digits.parse::<u32>().ok()? * 10u32.pow(9 - digits.len() as u32)
    };
    Some((secs, nanos))
}

pub(super) fn system_time((secs, nanos): (i64, u32)) -> SystemTime {
    let offset = Duration::new(secs.unsigned_abs(), nanos);
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + offset
    } else {
        SystemTime::UNIX_EPOCH - offset
    }
}

/// Owner, mode (not of a symlink), xattrs and mtime of an entry just created.
pub(super) fn set_meta(
    ctx: &LayerCtx<'_>,
    full: &Path,
    meta: &Meta,
    is_symlink: bool,
) -> Result<(), LayerError> {
    std::os::unix::fs::lchown(full, Some(meta.uid), Some(meta.gid))
        .map_err(|e| ctx.io("chown", full, e))?;
    if !is_symlink {
        // chown clears set-id bits, so the mode goes second.
        fs::set_permissions(full, Permissions::from_mode(meta.mode & 0o7777))
            .map_err(|e| ctx.io("chmod", full, e))?;
    }
    set_xattrs(ctx, full, meta)?;
    set_times_nofollow(full, meta.mtime).map_err(|e| ctx.io("set mtime of", full, e))
}

/// The entry's extended attributes (PAX `SCHILY.xattr.*`), set without following a symlink.
pub(super) fn set_xattrs(ctx: &LayerCtx<'_>, full: &Path, meta: &Meta) -> Result<(), LayerError> {
    for (name, value) in &meta.xattrs {
        lsetxattr(full, name, value).map_err(|e| ctx.io("set extended attribute on", full, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_time_parsing() {
        assert_eq!(
            parse_pax_time(b"1700000000.5"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(parse_pax_time(b"12"), Some((12, 0)));
        assert_eq!(parse_pax_time(b"x"), None);
    }
}
