//! Crafted container images for the image-builder tests (rollbox/tests/image_build.rs and
//! the daemon's image templates): layers made with the `tar` crate, written as OCI layouts,
//! `docker save` archives or pushed to the local registry; running the real `rollbox` binary;
//! reading the ext4 it builds with debugfs. Behind the `images` feature.

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use sha2::Digest as _;
use tar::{EntryType, Header};

pub const REGISTRY: &str = "127.0.0.1:5000";

pub fn sha256(bytes: &[u8]) -> String {
    let digest = sha2::Sha256::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn hex_of(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

/// The builder reproduces ownership and device nodes, which needs root.
pub fn root_or_skip(test: &str) -> bool {
    if is_root() {
        return true;
    }
    crate::skip(
        test,
        "needs root (the image builder sets ownership and makes device nodes)",
    );
    false
}

pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Does a registry answer GET /v2/ at 127.0.0.1:5000?
pub fn registry_answers() -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(
        &REGISTRY.parse().expect("the registry address"),
        Duration::from_secs(1),
    ) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /v2/ HTTP/1.0\r\nHost: {REGISTRY}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = [0u8; 32];
    let n = stream.read(&mut response).unwrap_or(0);
    let head = String::from_utf8_lossy(&response[..n]);
    head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200") || head.contains(" 401")
}

pub fn docker_works() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The agent to install: the real static agent if it is built, else busybox-static as a
/// stand-in (any static executable will do for the image builder).
pub fn agent() -> PathBuf {
    let real = crate::workspace_root()
        .join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent");
    if real.is_file() {
        return real;
    }
    for candidate in ["/bin/busybox", "/usr/bin/busybox"] {
        if Path::new(candidate).is_file() {
            return PathBuf::from(candidate);
        }
    }
    panic!("no agent: build the guest agent or apt-get install busybox-static");
}

/// One layer, built in memory.
pub struct Layer {
    builder: tar::Builder<Vec<u8>>,
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Self {
        Self {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn header(kind: EntryType, mode: u32, uid: u64, gid: u64, size: u64) -> Header {
        let mut header = Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(uid);
        header.set_gid(gid);
        header.set_mtime(1_700_000_000);
        header.set_size(size);
        header
    }

    pub fn dir(mut self, path: &str, mode: u32, uid: u64, gid: u64) -> Self {
        let mut header = Self::header(EntryType::Directory, mode, uid, gid, 0);
        self.builder
            .append_data(&mut header, path, std::io::empty())
            .expect("tar: a directory entry");
        self
    }

    pub fn file(mut self, path: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
        let mut header = Self::header(EntryType::Regular, mode, uid, gid, data.len() as u64);
        self.builder
            .append_data(&mut header, path, data)
            .expect("tar: a file entry");
        self
    }

    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut header = Self::header(EntryType::Symlink, 0o777, 0, 0, 0);
        self.builder
            .append_link(&mut header, path, target)
            .expect("tar: a symlink entry");
        self
    }

    pub fn hardlink(mut self, path: &str, target: &str) -> Self {
        let mut header = Self::header(EntryType::Link, 0o644, 0, 0, 0);
        self.builder
            .append_link(&mut header, path, target)
            .expect("tar: a hard link entry");
        self
    }

    pub fn char_device(mut self, path: &str, major: u32, minor: u32) -> Self {
        let mut header = Self::header(EntryType::Char, 0o620, 0, 5, 0);
        header
            .set_device_major(major)
            .expect("tar: the major number");
        header
            .set_device_minor(minor)
            .expect("tar: the minor number");
        self.builder
            .append_data(&mut header, path, std::io::empty())
            .expect("tar: a device entry");
        self
    }

    /// A PAX extended header ('x') for the next entry: records `LEN key=value\n`.
    pub fn pax(mut self, records: &[(&str, &[u8])]) -> Self {
        let mut data = Vec::new();
        for (key, value) in records {
            let body = key.len() + value.len() + 3; // ' ', '=', '\n'
            let mut len = body + 1;
            while len != body + len.to_string().len() {
                len = body + len.to_string().len();
            }
            data.extend_from_slice(format!("{len} {key}=").as_bytes());
            data.extend_from_slice(value);
            data.push(b'\n');
        }
        let mut header = Self::header(EntryType::XHeader, 0o644, 0, 0, data.len() as u64);
        header
            .set_path("PaxHeaders/entry")
            .expect("tar: the PAX header's path");
        header.set_cksum();
        self.builder
            .append(&header, &data[..])
            .expect("tar: a PAX header");
        self
    }

    /// An entry with a raw name that the tar crate's safe setters would refuse.
    pub fn raw_file(mut self, name: &str, data: &[u8]) -> Self {
        let mut header = Self::header(EntryType::Regular, 0o644, 0, 0, data.len() as u64);
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_cksum();
        self.builder
            .append(&header, data)
            .expect("tar: a raw entry");
        self
    }

    pub fn tar(self) -> Vec<u8> {
        self.builder.into_inner().expect("tar: the finished layer")
    }
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).expect("gzip a layer");
    encoder.finish().expect("gzip a layer")
}

/// Bytes that do not compress (xorshift), for disk-filling layers.
pub fn noise(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A crafted image: uncompressed layer tars plus the runtime config.
pub struct Image {
    pub layers: Vec<Vec<u8>>,
    /// The stored form of each layer (gzip for registries and OCI layouts).
    pub blobs: Vec<Vec<u8>>,
    pub config: Vec<u8>,
}

impl Image {
    pub fn new(layers: Vec<Vec<u8>>) -> Self {
        let blobs = layers.iter().map(|l| gzip(l)).collect();
        let mut image = Self {
            layers,
            blobs,
            config: Vec::new(),
        };
        image.config = image.make_config();
        image
    }

    fn make_config(&self) -> Vec<u8> {
        let diff_ids: Vec<String> = self.layers.iter().map(|l| sha256(l)).collect();
        serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": ["/bin/sh", "-c"],
                "Cmd": ["echo $GREETING"],
                "Env": ["PATH=/usr/bin:/bin", "GREETING=hello world"],
                "WorkingDir": "/home/user",
                "User": "1000:1000",
                "Labels": {"org.example.test": "rollbox"}
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": []
        }))
        .expect("the image config as JSON")
    }

    pub fn config_digest(&self) -> String {
        sha256(&self.config)
    }

    pub fn manifest(&self) -> Vec<u8> {
        let layers: Vec<serde_json::Value> = self
            .blobs
            .iter()
            .map(|b| {
                serde_json::json!({
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha256(b),
                    "size": b.len()
                })
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": self.config_digest(),
                "size": self.config.len()
            },
            "layers": layers
        }))
        .expect("the manifest as JSON")
    }

    /// Writes an OCI image layout with this image tagged `tag`.
    pub fn write_oci_layout(&self, dir: &Path, tag: &str) {
        let blobs = dir.join("blobs/sha256");
        fs::create_dir_all(&blobs).expect("create the layout's blobs directory");
        fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("write oci-layout");
        for blob in &self.blobs {
            fs::write(blobs.join(hex_of(&sha256(blob))), blob).expect("write a layer blob");
        }
        fs::write(blobs.join(hex_of(&self.config_digest())), &self.config)
            .expect("write the config blob");
        let manifest = self.manifest();
        fs::write(blobs.join(hex_of(&sha256(&manifest))), &manifest)
            .expect("write the manifest blob");
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": sha256(&manifest),
                "size": manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": tag}
            }]
        });
        fs::write(
            dir.join("index.json"),
            serde_json::to_vec(&index).expect("the index as JSON"),
        )
        .expect("write index.json");
    }

    /// Path of the first layer's blob inside an OCI layout written by `write_oci_layout`.
    pub fn oci_blob_path(&self, dir: &Path, layer: usize) -> PathBuf {
        dir.join("blobs/sha256")
            .join(hex_of(&sha256(&self.blobs[layer])))
    }

    /// Writes a legacy `docker save` tarball (`<id>/layer.tar`, `<config hex>.json`).
    pub fn write_docker_archive(&self, file: &Path, repo_tag: &str) {
        let mut builder =
            tar::Builder::new(fs::File::create(file).expect("create the docker archive"));
        let mut add = |name: &str, data: &[u8]| {
            let mut header = Header::new_gnu();
            header.set_entry_type(EntryType::Regular);
            header.set_mode(0o644);
            header.set_size(data.len() as u64);
            header.set_mtime(1_700_000_000);
            builder
                .append_data(&mut header, name, data)
                .expect("tar: an archive entry");
        };
        let mut layer_names = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let id = format!("{:064x}", i + 1);
            let name = format!("{id}/layer.tar");
            add(&name, layer);
            layer_names.push(name);
        }
        let config_name = format!("{}.json", hex_of(&self.config_digest()));
        add(&config_name, &self.config);
        let manifest = serde_json::json!([{
            "Config": config_name,
            "RepoTags": [repo_tag],
            "Layers": layer_names
        }]);
        add(
            "manifest.json",
            &serde_json::to_vec(&manifest).expect("the archive manifest as JSON"),
        );
        builder
            .into_inner()
            .and_then(|f| f.sync_all())
            .expect("finish the docker archive");
    }

    /// Pushes the image to the loopback registry with oci-client.
    pub fn push(&self, reference: &str) {
        self.push_with(reference, &oci_client::secrets::RegistryAuth::Anonymous);
    }

    /// Pushes the image to a plain-HTTP registry with oci-client, with these credentials.
    pub fn push_with(&self, reference: &str, auth: &oci_client::secrets::RegistryAuth) {
        use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = oci_client::Client::new(ClientConfig {
            protocol: ClientProtocol::Http,
            ..Default::default()
        });
        let reference: oci_client::Reference = reference.parse().expect("a valid image reference");
        let layers: Vec<ImageLayer> = self
            .blobs
            .iter()
            .map(|b| {
                ImageLayer::new(
                    b.clone(),
                    "application/vnd.oci.image.layer.v1.tar+gzip".to_string(),
                    None,
                )
            })
            .collect();
        let config = Config::new(
            self.config.clone(),
            "application/vnd.oci.image.config.v1+json".to_string(),
            None,
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        runtime
            .block_on(client.push(&reference, &layers, config, auth, None))
            .expect("push the image to the registry");
    }
}

/// GET a manifest from the loopback registry: its bytes.
pub fn registry_manifest(repository: &str, reference: &str) -> Vec<u8> {
    let output = Command::new("curl")
        .args([
            "-sf",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
        ])
        .arg(format!(
            "http://{REGISTRY}/v2/{repository}/manifests/{reference}"
        ))
        .output()
        .expect("run curl");
    assert!(
        output.status.success(),
        "GET manifest {repository}:{reference}"
    );
    output.stdout
}

/// PUT a multi-platform index (linux/amd64 and linux/arm64 entries) under `tag`.
pub fn registry_put_index(repository: &str, tag: &str, entries: &[(&str, &[u8])]) {
    let manifests: Vec<serde_json::Value> = entries
        .iter()
        .map(|(arch, manifest)| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": sha256(manifest),
                "size": manifest.len(),
                "platform": {"architecture": arch, "os": "linux"}
            })
        })
        .collect();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests
    });
    let output = Command::new("curl")
        .args([
            "-sf",
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/vnd.oci.image.index.v1+json",
            "--data-binary",
        ])
        .arg(serde_json::to_string(&index).expect("the index as JSON"))
        .arg(format!("http://{REGISTRY}/v2/{repository}/manifests/{tag}"))
        .output()
        .expect("run curl");
    assert!(
        output.status.success(),
        "PUT index: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// vfs_cap_data v2: effective, permitted = CAP_NET_RAW (bit 13).
pub const NET_RAW_CAPABILITY: [u8; 20] = [
    1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

/// The standard test image: two layers exercising whiteouts, an opaque directory, links,
/// set-id bits, ownership and a device node.
pub fn standard_image() -> Image {
    let lower = Layer::new()
        .dir("bin", 0o755, 0, 0)
        .file("bin/busybox", b"\x7fELF not really busybox", 0o755, 0, 0)
        .symlink("bin/sh", "busybox")
        .hardlink("bin/hard", "bin/busybox")
        .file("bin/su", b"setuid", 0o4755, 0, 0)
        .dir("etc", 0o755, 0, 0)
        .file(
            "etc/passwd",
            b"root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
            0o644,
            0,
            0,
        )
        .file("etc/gone", b"deleted by the upper layer", 0o644, 0, 0)
        .file("data/old/file", b"hidden by the opaque marker", 0o644, 0, 0)
        .dir("home/user", 0o700, 1000, 1000)
        .file("home/user/notes", b"private", 0o640, 1000, 1000)
        .char_device("dev/console", 5, 1)
        // File capabilities (cap_net_raw, effective) and a user xattr, as PAX records.
        .pax(&[
            ("SCHILY.xattr.security.capability", &NET_RAW_CAPABILITY),
            ("SCHILY.xattr.user.origin", b"rollbox-test"),
        ])
        .file("bin/ping", b"ping", 0o755, 0, 0)
        .tar();
    let upper = Layer::new()
        .file("etc/.wh.gone", b"", 0o644, 0, 0)
        .dir("data", 0o755, 0, 0)
        .file("data/.wh..wh..opq", b"", 0o644, 0, 0)
        .file("data/new", b"new", 0o644, 0, 0)
        .tar();
    Image::new(vec![lower, upper])
}

/// Runs the real `rollbox` binary.
pub fn rollbox(args: &[&str]) -> Output {
    let output = Command::new(crate::rollbox_binary())
        .args(args)
        .env_remove("ROLLBOX_AGENT")
        .output()
        .expect("run rollbox");
    eprintln!(
        "$ rollbox {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The `key: value` lines rollbox prints on success.
pub struct Built {
    pub rootfs: PathBuf,
    pub metadata: PathBuf,
    pub size_bytes: u64,
    pub stderr: String,
}

pub fn build_ok(args: &[&str]) -> Built {
    let output = rollbox(args);
    assert!(output.status.success(), "rollbox {args:?} failed");
    let stdout = String::from_utf8(output.stdout).expect("rollbox's stdout is UTF-8");
    let field = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap_or_else(|| panic!("no {key} in {stdout}"))
            .to_string()
    };
    Built {
        rootfs: PathBuf::from(field("rootfs")),
        metadata: PathBuf::from(field("metadata")),
        size_bytes: field("size")
            .split_whitespace()
            .next()
            .expect("a size")
            .parse()
            .expect("the size in bytes"),
        stderr: String::from_utf8(output.stderr).expect("rollbox's stderr is UTF-8"),
    }
}

pub fn build_err(args: &[&str]) -> String {
    let output = rollbox(args);
    assert!(
        !output.status.success(),
        "rollbox {args:?} should have failed"
    );
    String::from_utf8(output.stderr).expect("rollbox's stderr is UTF-8")
}

/// Runs one debugfs request against an image; returns stdout and stderr together.
pub fn debugfs(image: &Path, request: &str) -> String {
    let output = Command::new("debugfs")
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .args(["-R", request])
        .arg(image)
        .output()
        .expect("debugfs (e2fsprogs) must be installed");
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

pub struct Inode {
    pub kind: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub links: u32,
    pub inode: u64,
}

/// `stat PATH` in the image; None when the path does not exist.
pub fn stat(image: &Path, path: &str) -> Option<Inode> {
    let text = debugfs(image, &format!("stat {path}"));
    if text.contains("File not found") {
        return None;
    }
    let mode: String = field(&text, "Mode:");
    Some(Inode {
        kind: field(&text, "Type:"),
        mode: u32::from_str_radix(&mode, 8)
            .unwrap_or_else(|e| panic!("Mode: {mode:?} in debugfs output: {e}\n{text}")),
        uid: field(&text, "User:"),
        gid: field(&text, "Group:"),
        links: field(&text, "Links:"),
        inode: field(&text, "Inode:"),
    })
}

/// The word after `key` in debugfs output, parsed.
fn field<T: std::str::FromStr>(text: &str, key: &str) -> T
where
    T::Err: std::fmt::Display,
{
    let word = text
        .find(key)
        .and_then(|at| text[at + key.len()..].split_whitespace().next())
        .unwrap_or_else(|| panic!("no {key} in debugfs output:\n{text}"));
    word.parse()
        .unwrap_or_else(|e| panic!("{key} {word:?} in debugfs output: {e}\n{text}"))
}

pub fn cat(image: &Path, path: &str) -> Vec<u8> {
    let output = Command::new("debugfs")
        .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
        .args(["-R", &format!("cat {path}")])
        .arg(image)
        .output()
        .expect("run debugfs");
    output.stdout
}

/// Nothing half-written may remain: no rootfs entries and an empty tmp/.
pub fn assert_cache_clean(cache: &Path) {
    for sub in ["rootfs", "tmp"] {
        let dir = cache.join(sub);
        if dir.exists() {
            let left: Vec<_> = fs::read_dir(&dir)
                .expect("read the cache directory")
                .map(|e| e.expect("a cache entry").path())
                .collect();
            assert!(
                left.is_empty(),
                "left behind in {}: {left:?}",
                dir.display()
            );
        }
    }
}

/// Three images on the same two layers, each with one of its own (`rollbox-test/taskI:latest`
/// in `DIR/taskI.tar`): templates of the second and third share a base with the first's.
pub fn images_on_one_base(dir: &Path) -> Vec<PathBuf> {
    let os = Layer::new()
        .dir("bin", 0o755, 0, 0)
        .file("bin/busybox", &noise(256 << 10), 0o755, 0, 0)
        .symlink("bin/sh", "busybox")
        .dir("etc", 0o755, 0, 0)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644, 0, 0)
        .file("etc/os-release", b"ID=base\n", 0o644, 0, 0)
        .tar();
    let runtime = Layer::new()
        .dir("usr/lib/runtime", 0o755, 0, 0)
        .file("usr/lib/runtime/lib.so", &noise(1 << 20), 0o644, 0, 0)
        .tar();
    (0..3)
        .map(|i| {
            let task = Layer::new()
                .dir("task", 0o755, 0, 0)
                .file("task/id", format!("task {i}\n").as_bytes(), 0o644, 0, 0)
                .file("etc/.wh.os-release", b"", 0o644, 0, 0)
                .tar();
            let file = dir.join(format!("task{i}.tar"));
            Image::new(vec![os.clone(), runtime.clone(), task])
                .write_docker_archive(&file, &format!("rollbox-test/task{i}:latest"));
            file
        })
        .collect()
}
