//! Size-limited volumes: an ext4 file system in an image file of the limit
//! (`STATE/volumes/.NAME.ext4`), loop-mounted (`nodev,nosuid`) at the volume's directory, so a
//! guest that writes past the limit gets ENOSPC from virtiofsd and the host's disk is safe.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The image file of the size-limited volume whose directory is `dir`.
pub fn image_of(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!(".{name}.ext4"))
}

/// Runs a tool; its stderr is the error.
fn run(command: &mut Command) -> Result<(), String> {
    let program = format!("{:?}", command.get_program());
    let out = command.output().map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether `dir` is a mount point (its device differs from its parent's).
pub fn is_mounted(dir: &Path) -> bool {
    let (Some(parent), Ok(meta)) = (dir.parent(), std::fs::metadata(dir)) else {
        return false;
    };
    std::fs::metadata(parent).is_ok_and(|p| p.dev() != meta.dev())
}

/// Makes the image of `mib` MiB, its file system, and mounts it at `dir` (made here), open to
/// every guest user like an unlimited volume's directory, its root owned by `owner` (its
/// virtiofsd runs as them). On error nothing is left.
pub fn make(dir: &Path, mib: u64, owner: Option<(u32, u32)>) -> Result<(), String> {
    let image = image_of(dir);
    let made = (|| {
        let file =
            std::fs::File::create(&image).map_err(|e| format!("{}: {e}", image.display()))?;
        file.set_len(mib << 20)
            .map_err(|e| format!("{}: {e}", image.display()))?;
        drop(file);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-E", "root_owner=0:0"])
            .arg(&image))?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        mount(dir)?;
        // A volume's root holds only what its users write.
        let _ = std::fs::remove_dir(dir.join("lost+found"));
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
            .and_then(|()| std::os::unix::fs::chown(dir, owner.map(|o| o.0), owner.map(|o| o.1)))
            .map_err(|e| format!("{}: {e}", dir.display()))
    })();
    if made.is_err() {
        let _ = unmake(dir);
    }
    made
}

/// Mounts the volume's image at `dir` (again, after a reboot), unless it is mounted.
pub fn mount(dir: &Path) -> Result<(), String> {
    if is_mounted(dir) {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    run(Command::new("mount")
        .args(["-o", "loop,nodev,nosuid"])
        .arg(image_of(dir))
        .arg(dir))
}

/// Unmounts `dir` and removes it and its image.
pub fn unmake(dir: &Path) -> Result<(), String> {
    if is_mounted(dir) {
        run(Command::new("umount").arg(dir))?;
    }
    let _ = std::fs::remove_dir(dir);
    match std::fs::remove_file(image_of(dir)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("{}: {e}", image_of(dir).display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_image_lies_beside_the_directory_hidden() {
        assert_eq!(
            image_of(Path::new("/state/volumes/traj")),
            Path::new("/state/volumes/.traj.ext4")
        );
        assert!(!is_mounted(Path::new("/nonexistent/dir")));
    }
}
