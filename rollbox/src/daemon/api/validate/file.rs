//! Files: the file and tar routes of a sandbox, and paths in the guest.

use super::super::action::ApiError;
use super::super::model::FileOp;
use super::{bad, parse_bool, query_pairs};

/// A path in the sandbox: absolute, no `..` (nothing may escape the sandbox's root), no NUL.
pub fn check_guest_path(path: &str, field: &str) -> Result<String, ApiError> {
    if !path.starts_with('/') {
        return Err(bad(format!(
            "{field}: {path:?} is relative; give an absolute path in the sandbox"
        )));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(bad(format!(
            "{field}: {path:?} escapes the sandbox root (it has a .. component)"
        )));
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err(bad(format!(
            "{field}: {path:?} is over 4096 bytes or holds a NUL"
        )));
    }
    Ok(path.to_string())
}

/// A file or tar route (`rest`: the path after `/sandboxes/{id}`) and its query.
pub fn parse_file_op(method: &str, rest: &[&str], query: Option<&str>) -> Result<FileOp, ApiError> {
    let mut path = None;
    let (mut mode, mut parents, mut recursive) = (None, false, false);
    let writes = method == "PUT" && rest == ["files"];
    let removes = method == "DELETE";
    for (name, value) in query_pairs(query)? {
        match name.as_str() {
            "path" => path = Some(check_guest_path(&value, "path")?),
            "mode" if writes => {
                mode = Some(
                    u32::from_str_radix(&value, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| bad(format!("mode: {value:?} is not octal 0-7777")))?,
                )
            }
            "parents" if writes => parents = parse_bool(&value, "parents")?,
            "recursive" if removes => recursive = parse_bool(&value, "recursive")?,
            other => return Err(bad(format!("{other}: unknown query parameter here"))),
        }
    }
    let path = path.ok_or_else(|| bad("path: required (?path=/absolute/path)"))?;
    Ok(match (method, rest) {
        ("GET", ["files"]) => FileOp::Read { path },
        ("PUT", ["files"]) => FileOp::Write {
            path,
            mode,
            parents,
            atomic: true,
            metadata: None,
            owner: None,
        },
        ("DELETE", _) => FileOp::Remove { path, recursive },
        ("GET", ["files", "stat"]) => FileOp::Stat { path },
        ("GET", ["files", "list"]) => FileOp::List { path },
        ("GET", ["tar"]) => FileOp::TarDownload { path },
        _ => FileOp::TarUpload { path },
    })
}
