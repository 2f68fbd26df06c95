//! Split builds (`BuildOptions::share_layers`): images with the same first layers share one
//! base disk. Three crafted images with two common layers are built into one cache through
//! the library; the merged view of base and top disk (overlayfs, loop mounts) must equal a
//! whole build's tree.
//!
//! Needs root (the builder, loop and overlay mounts) and e2fsprogs.

// Test code: a panic on a broken fixture is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rollbox::images::{self, progress::Progress, BuildLimits, BuildOptions, SourceSpec};
use rollbox_tests::images::*;

fn layers() -> (Vec<u8>, Vec<u8>) {
    let first = Layer::new()
        .dir("bin", 0o755, 0, 0)
        .file("bin/busybox", &noise(4 << 20), 0o755, 0, 0)
        .symlink("bin/sh", "busybox")
        .hardlink("bin/hard", "bin/busybox")
        .file("bin/su", b"setuid", 0o4755, 0, 0)
        .dir("etc", 0o755, 0, 0)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644, 0, 0)
        .file("etc/group", b"root:x:0:\n", 0o644, 0, 0)
        .file("etc/gone", b"deleted above", 0o644, 0, 0)
        .file("etc/hostname", b"base", 0o644, 0, 0)
        .file("data/old/file", b"hidden by the opaque marker", 0o644, 0, 0)
        .dir("home/user", 0o700, 1000, 1000)
        .file("home/user/notes", b"private", 0o640, 1000, 1000)
        .char_device("dev/console", 5, 1)
        .pax(&[("SCHILY.xattr.user.origin", b"rollbox-test")])
        .file("bin/ping", b"ping", 0o755, 0, 0)
        .tar();
    let second = Layer::new()
        .dir("usr", 0o755, 0, 0)
        .dir("usr/lib", 0o755, 0, 0)
        .file("usr/lib/big", &noise(16 << 20), 0o644, 0, 0)
        .file("usr/lib/small", b"small", 0o644, 0, 0)
        .tar();
    (first, second)
}

fn image_with(top: Vec<u8>) -> Image {
    let (first, second) = layers();
    Image::new(vec![first, second, top])
}

fn options(layout: &Path, cache: &Path, share_layers: bool) -> BuildOptions {
    BuildOptions {
        reference: None,
        source: SourceSpec::OciLayout(layout.to_path_buf()),
        agent: agent(),
        cache_dir: cache.to_path_buf(),
        output: None,
        size_mib: None,
        progress: Progress::new(false),
        limits: BuildLimits::default(),
        share_layers,
    }
}

fn allocated(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks() * 512
}

/// `find` lines (path, type, mode, owner, links, mtime, symlink target) and file checksums of
/// the full image and of the overlay of `top`'s upper over `base`, all mounted read-only in a
/// private mount namespace.
fn listings(work: &Path, full: &Path, base: &Path, top: &Path) -> (String, String) {
    let script = r#"set -e
W="$1"
mkdir -p "$W/full" "$W/base" "$W/top" "$W/merged"
mount -o ro,loop "$2" "$W/full"
mount -o ro,loop "$3" "$W/base"
mount -o ro,loop "$4" "$W/top"
mount -t overlay -o ro,lowerdir="$W/top/.rollbox/upper:$W/base" none "$W/merged"
for n in full merged; do
  cd "$W/$n"
  find . -printf '%p\t%y\t%m\t%U\t%G\t%n\t%T@\t%l\n' | LC_ALL=C sort > "$W/$n.list"
  find . -type f -exec md5sum {} + | LC_ALL=C sort -k2 >> "$W/$n.list"
  python3 -c 'import os
for d, dirs, files in sorted(os.walk(".")):
    for p in sorted([d] + [os.path.join(d, f) for f in files]):
        for x in sorted(os.listxattr(p, follow_symlinks=False)):
            print("xattr", p, x, os.getxattr(p, x, follow_symlinks=False))' >> "$W/$n.list"
done
"#;
    let status = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script, "sh"])
        .args([work, full, base, top])
        .status()
        .unwrap();
    assert!(status.success(), "mounting the images failed");
    let read = |n: &str| fs::read_to_string(work.join(format!("{n}.list"))).unwrap();
    (read("full"), read("merged"))
}

/// Lines under /.rollbox differ by design (the metadata names the base; the agent has a
/// second name on the top disk): only their path, type and mode are compared. Directory link
/// counts are overlayfs's own, and times set while building (after `since`) differ between
/// any two builds.
fn normalized(listing: &str, since: u64) -> Vec<String> {
    listing
        .lines()
        .filter(|l| !l.contains("./.rollbox/image.json"))
        .map(|l| {
            let mut fields: Vec<String> = l.split('\t').map(str::to_string).collect();
            if fields.len() != 8 {
                return l.to_string();
            }
            if l.starts_with("./.rollbox") {
                fields.truncate(3);
            } else {
                if fields[1] == "d" {
                    fields[5] = "-".to_string();
                }
                let mtime: f64 = fields[6].parse().unwrap();
                if mtime >= since as f64 {
                    fields[6] = "(build time)".to_string();
                }
            }
            fields.join("\t")
        })
        .collect()
}

#[test]
fn images_with_common_layers_share_one_base_and_merge_to_the_full_tree() {
    if !root_or_skip("images_with_common_layers_share_one_base_and_merge_to_the_full_tree") {
        return;
    }
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let layout = |name: &str, image: &Image| -> PathBuf {
        let path = dir.path().join(name);
        image.write_oci_layout(&path, "latest");
        path
    };
    let a = layout(
        "a",
        &image_with(Layer::new().file("srv/a", b"a", 0o644, 0, 0).tar()),
    );
    let b_image = image_with(
        Layer::new()
            .file("etc/.wh.gone", b"", 0o644, 0, 0)
            .dir("data", 0o755, 0, 0)
            .file("data/.wh..wh..opq", b"", 0o644, 0, 0)
            .file("data/new", b"new", 0o644, 0, 0)
            .file("etc/hostname", b"b", 0o600, 0, 0)
            .hardlink("bin/hard2", "bin/busybox")
            .dir("usr", 0o700, 0, 0)
            .symlink("usr/lib/alias", "big")
            .file("srv/b", b"b", 0o644, 0, 0)
            .tar(),
    );
    let b = layout("b", &b_image);
    let c = layout(
        "c",
        &image_with(Layer::new().file("srv/c", b"c", 0o644, 0, 0).tar()),
    );

    // The first of its kind: a whole image.
    let built_a = images::build(&options(&a, &cache, true)).unwrap();
    assert_eq!((built_a.base.as_ref(), built_a.base_layers), (None, 0));

    // The second: a base of the two common layers, and a top disk.
    let built_b = images::build(&options(&b, &cache, true)).unwrap();
    let base = built_b.base.clone().expect("the second image has a base");
    assert_eq!(built_b.base_layers, 2);
    assert!(base.starts_with(cache.join("bases")), "{}", base.display());
    let meta: serde_json::Value =
        serde_json::from_slice(&fs::read(&built_b.metadata).unwrap()).unwrap();
    assert_eq!(meta["base"]["layers"], 2, "{meta}");
    assert_eq!(meta["kernel_cmdline"], "init=/.rollbox/rollbox-agent");
    let base_stamp = fs::metadata(&base).unwrap();

    // The third reuses the same base file.
    let built_c = images::build(&options(&c, &cache, true)).unwrap();
    assert_eq!(built_c.base.as_ref(), Some(&base));
    let again = fs::metadata(&base).unwrap();
    assert_eq!(
        (again.ino(), again.mtime(), again.mtime_nsec()),
        (
            base_stamp.ino(),
            base_stamp.mtime(),
            base_stamp.mtime_nsec()
        ),
        "the base was made again"
    );
    // Built again: a cache hit, same base.
    let hit = images::build(&options(&c, &cache, true)).unwrap();
    assert!(hit.cached);
    assert_eq!(
        (hit.rootfs, hit.base),
        (built_c.rootfs.clone(), Some(base.clone()))
    );

    // The top disk's layout.
    let top = &built_b.rootfs;
    for path in [
        "/.rollbox/upper",
        "/.rollbox/work",
        "/.rollbox/lower",
        "/.rollbox/root",
        "/dev",
        "/proc",
    ] {
        assert_eq!(stat(top, path).unwrap().kind, "directory", "{path}");
    }
    assert_eq!(
        cat(top, "/.rollbox/rollbox-agent"),
        fs::read(agent()).unwrap()
    );
    assert!(
        stat(top, "/.rollbox/upper/usr/lib/big").is_none(),
        "base content in the top"
    );
    assert_eq!(
        stat(top, "/.rollbox/upper/etc/gone").unwrap().kind,
        "character"
    );
    // The opaque /data: an opaque directory, or a kept one with a whiteout.
    let opaque = debugfs(top, "ea_list /.rollbox/upper/data");
    let old = stat(top, "/.rollbox/upper/data/old").map(|i| i.kind);
    assert!(
        opaque.contains("trusted.overlay.opaque") || old.as_deref() == Some("character"),
        "{opaque} {old:?}"
    );

    // The merged view equals a whole build of the same image.
    let full = images::build(&options(&b, &cache, false)).unwrap();
    assert_eq!((full.base, full.base_layers), (None, 0));
    let work = dir.path().join("mnt");
    fs::create_dir(&work).unwrap();
    let (full_list, merged_list) = listings(&work, &full.rootfs, &base, top);
    let (full_lines, merged_lines) = (
        normalized(&full_list, since),
        normalized(&merged_list, since),
    );
    let missing: Vec<_> = full_lines
        .iter()
        .filter(|l| !merged_lines.contains(l))
        .collect();
    let extra: Vec<_> = merged_lines
        .iter()
        .filter(|l| !full_lines.contains(l))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the merged view differs from the whole image:\nonly whole: {missing:#?}\nonly merged: {extra:#?}"
    );
    assert!(!full_list.contains("./etc/gone\t") && !full_list.contains("./data/old"));
    assert!(
        full_list.contains("./bin/hard2\tf\t755\t0\t0\t3\t"),
        "{full_list}"
    );
    assert!(full_list.contains("user.origin"), "{full_list}");

    let tops = [&built_b.rootfs, &built_c.rootfs];
    let shared: u64 = allocated(&base) + tops.iter().map(|t| allocated(t)).sum::<u64>();
    let whole = allocated(&built_a.rootfs) * 2;
    eprintln!(
        "disk use: base {} + tops {} + {} = {shared} bytes for two split images; \
         whole images: {} (a) and {} (b) bytes, so two whole images ~ {whole}",
        allocated(&base),
        allocated(tops[0]),
        allocated(tops[1]),
        allocated(&built_a.rootfs),
        allocated(&full.rootfs),
    );
    assert!(allocated(tops[1]) < allocated(&built_a.rootfs) / 2);
}
