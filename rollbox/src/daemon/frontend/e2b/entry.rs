//! envd's `EntryInfo` JSON for the agent's file info (Stat, ListDir, MakeDir, Move, and the
//! entries of watch events).

use rollbox_agent_protocol::messages::{FileInfo, FileKind};
use serde_json::{json, Value};

use super::wire::rfc3339;

/// envd's `EntryInfo`.
pub fn entry(info: &FileInfo) -> Value {
    let (kind, letter) = match info.kind {
        FileKind::File => ("FILE_TYPE_FILE", '-'),
        FileKind::Dir => ("FILE_TYPE_DIRECTORY", 'd'),
        FileKind::Symlink => ("FILE_TYPE_SYMLINK", 'l'),
        FileKind::Other => ("FILE_TYPE_UNSPECIFIED", '?'),
    };
    let mut permissions = String::from(letter);
    for shift in [6, 3, 0] {
        let bits = (info.mode >> shift) & 7;
        permissions.push(if bits & 4 != 0 { 'r' } else { '-' });
        permissions.push(if bits & 2 != 0 { 'w' } else { '-' });
        permissions.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let name_of = |id: u32| {
        if id == 0 {
            "root".to_string()
        } else {
            id.to_string()
        }
    };
    let mtime_ms = u64::try_from(info.mtime_ns / 1_000_000).unwrap_or(0);
    let mut value = json!({
        "name": info.name,
        "type": kind,
        "path": info.path,
        "size": info.size,
        "mode": info.mode,
        "permissions": permissions,
        "owner": name_of(info.uid),
        "group": name_of(info.gid),
        "modifiedTime": rfc3339(mtime_ms),
    });
    if let Some(target) = &info.link_target {
        value["symlinkTarget"] = json!(target);
    }
    // The file's user metadata (`user.e2b.*` attributes): envd 0.6.2.
    if !info.metadata.is_empty() {
        value["metadata"] = json!(info.metadata);
    }
    value
}
