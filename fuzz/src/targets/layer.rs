//! OCI layers: an uncompressed tar stream applied by the image builder onto a scratch root.
//! Besides panics, anything written outside the root is a finding.

use rollbox::images::layer::RootfsBuilder;

use super::signature::shape;

pub fn run(data: &[u8]) -> u64 {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("fuzz rig: temporary directory: {e}"));
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", root.display()));
    let mut builder = RootfsBuilder::new(&root);
    let outcome = match builder.apply_layer("fuzz", data) {
        Ok(stats) => {
            let finish = builder.finish().err();
            format!("ok {} {finish:?}", stats.entries.min(1))
        }
        Err(e) => format!("{e:?}"),
    };
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        names.len() == 1 && names[0] == "root",
        "the layer wrote outside its root: {names:?}"
    );
    shape(&outcome)
}

fn tar_of(entries: &[(&str, tar::EntryType, &[u8], &str)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, kind, data, link) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(*kind);
        header.set_mode(if *kind == tar::EntryType::Directory {
            0o755
        } else {
            0o644
        });
        header.set_size(data.len() as u64);
        header.set_mtime(1_700_000_000);
        if !link.is_empty() {
            header
                .set_link_name(link)
                .unwrap_or_else(|e| panic!("seed: {e}"));
        }
        builder
            .append_data(&mut header, path, *data)
            .unwrap_or_else(|e| panic!("seed: {e}"));
    }
    builder.into_inner().unwrap_or_else(|e| panic!("seed: {e}"))
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use tar::EntryType::{Directory, Link, Regular, Symlink};
    vec![
        (
            "tree".into(),
            tar_of(&[
                ("etc/", Directory, b"", ""),
                ("etc/hostname", Regular, b"box\n", ""),
                ("bin/", Directory, b"", ""),
                ("bin/sh", Regular, b"\x7fELF", ""),
                ("bin/ash", Link, b"", "bin/sh"),
                ("usr/bin/", Directory, b"", ""),
                ("usr/bin/env", Symlink, b"", "../../bin/sh"),
            ]),
        ),
        (
            "whiteouts".into(),
            tar_of(&[
                ("etc/", Directory, b"", ""),
                ("etc/.wh.hostname", Regular, b"", ""),
                ("var/", Directory, b"", ""),
                ("var/.wh..wh..opq", Regular, b"", ""),
                ("var/new", Regular, b"x", ""),
            ]),
        ),
        (
            "escape-attempts".into(),
            tar_of(&[
                ("link", Symlink, b"", "/tmp"),
                ("link/x", Regular, b"y", ""),
                ("hard", Link, b"", "../outside"),
            ]),
        ),
    ]
}
