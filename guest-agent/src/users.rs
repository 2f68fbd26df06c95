//! User lookup by parsing /etc/passwd and /etc/group. The agent is static,
//! so it cannot rely on glibc's NSS (getpwnam) at run time.

use std::path::Path;

use rollbox_agent_protocol::{Account, ErrorInfo};

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("user {0:?} not found in /etc/passwd")]
    NoSuchUser(String),
    #[error("empty user name")]
    Empty,
}

/// Who a process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserIds {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (from /etc/group membership), primary included.
    pub groups: Vec<u32>,
    pub home: String,
    pub shell: String,
}

/// Look up `user` (a name or a numeric uid) in `<etc>/passwd` and `<etc>/group`.
/// A numeric uid missing from passwd is allowed: it runs with gid = uid, home `/`.
pub fn lookup(etc: &Path, user: &str) -> Result<UserIds, UserError> {
    if user.is_empty() {
        return Err(UserError::Empty);
    }
    let passwd_path = etc.join("passwd");
    let passwd = read_optional(&passwd_path)?;
    let group_path = etc.join("group");
    let groups = read_optional(&group_path)?;
    lookup_in(&passwd, &groups, user)
}

/// `LookupUser`: the account `user` names, or an `ENOENT` error naming it.
pub fn account(etc: &Path, user: &str) -> Result<Account, ErrorInfo> {
    let ids = lookup(etc, user).map_err(|err| match err {
        UserError::NoSuchUser(_) => ErrorInfo {
            code: "ENOENT".into(),
            errno: Some(libc::ENOENT),
            message: err.to_string(),
        },
        UserError::Empty => ErrorInfo::bad_request("lookup_user: the name is empty"),
        UserError::Read { .. } => ErrorInfo {
            code: "internal".into(),
            errno: None,
            message: err.to_string(),
        },
    })?;
    Ok(Account {
        name: ids.name,
        uid: ids.uid,
        gid: ids.gid,
        home: ids.home,
        shell: ids.shell,
    })
}

/// The uid and gid a write's `owner` names; a bad request naming the write's path if none.
pub fn owner(etc: &Path, user: &str, path: &str) -> Result<(u32, u32), ErrorInfo> {
    lookup(etc, user)
        .map(|ids| (ids.uid, ids.gid))
        .map_err(|err| ErrorInfo::bad_request(format!("write {path}: owner: {err}")))
}

fn read_optional(path: &Path) -> Result<String, UserError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(UserError::Read {
            path: path.display().to_string(),
            source,
        }),
    }
}

pub fn lookup_in(passwd: &str, group: &str, user: &str) -> Result<UserIds, UserError> {
    let numeric = user.parse::<u32>().ok();
    let entry = passwd
        .lines()
        .filter_map(parse_passwd_line)
        .find(|e| match numeric {
            Some(uid) => e.uid == uid,
            None => e.name == user,
        });
    let mut ids = match (entry, numeric) {
        (Some(entry), _) => entry,
        (None, Some(uid)) => UserIds {
            name: uid.to_string(),
            uid,
            gid: uid,
            groups: Vec::new(),
            home: "/".into(),
            shell: "/bin/sh".into(),
        },
        (None, None) => return Err(UserError::NoSuchUser(user.to_owned())),
    };
    ids.groups.push(ids.gid);
    for line in group.lines() {
        let mut fields = line.split(':');
        let (Some(_name), Some(_pw), Some(gid), Some(members)) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Ok(gid) = gid.parse::<u32>() else {
            continue;
        };
        if members.split(',').any(|m| m.trim() == ids.name) && !ids.groups.contains(&gid) {
            ids.groups.push(gid);
        }
    }
    Ok(ids)
}

fn parse_passwd_line(line: &str) -> Option<UserIds> {
    if line.starts_with('#') {
        return None;
    }
    let fields: Vec<&str> = line.split(':').collect();
    if fields.len() < 7 {
        return None;
    }
    Some(UserIds {
        name: fields[0].to_owned(),
        uid: fields[2].parse().ok()?,
        gid: fields[3].parse().ok()?,
        groups: Vec::new(),
        home: fields[5].to_owned(),
        shell: fields[6].to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n# comment\nbroken line\nalice:x:1000:1000:Alice:/home/alice:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nalice:x:1000:\ndocker:x:999:bob,alice\nwheel:x:10:bob\n";

    #[test]
    fn by_name_with_supplementary_groups() {
        let ids = lookup_in(PASSWD, GROUP, "alice").expect("alice");
        assert_eq!((ids.uid, ids.gid), (1000, 1000));
        assert_eq!(ids.groups, vec![1000, 999]);
        assert_eq!(ids.home, "/home/alice");
    }

    #[test]
    fn by_uid_and_unknown_uid() {
        assert_eq!(lookup_in(PASSWD, GROUP, "0").expect("root").name, "root");
        let ids = lookup_in(PASSWD, GROUP, "4242").expect("numeric");
        assert_eq!((ids.uid, ids.gid, ids.home.as_str()), (4242, 4242, "/"));
    }

    #[test]
    fn accounts_and_owners_from_an_etc_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("passwd"), PASSWD).expect("passwd");
        let alice = account(dir.path(), "alice").expect("alice");
        assert_eq!((alice.uid, alice.home.as_str()), (1000, "/home/alice"));
        let missing = account(dir.path(), "user").expect_err("no user");
        assert_eq!(missing.code, "ENOENT");
        assert!(missing.message.contains("\"user\""), "{missing}");
        assert_eq!(
            owner(dir.path(), "alice", "/x").expect("owner"),
            (1000, 1000)
        );
        let bad = owner(dir.path(), "bob", "/x").expect_err("no bob");
        assert!(bad.message.contains("write /x: owner"), "{bad}");
    }

    #[test]
    fn unknown_name_is_an_error_naming_it() {
        let err = lookup_in(PASSWD, GROUP, "mallory").expect_err("unknown");
        assert!(err.to_string().contains("\"mallory\""), "{err}");
        assert!(
            lookup_in(PASSWD, GROUP, "").is_err() || lookup(Path::new("/nonexistent"), "").is_err()
        );
    }
}
