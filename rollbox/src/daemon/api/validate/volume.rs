//! Volumes: names, their routes and paths inside them, and the mounts of a create.

use std::path::PathBuf;

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::super::limits::{MAX_VOLUME_MIB, MAX_VOLUME_MOUNTS, MAX_VOLUME_NAME};
use super::super::model::{CreateVolume, VolumeMount, VolumeOp};
use super::{absolute, bad, from_json, in_range, query_pairs};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    name: String,
    host_path: Option<PathBuf>,
    size_limit_mib: Option<i64>,
}

/// A volume name: 1-32 bytes of `[a-z0-9_.-]`, starting with a letter or digit. It is the
/// guest's virtio-fs tag and a directory name under the state dir.
pub fn check_volume_name(name: &str, field: &str) -> Result<String, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_VOLUME_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-'));
    if ok {
        Ok(name.to_string())
    } else {
        Err(bad(format!(
            "{field}: {name:?} is not a volume name (1-{MAX_VOLUME_NAME} of a-z 0-9 _ . -, starting with a letter or digit)"
        )))
    }
}

/// POST /volumes.
pub fn parse_create(body: &[u8]) -> Result<Action, ApiError> {
    let body: CreateBody = from_json(body)?;
    let name = check_volume_name(&body.name, "name")?;
    if let Some(path) = &body.host_path {
        absolute(path, "host_path")?;
    }
    let size_limit_mib = in_range(body.size_limit_mib, "size_limit_mib", 8, MAX_VOLUME_MIB)?;
    if size_limit_mib.is_some() && body.host_path.is_some() {
        return Err(bad(
            "size_limit_mib: not with host_path (that directory's size is its file system's)",
        ));
    }
    Ok(Action::CreateVolume(CreateVolume {
        name,
        host_path: body.host_path,
        size_limit_mib: size_limit_mib.map(u64::from),
        tenant: None,
    }))
}

/// A path inside a volume, relative to its root: `..`, NUL and over-long paths are refused
/// here; symlinks that lead out are refused where it is opened. "" and "/" are the root.
pub fn check_volume_path(path: &str, field: &str) -> Result<String, ApiError> {
    if path.split('/').any(|c| c == "..") {
        return Err(bad(format!(
            "{field}: {path:?} leaves the volume (it has a .. component)"
        )));
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err(bad(format!(
            "{field}: {path:?} is over 4096 bytes or holds a NUL"
        )));
    }
    let inside: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    Ok(inside.join("/"))
}

/// A route under /volumes/{name} (`rest`: what follows the name) and its query.
pub fn parse_volume_route(
    method: &str,
    name: &str,
    rest: &[&str],
    query: Option<&str>,
) -> Result<Action, ApiError> {
    let name = check_volume_name(name, "name")?;
    let mut path = String::new();
    for (key, value) in query_pairs(query)? {
        match key.as_str() {
            "path" if !rest.is_empty() => path = check_volume_path(&value, "path")?,
            other => return Err(bad(format!("{other}: unknown query parameter here"))),
        }
    }
    let op = match (method, rest) {
        ("GET", []) => VolumeOp::Get,
        ("DELETE", []) => VolumeOp::Delete,
        ("GET", ["files"]) => VolumeOp::Read { path },
        ("PUT", ["files"]) => {
            if path.is_empty() {
                return Err(bad("path: required for a write (?path=dir/file)"));
            }
            VolumeOp::Write { path }
        }
        ("GET", ["tar"]) => VolumeOp::Tar { path },
        _ => {
            return Err(ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: format!("/volumes/{name}/{}", rest.join("/")),
            })
        }
    };
    Ok(Action::Volume { name, op })
}

/// The `volumes` of a create: names, mount points and no repeats.
pub fn check_mounts(mounts: &[VolumeMount]) -> Result<(), ApiError> {
    if mounts.len() > MAX_VOLUME_MOUNTS {
        return Err(bad(format!(
            "volumes: at most {MAX_VOLUME_MOUNTS} per sandbox"
        )));
    }
    for (i, mount) in mounts.iter().enumerate() {
        check_volume_name(&mount.name, &format!("volumes[{i}].name"))?;
        check_mount_path(&mount.mount_path, &format!("volumes[{i}].mount_path"))?;
        let earlier = &mounts[..i];
        if earlier.iter().any(|m| m.name == mount.name) {
            return Err(bad(format!(
                "volumes[{i}].name: volume {:?} is mounted twice",
                mount.name
            )));
        }
        if earlier.iter().any(|m| m.mount_path == mount.mount_path) {
            return Err(bad(format!(
                "volumes[{i}].mount_path: {:?} is another volume's mount point",
                mount.mount_path
            )));
        }
    }
    Ok(())
}

/// A mount point in the guest: absolute, not `/`, no `.` or `..` components, and nothing the
/// kernel command line (`rollbox.volume=TAG:PATH[:ro]`) cannot carry.
fn check_mount_path(path: &str, field: &str) -> Result<(), ApiError> {
    let components_ok = path
        .split('/')
        .skip(1)
        .all(|c| !c.is_empty() && c != "." && c != "..");
    let ok = path.starts_with('/')
        && path.len() > 1
        && path.len() <= 256
        && components_ok
        && !path
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ':' || c == ',' || c == '"');
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "{field}: {path:?} is not a mount point (an absolute path of at most 256 bytes, not /, without . or .. components, whitespace, ':', ',' or '\"')"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(name: &str, path: &str) -> VolumeMount {
        VolumeMount {
            name: name.into(),
            mount_path: path.into(),
            readonly: false,
        }
    }

    #[test]
    fn names_are_tags_and_directory_names() {
        for good in ["data", "trajectories", "a", "v1.2_x-y", &"a".repeat(32)] {
            assert_eq!(check_volume_name(good, "name").expect(good), good);
        }
        for bad_name in [
            "",
            "-x",
            ".x",
            "Data",
            "a/b",
            "a b",
            "..",
            &"a".repeat(33),
            "é",
        ] {
            let e = check_volume_name(bad_name, "name").expect_err(bad_name);
            assert!(e.to_string().starts_with("name: "), "{e}");
        }
    }

    #[test]
    fn paths_stay_inside_the_volume() {
        assert_eq!(check_volume_path("", "path").expect("root"), "");
        assert_eq!(check_volume_path("/", "path").expect("root"), "");
        assert_eq!(check_volume_path("/a//b/./c", "path").expect("p"), "a/b/c");
        assert_eq!(check_volume_path("a/b", "path").expect("p"), "a/b");
        for escape in ["..", "/../etc", "a/../../b", "a/.."] {
            let e = check_volume_path(escape, "path").expect_err(escape);
            assert!(e.to_string().contains("leaves the volume"), "{e}");
        }
        assert!(check_volume_path("a\0b", "path").is_err());
    }

    #[test]
    fn routes_parse_and_bad_ones_are_named() {
        let action = parse_volume_route("GET", "data", &["files"], Some("path=/a/b")).expect("r");
        assert_eq!(
            action,
            Action::Volume {
                name: "data".into(),
                op: VolumeOp::Read { path: "a/b".into() }
            }
        );
        let e = parse_volume_route("PUT", "data", &["files"], None).expect_err("no path");
        assert!(e.to_string().starts_with("path: required"), "{e}");
        let e = parse_volume_route("GET", "Data", &[], None).expect_err("bad name");
        assert!(e.to_string().starts_with("name: "), "{e}");
        let e = parse_volume_route("GET", "data", &[], Some("path=x")).expect_err("query");
        assert!(e.to_string().starts_with("path: unknown"), "{e}");
        let e = parse_create(br#"{"name":"d","host_path":"rel"}"#).expect_err("relative");
        assert!(e.to_string().contains("host_path"), "{e}");
        let e = parse_create(br#"{"name":"d","size":1}"#).expect_err("unknown");
        assert!(e.to_string().contains("size"), "{e}");
        let e = parse_create(br#"{"name":"d","size_limit_mib":4}"#).expect_err("too small");
        assert!(
            e.to_string()
                .starts_with("size_limit_mib: 4 is out of range"),
            "{e}"
        );
        let e = parse_create(br#"{"name":"d","size_limit_mib":64,"host_path":"/srv"}"#)
            .expect_err("with host_path");
        assert!(
            e.to_string()
                .starts_with("size_limit_mib: not with host_path"),
            "{e}"
        );
    }

    #[test]
    fn mounts_are_checked_by_index() {
        check_mounts(&[mount("a", "/data"), mount("b", "/mnt/b")]).expect("good");
        let cases = [
            (vec![mount("A", "/data")], "volumes[0].name"),
            (vec![mount("a", "data")], "volumes[0].mount_path"),
            (vec![mount("a", "/")], "volumes[0].mount_path"),
            (vec![mount("a", "/x/../etc")], "volumes[0].mount_path"),
            (vec![mount("a", "/x y")], "volumes[0].mount_path"),
            (vec![mount("a", "/x:ro")], "volumes[0].mount_path"),
            (vec![mount("a", "/x"), mount("a", "/y")], "volumes[1].name"),
            (
                vec![mount("a", "/x"), mount("b", "/x")],
                "volumes[1].mount_path",
            ),
        ];
        for (mounts, field) in cases {
            let e = check_mounts(&mounts).expect_err(field);
            assert!(e.to_string().starts_with(field), "{field}: {e}");
        }
        let many: Vec<_> = (0..9)
            .map(|i| mount(&format!("v{i}"), &format!("/m{i}")))
            .collect();
        assert!(check_mounts(&many).is_err());
    }
}
