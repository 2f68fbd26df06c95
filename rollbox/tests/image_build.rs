//! `rollbox image build`, driven as a user would: crafted images as OCI layouts, `docker save`
//! archives and registry pushes; real dockerd images where dockerd runs. The ext4 results are
//! read back with debugfs.
//!
//! Needs root (ownership, device nodes, tmpfs mounts) and e2fsprogs. Registry tests need
//! `scripts/start-registry.sh`; dockerd tests need a running dockerd. Those skip with one
//! line unless ROLLBOX_REQUIRE_ALL=1.

// Test code: a panic on a broken fixture is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use rollbox_tests::images::*;
use rollbox_tests::skip;

fn arg(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// What every build of `standard_image()` must contain.
fn check_standard_rootfs(image: &Path) {
    // Whiteout and opaque directory.
    assert!(
        stat(image, "/etc/gone").is_none(),
        "whiteout-deleted /etc/gone is present"
    );
    assert!(
        stat(image, "/data/old").is_none(),
        "opaque /data kept lower content"
    );
    assert_eq!(cat(image, "/data/new"), b"new");
    // The image has E2B's `user` already: its passwd is left as it was.
    assert_eq!(
        cat(image, "/etc/passwd"),
        b"root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
    );
    // Modes, owners, links, devices.
    let su = stat(image, "/bin/su").unwrap();
    assert_eq!((su.kind.as_str(), su.mode), ("regular", 0o4755));
    let home = stat(image, "/home/user").unwrap();
    assert_eq!(
        (home.kind.as_str(), home.mode, home.uid, home.gid),
        ("directory", 0o700, 1000, 1000)
    );
    let notes = stat(image, "/home/user/notes").unwrap();
    assert_eq!((notes.mode, notes.uid, notes.gid), (0o640, 1000, 1000));
    let busybox = stat(image, "/bin/busybox").unwrap();
    let hard = stat(image, "/bin/hard").unwrap();
    assert_eq!(busybox.inode, hard.inode, "hardlink lost");
    assert_eq!(busybox.links, 2);
    assert_eq!(stat(image, "/bin/sh").unwrap().kind, "symlink");
    assert!(debugfs(image, "stat /bin/sh").contains("Fast link dest: \"busybox\""));
    let console = stat(image, "/dev/console").unwrap();
    assert_eq!((console.kind.as_str(), console.gid), ("character", 5));
    assert!(debugfs(image, "stat /dev/console").contains("Device major/minor number: 05:01"));
    // Extended attributes from PAX records, file capabilities included.
    let xattrs = debugfs(image, "ea_list /bin/ping");
    assert!(
        xattrs.contains("user.origin") && xattrs.contains("rollbox-test"),
        "{xattrs}"
    );
    assert!(xattrs.contains("security.capability"), "{xattrs}");
    check_agent_and_metadata(image);
}

fn check_agent_and_metadata(image: &Path) {
    let agent = stat(image, "/.rollbox/rollbox-agent").expect("agent missing");
    assert_eq!(
        (agent.kind.as_str(), agent.mode, agent.uid),
        ("regular", 0o755, 0)
    );
    assert_eq!(
        cat(image, "/.rollbox/rollbox-agent"),
        fs::read(rollbox_tests::images::agent()).unwrap()
    );
    let inside: serde_json::Value =
        serde_json::from_slice(&cat(image, "/.rollbox/image.json")).unwrap();
    assert_eq!(inside["init"], "/.rollbox/rollbox-agent");
    assert_eq!(inside["kernel_cmdline"], "init=/.rollbox/rollbox-agent");
    assert_eq!(inside["entrypoint"], serde_json::json!(["/bin/sh", "-c"]));
    assert_eq!(inside["cmd"], serde_json::json!(["echo $GREETING"]));
    assert_eq!(inside["working_dir"], "/home/user");
    assert_eq!(inside["user"], "1000:1000");
    assert!(inside["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e == "GREETING=hello world"));
    for mount_point in ["/proc", "/sys", "/dev", "/tmp", "/run"] {
        assert_eq!(
            stat(image, mount_point).unwrap().kind,
            "directory",
            "{mount_point}"
        );
    }
}

fn check_outside_metadata(metadata: &Path, rootfs: &Path) {
    let outside: serde_json::Value = serde_json::from_slice(&fs::read(metadata).unwrap()).unwrap();
    assert_eq!(
        outside["rootfs_size_bytes"],
        fs::metadata(rootfs).unwrap().len()
    );
    assert_eq!(outside["init"], "/.rollbox/rollbox-agent");
}

fn fsck(image: &Path) {
    let output = Command::new("e2fsck")
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .args(["-fn"])
        .arg(image)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "e2fsck: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn oci_layout_builds_cached_and_copied_out() {
    if !root_or_skip("oci_layout_builds_cached_and_copied_out") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let image = standard_image();
    image.write_oci_layout(&layout, "v1");
    let agent = agent();
    let args = [
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ];

    let started = Instant::now();
    let first = build_ok(&args);
    let cold = started.elapsed();
    assert!(first.rootfs.starts_with(cache.join("rootfs")));
    assert_eq!(first.metadata, first.rootfs.with_file_name("image.json"));
    assert!(first.stderr.contains("built"), "{}", first.stderr);
    check_standard_rootfs(&first.rootfs);
    check_outside_metadata(&first.metadata, &first.rootfs);
    fsck(&first.rootfs);

    let started = Instant::now();
    let second = build_ok(&args);
    let cached = started.elapsed();
    assert!(second.stderr.contains("cached"), "{}", second.stderr);
    assert_eq!(second.rootfs, first.rootfs);
    eprintln!(
        "figures: OCI layout image, {} MiB ext4; cold build {:.0} ms, cached {:.0} ms",
        first.size_bytes / (1024 * 1024),
        cold.as_secs_f64() * 1000.0,
        cached.as_secs_f64() * 1000.0
    );

    // --output copies the cached image; the tag picks the image; --size is honoured.
    let out = dir.path().join("out/sandbox.ext4");
    fs::create_dir(dir.path().join("out")).unwrap();
    let mut with_output = args.to_vec();
    with_output.extend(["--output", arg(&out), "--size", "96"]);
    with_output.insert(2, "example.com/anything:v1");
    let copied = build_ok(&with_output);
    assert_eq!(copied.rootfs, out);
    assert_eq!(copied.size_bytes, 96 * 1024 * 1024);
    assert_eq!(copied.metadata, dir.path().join("out/sandbox.image.json"));
    check_standard_rootfs(&out);
    check_outside_metadata(&copied.metadata, &out);
    fsck(&out);

    // A size too small for the content is refused before anything is cached.
    let mut too_small = args.to_vec();
    too_small.extend(["--size", "2"]);
    let err = build_err(&too_small);
    assert!(
        err.contains("more than the requested --size 2 MiB"),
        "{err}"
    );
    assert_eq!(fs::read_dir(cache.join("tmp")).unwrap().count(), 0);
}

#[test]
fn zstd_and_uncompressed_layers_build() {
    if !root_or_skip("zstd_and_uncompressed_layers_build") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let mut image = standard_image();
    image.blobs[0] = image.layers[0].clone();
    image.blobs[1] = ruzstd::encoding::compress_to_vec(
        &image.layers[1][..],
        ruzstd::encoding::CompressionLevel::Fastest,
    );
    image.write_oci_layout(&layout, "zstd");
    let agent = agent();
    let built = build_ok(&[
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    check_standard_rootfs(&built.rootfs);
}

/// An image without E2B's `user`, whose uid 1000 is taken: the build adds `user` as 1001 with
/// its home and the image's skeleton files, and bash since the image has it (through /bin ->
/// usr/bin).
#[test]
fn an_image_without_user_gets_e2bs_account() {
    if !root_or_skip("an_image_without_user_gets_e2bs_account") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let layer = Layer::new()
        .dir("usr/bin", 0o755, 0, 0)
        .file("usr/bin/bash", b"not really bash", 0o755, 0, 0)
        .symlink("bin", "usr/bin")
        .dir("etc", 0o755, 0, 0)
        .file(
            "etc/passwd",
            b"root:x:0:0::/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/bash\n",
            0o644,
            0,
            0,
        )
        .file("etc/group", b"root:x:0:\nnode:x:1000:\n", 0o644, 0, 0)
        .file("etc/shadow", b"root:*:19000:0:99999:7:::\n", 0o640, 0, 42)
        .file("etc/skel/.bashrc", b"# skel\n", 0o644, 0, 0)
        .tar();
    Image::new(vec![layer]).write_oci_layout(&layout, "nouser");
    let agent = agent();
    let built = build_ok(&[
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    let image = &built.rootfs;
    let passwd = String::from_utf8(cat(image, "/etc/passwd")).unwrap();
    assert!(
        passwd.ends_with("\nuser:x:1001:1001::/home/user:/bin/bash\n"),
        "{passwd}"
    );
    let group = String::from_utf8(cat(image, "/etc/group")).unwrap();
    assert!(group.ends_with("\nuser:x:1001:\n"), "{group}");
    let shadow = String::from_utf8(cat(image, "/etc/shadow")).unwrap();
    assert!(shadow.ends_with("\nuser:!::0:99999:7:::\n"), "{shadow}");
    let shadow_inode = stat(image, "/etc/shadow").unwrap();
    assert_eq!((shadow_inode.mode, shadow_inode.gid), (0o640, 42));
    let home = stat(image, "/home/user").unwrap();
    assert_eq!(
        (home.kind.as_str(), home.mode, home.uid, home.gid),
        ("directory", 0o750, 1001, 1001)
    );
    let bashrc = stat(image, "/home/user/.bashrc").unwrap();
    assert_eq!((bashrc.uid, bashrc.gid), (1001, 1001));
    assert_eq!(cat(image, "/home/user/.bashrc"), b"# skel\n");
    fsck(image);
}

#[test]
fn docker_archive_builds() {
    if !root_or_skip("docker_archive_builds") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("image.tar");
    let cache = dir.path().join("cache");
    let image = standard_image();
    image.write_docker_archive(&archive, "rollbox-test/crafted:latest");
    let agent = agent();
    let built = build_ok(&[
        "image",
        "build",
        "rollbox-test/crafted",
        "--from-docker-archive",
        arg(&archive),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    check_standard_rootfs(&built.rootfs);
    let metadata: serde_json::Value =
        serde_json::from_slice(&fs::read(&built.metadata).unwrap()).unwrap();
    assert_eq!(metadata["source"], "docker-archive");
    assert_eq!(metadata["image_digest"], image.config_digest());

    let err = build_err(&[
        "image",
        "build",
        "rollbox-test/other",
        "--from-docker-archive",
        arg(&archive),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    assert!(
        err.contains("no image matches \"rollbox-test/other\"")
            && err.contains("rollbox-test/crafted:latest"),
        "{err}"
    );
}

#[test]
fn registry_pull_builds() {
    if !root_or_skip("registry_pull_builds") {
        return;
    }
    if !registry_answers() {
        return skip(
            "registry_pull_builds",
            "no registry at 127.0.0.1:5000 (run scripts/start-registry.sh)",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let image = standard_image();
    let reference = format!(
        "{REGISTRY}/rollbox-test/crafted-{}:latest",
        std::process::id()
    );
    image.push(&reference);
    let agent = agent();
    let args = [
        "image",
        "build",
        reference.as_str(),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ];
    let started = Instant::now();
    let built = build_ok(&args);
    let cold = started.elapsed();
    check_standard_rootfs(&built.rootfs);
    // Layers are cached by blob digest.
    for blob in &image.blobs {
        let hex = sha256(blob).trim_start_matches("sha256:").to_string();
        assert!(cache.join("blobs/sha256").join(hex).is_file());
    }
    let started = Instant::now();
    let again = build_ok(&args);
    eprintln!(
        "figures: registry image, cold {:.0} ms, cached {:.0} ms",
        cold.as_secs_f64() * 1000.0,
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert!(again.stderr.contains("cached"));
    assert_eq!(again.rootfs, built.rootfs);
}

/// A multi-platform index: the linux/amd64 image is picked.
#[test]
fn registry_index_picks_this_platform() {
    if !root_or_skip("registry_index_picks_this_platform") {
        return;
    }
    if !registry_answers() {
        return skip(
            "registry_index_picks_this_platform",
            "no registry at 127.0.0.1:5000 (run scripts/start-registry.sh)",
        );
    }
    if std::env::consts::ARCH != "x86_64" {
        return skip(
            "registry_index_picks_this_platform",
            "the index test expects an amd64 host",
        );
    }
    let repository = format!("rollbox-test/multi-{}", std::process::id());
    let amd64 = standard_image();
    let arm64 = Image::new(vec![Layer::new()
        .file("etc/arch", b"arm64", 0o644, 0, 0)
        .tar()]);
    amd64.push(&format!("{REGISTRY}/{repository}:amd64"));
    arm64.push(&format!("{REGISTRY}/{repository}:arm64"));
    let amd64_manifest = registry_manifest(&repository, "amd64");
    let arm64_manifest = registry_manifest(&repository, "arm64");
    registry_put_index(
        &repository,
        "latest",
        &[("arm64", &arm64_manifest), ("amd64", &amd64_manifest)],
    );

    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let agent = agent();
    let reference = format!("{REGISTRY}/{repository}:latest");
    let built = build_ok(&[
        "image",
        "build",
        &reference,
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    check_standard_rootfs(&built.rootfs);
    assert!(stat(&built.rootfs, "/etc/arch").is_none());
    let metadata: serde_json::Value =
        serde_json::from_slice(&fs::read(&built.metadata).unwrap()).unwrap();
    assert_eq!(metadata["manifest_digest"], sha256(&amd64_manifest));
}

#[test]
fn missing_images_are_clear_errors() {
    if !root_or_skip("missing_images_are_clear_errors") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let agent = agent();
    let common = ["--agent", arg(&agent), "--cache-dir", arg(&cache)];
    let run = |extra: &[&str]| {
        let mut args = vec!["image", "build"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&common);
        build_err(&args)
    };
    let err = run(&["--from-docker-archive", "/nonexistent/image.tar"]);
    assert!(
        err.contains("docker archive /nonexistent/image.tar: file not found"),
        "{err}"
    );
    let err = run(&["--from-oci-layout", "/nonexistent/layout"]);
    assert!(
        err.contains("OCI layout /nonexistent/layout: directory not found"),
        "{err}"
    );
    let err = build_err(&[
        "image",
        "build",
        "--from-oci-layout",
        "/tmp",
        "--agent",
        "/nonexistent/agent",
        "--cache-dir",
        arg(&cache),
    ]);
    assert!(
        err.contains("agent binary /nonexistent/agent not found"),
        "{err}"
    );
    assert_cache_clean(&cache);

    if !registry_answers() {
        return skip(
            "missing_images_are_clear_errors",
            "the registry part: no registry at 127.0.0.1:5000",
        );
    }
    let err = run(&[&format!("{REGISTRY}/rollbox-test/does-not-exist:latest")]);
    assert!(
        err.contains("not found in registry 127.0.0.1:5000"),
        "{err}"
    );
    let image = standard_image();
    let reference = format!("{REGISTRY}/rollbox-test/tags-{}:v1", std::process::id());
    image.push(&reference);
    let err = run(&[&reference.replace(":v1", ":no-such-tag")]);
    assert!(err.contains("not found in registry"), "{err}");
    assert_cache_clean(&cache);
}

/// Builds a one-layer OCI layout from `layer` (stored as `blob`) and expects failure.
fn expect_bad_layout(blob_override: Option<Vec<u8>>, layer: Vec<u8>, expected: &str) {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let mut image = Image::new(vec![layer]);
    if let Some(blob) = blob_override {
        image.blobs[0] = blob;
    }
    image.write_oci_layout(&layout, "bad");
    let out = dir.path().join("out.ext4");
    let agent = agent();
    let err = build_err(&[
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
        "--output",
        arg(&out),
    ]);
    assert!(err.contains(expected), "expected {expected:?} in: {err}");
    assert_cache_clean(&cache);
    assert!(!out.exists(), "half-written output");
}

#[test]
fn path_traversal_is_refused() {
    if !root_or_skip("path_traversal_is_refused") {
        return;
    }
    expect_bad_layout(
        None,
        Layer::new().raw_file("../escape", b"x").tar(),
        "`..` component (path traversal)",
    );
    expect_bad_layout(
        None,
        Layer::new().raw_file("/etc/escape", b"x").tar(),
        "has an absolute path",
    );
    expect_bad_layout(
        None,
        Layer::new()
            .symlink("evil", "/etc")
            .file("evil/passwd", b"owned", 0o644, 0, 0)
            .tar(),
        "would be written through the symlink /evil",
    );
    expect_bad_layout(
        None,
        Layer::new().hardlink("h", "../../etc/passwd").tar(),
        "points outside the root",
    );
}

#[test]
fn corrupt_layers_are_refused() {
    if !root_or_skip("corrupt_layers_are_refused") {
        return;
    }
    let good = Layer::new()
        .file("etc/hostname", b"sandbox", 0o644, 0, 0)
        .tar();
    // Not gzip at all past the magic: the digest matches (it is of these bytes), the data is bad.
    let mut bad_gzip = vec![0x1f, 0x8b, 0x08, 0x00];
    bad_gzip.extend_from_slice(&noise(4096));
    expect_bad_layout(
        Some(bad_gzip),
        good.clone(),
        "corrupt or unreadable layer data",
    );

    // A blob altered after its digest was recorded.
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let other = Layer::new().file("etc/motd", b"hello", 0o644, 0, 0).tar();
    let image = Image::new(vec![good, other]);
    image.write_oci_layout(&layout, "tampered");
    let blob = image.oci_blob_path(&layout, 1);
    let mut bytes = fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&blob, bytes).unwrap();
    let agent = agent();
    let err = build_err(&[
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    assert!(
        err.contains("layer 2/2") && err.contains("blob digest mismatch"),
        "{err}"
    );
    assert_cache_clean(&cache);
}

/// Unmounts the test tmpfs however the test ends.
struct TmpfsMount<'a>(&'a Path);

impl Drop for TmpfsMount<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

#[test]
fn full_disk_leaves_nothing_behind() {
    if !is_root() {
        return skip(
            "full_disk_leaves_nothing_behind",
            "needs root to mount a tmpfs",
        );
    }
    // (tmpfs size, file size): the layer itself overflows; then the tree fits but the ext4 does not.
    for (tmpfs_size, file_mib) in [("2m", 3usize), ("7m", 3)] {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("big.tar");
        let image = Image::new(vec![Layer::new()
            .file("big", &noise(file_mib << 20), 0o644, 0, 0)
            .tar()]);
        image.write_docker_archive(&archive, "rollbox-test/big:latest");
        let small = dir.path().join("small");
        fs::create_dir(&small).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={tmpfs_size}"), "tmpfs"])
            .arg(&small)
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            return skip("full_disk_leaves_nothing_behind", "mount -t tmpfs failed");
        }
        let _unmount = TmpfsMount(&small);
        let agent = agent();
        let err = build_err(&[
            "image",
            "build",
            "--from-docker-archive",
            arg(&archive),
            "--agent",
            arg(&agent),
            "--cache-dir",
            arg(&small),
        ]);
        assert!(
            err.contains("No space left on device") || err.contains("no space left"),
            "{tmpfs_size}: {err}"
        );
        assert!(
            err.contains("hint: the disk holding the cache"),
            "{tmpfs_size}: {err}"
        );
        assert_cache_clean(&small);
    }
}

/// A real image from dockerd: `docker build` of busybox-static, `docker save`, and a push to
/// the loopback registry.
#[test]
fn dockerd_image_via_save_and_registry() {
    if !root_or_skip("dockerd_image_via_save_and_registry") {
        return;
    }
    if !docker_works() {
        return skip(
            "dockerd_image_via_save_and_registry",
            "dockerd is not running (scripts/start-dockerd.sh)",
        );
    }
    let busybox = Path::new("/bin/busybox");
    let static_busybox = Command::new("file")
        .arg(busybox)
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("statically linked"));
    if !static_busybox {
        return skip(
            "dockerd_image_via_save_and_registry",
            "needs busybox-static at /bin/busybox",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let context = dir.path().join("context");
    fs::create_dir(&context).unwrap();
    fs::copy(busybox, context.join("busybox")).unwrap();
    fs::write(
        context.join("Dockerfile"),
        r#"FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox --install -s /bin && mkdir -p /etc /data/old /home/user && echo bye > /etc/gone && echo old > /data/old/f && chown 1000:1000 /home/user && chmod 700 /home/user"]
RUN rm /etc/gone && rm -rf /data && mkdir /data && echo new > /data/new
ENV GREETING="hello world"
WORKDIR /home/user
USER 1000:1000
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["echo $GREETING"]
"#,
    )
    .unwrap();
    let tag = format!("{REGISTRY}/rollbox-test/tiny-{}:latest", std::process::id());
    let docker = |args: &[&str]| {
        let output = Command::new("docker").args(args).output().unwrap();
        assert!(
            output.status.success(),
            "docker {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    // No network for RUN: the bridge is not needed (and may be absent).
    docker(&[
        "build",
        "-q",
        "--network",
        "none",
        "-t",
        &tag,
        arg(&context),
    ]);
    let archive = dir.path().join("tiny.tar");
    docker(&["save", "-o", arg(&archive), &tag]);

    let cache = dir.path().join("cache");
    let agent = agent();
    let check = |image: &Path| {
        assert!(stat(image, "/etc/gone").is_none(), "whiteout ignored");
        assert!(
            stat(image, "/data/old").is_none(),
            "opaque directory ignored"
        );
        assert_eq!(cat(image, "/data/new"), b"new\n");
        let home = stat(image, "/home/user").unwrap();
        assert_eq!((home.mode, home.uid, home.gid), (0o700, 1000, 1000));
        assert_eq!(stat(image, "/bin/sh").unwrap().kind, "symlink");
        check_agent_and_metadata(image);
        fsck(image);
    };
    let started = Instant::now();
    let saved = build_ok(&[
        "image",
        "build",
        &tag,
        "--from-docker-archive",
        arg(&archive),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    let cold = started.elapsed();
    check(&saved.rootfs);
    let started = Instant::now();
    build_ok(&[
        "image",
        "build",
        &tag,
        "--from-docker-archive",
        arg(&archive),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    eprintln!(
        "figures: busybox image (docker save): ext4 {} MiB apparent, {} KiB allocated; cold {:.0} ms, cached {:.0} ms",
        saved.size_bytes >> 20,
        fs::metadata(&saved.rootfs).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) / 2).unwrap_or(0),
        cold.as_secs_f64() * 1000.0,
        started.elapsed().as_secs_f64() * 1000.0
    );

    if !registry_answers() {
        let _ = Command::new("docker").args(["rmi", &tag]).output();
        return skip(
            "dockerd_image_via_save_and_registry",
            "the registry part: no registry at 127.0.0.1:5000",
        );
    }
    docker(&["push", &tag]);
    let pulled = build_ok(&[
        "image",
        "build",
        &tag,
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ]);
    check(&pulled.rootfs);
    let _ = Command::new("docker").args(["rmi", &tag]).output();
}

/// A decompression bomb (a small gzip of 64 MiB of zeros, which tar reads as its end and the
/// diff-id check would drain) stops at the cap, and the error names the layer and the flag.
#[test]
fn a_decompression_bomb_stops_at_the_cap() {
    if !root_or_skip("a_decompression_bomb_stops_at_the_cap") {
        return;
    }
    let good = Layer::new().file("etc/hostname", b"box", 0o644, 0, 0).tar();
    let bomb = vec![0u8; 64 << 20];
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let bomb_len = bomb.len();
    let image = Image::new(vec![good, bomb]);
    assert!(
        image.blobs[1].len() < bomb_len / 100,
        "the bomb is small: {}",
        image.blobs[1].len()
    );
    image.write_oci_layout(&layout, "bomb");
    let agent = agent();
    let base = [
        "image",
        "build",
        "--from-oci-layout",
        arg(&layout),
        "--agent",
        arg(&agent),
        "--cache-dir",
        arg(&cache),
    ];
    let mut args = base.to_vec();
    args.extend(["--max-layer-bytes", "1048576"]);
    let err = build_err(&args);
    assert!(
        err.contains("layer 2/2 of")
            && err.contains(
                "its uncompressed data passes the cap of 1048576 bytes (--max-layer-bytes)"
            ),
        "{err}"
    );
    assert_cache_clean(&cache);
    // The image's cap counts every layer; the entry caps the same.
    let mut args = base.to_vec();
    args.extend(["--max-image-bytes", "4096"]);
    let err = build_err(&args);
    assert!(
        err.contains("(--max-image-bytes)") && err.contains("layer 2/2"),
        "{err}"
    );
    let mut args = base.to_vec();
    args.extend(["--max-layer-entries", "0"]);
    let err = build_err(&args);
    assert!(
        err.contains("layer 1/2 of")
            && err.contains("its tar entries passes the cap of 0 entries (--max-layer-entries)"),
        "{err}"
    );
    assert_cache_clean(&cache);
}

/// The build's staging directory, once its first layer is unpacked (`marker` exists in the
/// tree): by then every blob's digest check, a first reader of each, is over.
fn staging_with(cache: &Path, marker: &str) -> std::path::PathBuf {
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "the build never unpacked {marker}"
        );
        let found = fs::read_dir(cache.join("tmp"))
            .into_iter()
            .flatten()
            .find_map(|e| {
                let work = e.ok()?.path();
                let name = work.file_name()?.to_str()?.to_string();
                let seen = fs::symlink_metadata(work.join("stage/tree").join(marker)).is_ok();
                (name.starts_with("build-") && seen).then_some(work)
            });
        if let Some(work) = found {
            return work;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// While the build runs, the tree holding an image's set-id binary and device node is inside
/// a 0700 directory (another uid cannot reach it) and, on the build's thread, a nosuid,nodev
/// mount; the finished image keeps both. The second layer is a FIFO the test holds, so the
/// build waits inside it with the first layer unpacked.
#[test]
fn setuid_binaries_and_device_nodes_are_out_of_reach_during_the_build() {
    use std::io::Write;
    if !root_or_skip("setuid_binaries_and_device_nodes_are_out_of_reach_during_the_build") {
        return;
    }
    let lower = Layer::new()
        .file("bin/suid", b"#!/bin/sh\nid\n", 0o4755, 0, 0)
        .char_device("dev/mem2", 1, 1)
        .tar();
    let upper = Layer::new().file("etc/upper", b"upper", 0o644, 0, 0).tar();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let cache = dir.path().join("cache");
    let image = Image::new(vec![lower, upper]);
    image.write_oci_layout(&layout, "suid");
    let fifo = image.oci_blob_path(&layout, 1);
    fs::remove_file(&fifo).unwrap();
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let agent = agent();
    let child = Command::new(rollbox_tests::rollbox_binary())
        .args([
            "image",
            "build",
            "--from-oci-layout",
            arg(&layout),
            "--agent",
            arg(&agent),
        ])
        .args(["--cache-dir", arg(&cache)])
        .env_remove("ROLLBOX_AGENT")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The digest check reads the blob once, whole.
    let blob = image.blobs[1].clone();
    fs::OpenOptions::new()
        .write(true)
        .open(&fifo)
        .unwrap()
        .write_all(&blob)
        .unwrap();
    // The build now waits in layer 2, layer 1 unpacked in the staging tree.
    let work = staging_with(&cache, "dev/mem2");
    // Blocks until the build opens layer 2, which then waits for its data.
    let mut second = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    // The locked mount is the stage directory, holding the tree (and a split build's top).
    let stage = work.join("stage");
    let tree = stage.join("tree");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        fs::metadata(&work).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert!(
        fs::symlink_metadata(tree.join("dev/mem2")).is_ok(),
        "layer 1 is unpacked"
    );
    let other_uid = Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "stat",
        ])
        .arg(tree.join("bin/suid"))
        .output()
        .unwrap();
    assert!(
        !other_uid.status.success()
            && String::from_utf8_lossy(&other_uid.stderr).contains("Permission denied"),
        "another uid reaches the staging tree: {other_uid:?}"
    );
    let mut options = None;
    for task in fs::read_dir(format!("/proc/{}/task", child.id())).unwrap() {
        let info = fs::read_to_string(task.unwrap().path().join("mountinfo")).unwrap_or_default();
        for line in info.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.get(4) == Some(&stage.to_str().unwrap()) {
                options = Some(fields[5].to_string());
            }
        }
    }
    let options = options.expect("the staging tree is a mount on the build's thread");
    for flag in ["nosuid", "nodev"] {
        assert!(options.split(',').any(|o| o == flag), "{options}");
    }
    let host = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host.contains(stage.to_str().unwrap()),
        "the mount leaked to the host"
    );

    second.write_all(&blob).unwrap();
    drop(second);
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let rootfs = stdout
        .lines()
        .find_map(|l| l.strip_prefix("rootfs: "))
        .unwrap();
    let suid = stat(Path::new(rootfs), "/bin/suid").unwrap();
    assert_eq!((suid.kind.as_str(), suid.mode), ("regular", 0o4755));
    let mem = stat(Path::new(rootfs), "/dev/mem2").unwrap();
    assert_eq!(mem.kind.as_str(), "character");
}
