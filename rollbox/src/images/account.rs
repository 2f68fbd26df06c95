//! E2B's default account: every image build gives the rootfs a user `user` with home
//! `/home/user` (E2B templates run commands as that user there), unless the image already has
//! one. The account is added the way `useradd -m` would: a free uid (1000 if free), a group of
//! its own, the image's `/etc/skel` files, a locked password, bash if the image has it. Images
//! without a regular `/etc/passwd` (scratch images) are left as they are. Nothing here changes
//! who the native API runs commands as (root unless a request names a user).

use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The account's name and home, as E2B's templates have them.
pub const E2B_USER: &str = "user";
pub const E2B_HOME: &str = "/home/user";
/// The first uid and gid `useradd` hands out to people.
const FIRST_ID: u32 = 1000;
/// Symlinks followed when looking for the shell, as the kernel's limit.
const MAX_HOPS: usize = 40;

#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    #[error("cannot {action} {path} in the image: {source}")]
    Io {
        action: &'static str,
        path: String,
        source: io::Error,
    },
    #[error("no free uid or gid from {FIRST_ID} up in the image's {file}")]
    NoFreeId { file: &'static str },
}

/// What [`ensure_e2b_user`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The account was added with these ids and shell.
    Added { uid: u32, gid: u32, shell: String },
    /// The image already had a `user`; it is left alone.
    Kept,
    /// Nothing was added, for this reason.
    Skipped(String),
}

/// Adds E2B's `user` to the rootfs at `root` when the image has none (see the module doc).
pub fn ensure_e2b_user(root: &Path) -> Result<Outcome, AccountError> {
    let etc = root.join("etc");
    let passwd_path = etc.join("passwd");
    if !is_real_dir(&etc)? || !is_regular(&passwd_path)? {
        return Ok(Outcome::Skipped(
            "the image has no regular /etc/passwd".into(),
        ));
    }
    let passwd = read(&passwd_path)?;
    if names(&passwd).any(|name| name == E2B_USER) {
        return Ok(Outcome::Kept);
    }
    let home_parent = root.join("home");
    let home = home_parent.join(E2B_USER);
    if exists(&home_parent)? && !is_real_dir(&home_parent)? {
        return Ok(Outcome::Skipped("/home is not a directory".into()));
    }
    if exists(&home)? && !is_real_dir(&home)? {
        return Ok(Outcome::Skipped(format!("{E2B_HOME} is not a directory")));
    }

    let group_path = etc.join("group");
    let group = if is_regular(&group_path)? {
        Some(read(&group_path)?)
    } else {
        None
    };
    let uid = free_id(&passwd, FIRST_ID).ok_or(AccountError::NoFreeId { file: "passwd" })?;
    let existing_gid = group.as_deref().and_then(|g| group_id(g, E2B_USER));
    let gid = match (existing_gid, group.as_deref()) {
        (Some(gid), _) => gid,
        (None, Some(group)) => {
            let wanted = if id_taken(group, uid) { FIRST_ID } else { uid };
            free_id(group, wanted).ok_or(AccountError::NoFreeId { file: "group" })?
        }
        (None, None) => uid,
    };
    let shell = if exists_in_root(root, "/bin/bash") {
        "/bin/bash"
    } else {
        "/bin/sh"
    }
    .to_string();

    append(
        &passwd_path,
        &passwd,
        &format!("{E2B_USER}:x:{uid}:{gid}::{E2B_HOME}:{shell}\n"),
    )?;
    if let (Some(group), None) = (&group, existing_gid) {
        append(&group_path, group, &format!("{E2B_USER}:x:{gid}:\n"))?;
    }
    // Locked passwords, where the image keeps shadow files.
    for (file, line) in [
        ("shadow", format!("{E2B_USER}:!::0:99999:7:::\n")),
        ("gshadow", format!("{E2B_USER}:!::\n")),
    ] {
        let path = etc.join(file);
        if file == "gshadow" && existing_gid.is_some() {
            continue;
        }
        if is_regular(&path)? {
            let text = read(&path)?;
            if !names(&text).any(|name| name == E2B_USER) {
                append(&path, &text, &line)?;
            }
        }
    }
    make_home(root, &home, uid, gid)?;
    Ok(Outcome::Added { uid, gid, shell })
}

/// `/home/user` (0750, the user's), with the image's `/etc/skel` files copied in.
fn make_home(root: &Path, home: &Path, uid: u32, gid: u32) -> Result<(), AccountError> {
    let parent = root.join("home");
    if !exists(&parent)? {
        fs::create_dir(&parent).map_err(io_error("create", &parent))?;
        fs::set_permissions(&parent, Permissions::from_mode(0o755))
            .map_err(io_error("chmod", &parent))?;
    }
    if !exists(home)? {
        fs::create_dir(home).map_err(io_error("create", home))?;
        fs::set_permissions(home, Permissions::from_mode(0o750))
            .map_err(io_error("chmod", home))?;
    }
    std::os::unix::fs::lchown(home, Some(uid), Some(gid)).map_err(io_error("chown", home))?;
    let skel = root.join("etc/skel");
    if !is_real_dir(&skel)? {
        return Ok(());
    }
    for entry in fs::read_dir(&skel).map_err(io_error("list", &skel))? {
        let entry = entry.map_err(io_error("list", &skel))?;
        let from = entry.path();
        let to = home.join(entry.file_name());
        // Regular files only: a symlink in an image must not make the build read the host.
        if !is_regular(&from)? || exists(&to)? {
            continue;
        }
        fs::copy(&from, &to).map_err(io_error("copy", &from))?;
        std::os::unix::fs::lchown(&to, Some(uid), Some(gid)).map_err(io_error("chown", &to))?;
    }
    Ok(())
}

fn io_error<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> AccountError + 'a {
    move |source| AccountError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

/// The entry at `path` itself (a symlink is not followed), or None.
fn lstat(path: &Path) -> Result<Option<fs::Metadata>, AccountError> {
    match fs::symlink_metadata(path) {
        Ok(meta) => Ok(Some(meta)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error("inspect", path)(e)),
    }
}

fn exists(path: &Path) -> Result<bool, AccountError> {
    Ok(lstat(path)?.is_some())
}

fn is_real_dir(path: &Path) -> Result<bool, AccountError> {
    Ok(lstat(path)?.is_some_and(|m| m.is_dir()))
}

fn is_regular(path: &Path) -> Result<bool, AccountError> {
    Ok(lstat(path)?.is_some_and(|m| m.is_file()))
}

fn read(path: &Path) -> Result<String, AccountError> {
    let bytes = fs::read(path).map_err(io_error("read", path))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Appends `line` to the file whose current text is `text` (a missing final newline first),
/// never through a symlink.
fn append(path: &Path, text: &str, line: &str) -> Result<(), AccountError> {
    let mut file = OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_error("open", path))?;
    let mut out = String::new();
    if !text.is_empty() && !text.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(line);
    file.write_all(out.as_bytes())
        .map_err(io_error("write", path))
}

/// The first field of each entry of a passwd, group or shadow file.
fn names(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(':').next())
        .filter(|n| !n.is_empty())
}

/// The ids (third field) a passwd or group file uses.
fn ids(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(':').nth(2))
        .filter_map(|id| id.trim().parse().ok())
}

fn id_taken(text: &str, id: u32) -> bool {
    ids(text).any(|used| used == id)
}

/// The lowest id from `from` up that `text` does not use.
fn free_id(text: &str, from: u32) -> Option<u32> {
    (from..u32::MAX).find(|id| !id_taken(text, *id))
}

fn group_id(group: &str, name: &str) -> Option<u32> {
    group
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 3 && f[0] == name)
        .and_then(|f| f[2].trim().parse().ok())
}

/// True when `path` (absolute, as the guest sees it) names something in the rootfs at `root`,
/// following the image's symlinks inside the root (absolute ones from the root).
fn exists_in_root(root: &Path, path: &str) -> bool {
    let mut pending: Vec<String> = path
        .split('/')
        .filter(|p| !p.is_empty())
        .rev()
        .map(str::to_string)
        .collect();
    let mut resolved = PathBuf::new();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        if part == "." {
            continue;
        }
        if part == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&part);
        let Ok(meta) = fs::symlink_metadata(root.join(&candidate)) else {
            return false;
        };
        if !meta.file_type().is_symlink() {
            resolved = candidate;
            continue;
        }
        hops += 1;
        let Ok(target) = fs::read_link(root.join(&candidate)) else {
            return false;
        };
        if hops > MAX_HOPS {
            return false;
        }
        if target.has_root() {
            resolved = PathBuf::new();
        }
        for component in target.components().rev() {
            match component {
                Component::Normal(name) => pending.push(name.to_string_lossy().into_owned()),
                Component::ParentDir => pending.push("..".into()),
                _ => {}
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    // Test code: a panic on a broken fixture is the failure report.
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn image(passwd: &str, group: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("etc")).unwrap();
        fs::write(dir.path().join("etc/passwd"), passwd).unwrap();
        if let Some(group) = group {
            fs::write(dir.path().join("etc/group"), group).unwrap();
        }
        dir
    }

    fn text(root: &Path, rel: &str) -> String {
        fs::read_to_string(root.join(rel)).unwrap()
    }

    #[test]
    fn an_image_without_user_gets_one_with_uid_1000() {
        let dir = image("root:x:0:0:root:/root:/bin/sh", Some("root:x:0:\n"));
        let root = dir.path();
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::write(root.join("usr/bin/bash"), b"").unwrap();
        // A merged /usr: /bin is a relative link, bash is reached through it.
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
        fs::create_dir_all(root.join("etc/skel")).unwrap();
        fs::write(root.join("etc/skel/.profile"), b"# profile\n").unwrap();
        fs::write(root.join("etc/shadow"), "root:*::0:99999:7:::\n").unwrap();
        let outcome = ensure_e2b_user(root).unwrap();
        assert_eq!(
            outcome,
            Outcome::Added {
                uid: 1000,
                gid: 1000,
                shell: "/bin/bash".into()
            }
        );
        assert_eq!(
            text(root, "etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n"
        );
        assert_eq!(text(root, "etc/group"), "root:x:0:\nuser:x:1000:\n");
        assert!(text(root, "etc/shadow").ends_with("\nuser:!::0:99999:7:::\n"));
        let home = fs::symlink_metadata(root.join("home/user")).unwrap();
        assert!(home.is_dir());
        assert_eq!(
            (home.uid(), home.gid(), home.mode() & 0o7777),
            (1000, 1000, 0o750)
        );
        let profile = fs::symlink_metadata(root.join("home/user/.profile")).unwrap();
        assert_eq!((profile.uid(), profile.gid()), (1000, 1000));
        // A second build step finds it and keeps it.
        assert_eq!(ensure_e2b_user(root).unwrap(), Outcome::Kept);
    }

    #[test]
    fn an_existing_user_is_left_alone() {
        let passwd = "root:x:0:0::/root:/bin/sh\nuser:x:1500:1500::/srv/user:/bin/zsh\n";
        let dir = image(passwd, Some("root:x:0:\n"));
        assert_eq!(ensure_e2b_user(dir.path()).unwrap(), Outcome::Kept);
        assert_eq!(text(dir.path(), "etc/passwd"), passwd);
        assert_eq!(text(dir.path(), "etc/group"), "root:x:0:\n");
        assert!(!dir.path().join("home").exists());
    }

    #[test]
    fn a_taken_uid_1000_moves_to_the_next_free_one() {
        let dir = image(
            "root:x:0:0::/root:/bin/sh\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\nx:x:1001:1001::/:/bin/sh\n",
            Some("root:x:0:\nubuntu:x:1000:\nx:x:1001:\n"),
        );
        let outcome = ensure_e2b_user(dir.path()).unwrap();
        assert_eq!(
            outcome,
            Outcome::Added {
                uid: 1002,
                gid: 1002,
                shell: "/bin/sh".into()
            }
        );
        assert!(text(dir.path(), "etc/passwd").ends_with("user:x:1002:1002::/home/user:/bin/sh\n"));
        assert!(text(dir.path(), "etc/group").ends_with("user:x:1002:\n"));
    }

    #[test]
    fn an_existing_user_group_is_reused() {
        let dir = image(
            "root:x:0:0::/root:/bin/sh\n",
            Some("root:x:0:\nuser:x:2000:\n"),
        );
        let outcome = ensure_e2b_user(dir.path()).unwrap();
        assert!(
            matches!(
                outcome,
                Outcome::Added {
                    uid: 1000,
                    gid: 2000,
                    ..
                }
            ),
            "{outcome:?}"
        );
        assert_eq!(text(dir.path(), "etc/group"), "root:x:0:\nuser:x:2000:\n");
    }

    #[test]
    fn scratch_images_and_symlinked_passwd_are_skipped() {
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            ensure_e2b_user(empty.path()).unwrap(),
            Outcome::Skipped(_)
        ));
        // An image's /etc/passwd that points out of the root must never be written.
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("passwd"), dir.path().join("etc/passwd"))
            .unwrap();
        assert!(matches!(
            ensure_e2b_user(dir.path()).unwrap(),
            Outcome::Skipped(_)
        ));
        assert_eq!(
            text(outside.path(), "passwd"),
            "root:x:0:0::/root:/bin/sh\n"
        );
    }

    #[test]
    fn shells_are_found_through_absolute_links_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("usr/bin")).unwrap();
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::write(root.join("usr/bin/bash"), b"").unwrap();
        std::os::unix::fs::symlink("/usr/bin/bash", root.join("bin/bash")).unwrap();
        assert!(exists_in_root(root, "/bin/bash"));
        assert!(!exists_in_root(root, "/bin/zsh"));
        std::os::unix::fs::symlink("/bin/loop", root.join("bin/loop")).unwrap();
        assert!(!exists_in_root(root, "/bin/loop"));
    }
}
