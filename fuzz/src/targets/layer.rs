//! OCI layers: an uncompressed tar stream applied by the image builder onto a scratch root.
//! Besides panics, anything written outside the root is a finding.

use rollbox::images::layer::RootfsBuilder;

use super::scratch::Scratch;
use super::signature::shape;

pub fn run(data: &[u8]) -> u64 {
    let scratch = Scratch::new();
    let mut builder = RootfsBuilder::new(&scratch.root);
    let outcome = match builder.apply_layer("fuzz", data) {
        Ok(stats) => {
            let finish = builder.finish().err();
            format!("ok {} {finish:?}", stats.entries.min(1))
        }
        Err(e) => format!("{e:?}"),
    };
    scratch.assert_nothing_outside("the layer");
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
