//! rollbox's container image (`scripts/k8s/image.sh`), as the DaemonSet runs it: built offline
//! from this workspace's binaries, pushed to the local registry and run from there by dockerd,
//! with bind mounts in place of the DaemonSet's hostPaths. The daemon in it jails and boots the
//! test guest, `docker stop` drains it within the grace period (`--drain-on-sigterm`), and a
//! second container on the same state directory reports how the sandbox ended.
//!
//! Not `--privileged`: this host's own capability bounding set lacks CAP_SYS_RESOURCE, so
//! runc refuses a privileged container here; the test grants every other capability, no
//! seccomp or AppArmor profile, /dev/kvm, /dev/net/tun and the host's cgroup tree, which is
//! what `privileged: true` gives the DaemonSet on a real node.
//!
//! Needs dockerd (`scripts/start-dockerd.sh`) and the registry (`scripts/start-registry.sh`).

// Test code: a panic on a broken fixture is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox_tests::daemon::{assert_ended, call_at, wait_for, KEY};
use rollbox_tests::images::{docker_works, registry_answers, REGISTRY};
use rollbox_tests::{kvm_available, skip, test_guest, workspace_root, TEST_GUEST_CMDLINE};
use serde_json::json;

/// A container that is removed when the test ends, however it ends.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", &self.0]).output();
    }
}

fn docker(args: &[&str]) -> String {
    let output = Command::new("docker").args(args).output().unwrap();
    assert!(
        output.status.success(),
        "docker {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Starts the daemon's container on `scratch`'s state and socket directories.
fn run_daemon(image: &str, scratch: &Path, name: &str) -> Container {
    let mount = |host: PathBuf, at: &str| format!("{}:{at}", host.display());
    let target = workspace_root().join("target");
    let target = target.to_str().unwrap();
    docker(&[
        "run",
        "-d",
        "--name",
        name,
        // The DaemonSet's hostNetwork: the sandboxes' taps and rules are the node's.
        "--network",
        "host",
        "--cap-add",
        "ALL",
        "--cap-drop",
        "SYS_RESOURCE",
        "--security-opt",
        "seccomp=unconfined",
        "--security-opt",
        "apparmor=unconfined",
        "--device",
        "/dev/kvm",
        "--device",
        "/dev/net/tun",
        "--cgroupns",
        "host",
        "-v",
        "/sys/fs/cgroup:/sys/fs/cgroup:rw",
        "-v",
        &mount(scratch.join("state"), "/var/lib/rollbox"),
        "-v",
        &mount(scratch.join("run"), "/run/rollbox"),
        "-v",
        &mount(scratch.join("key"), "/etc/rollbox/key:ro"),
        // The test guest's kernel, at the same path as on the host.
        "-v",
        &format!("{target}:{target}:ro"),
        image,
        "serve",
        "--api-key-file",
        "/etc/rollbox/key",
        "--template-dir",
        target,
        "--default-ttl",
        "300",
        "--drain-on-sigterm",
        "5",
    ]);
    Container(name.to_string())
}

fn wait_ready(sock: &Path, container: &Container) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = Endpoint::Unix(sock.to_path_buf())
            .request("GET", "/readyz", &[], None, Duration::from_secs(2))
            .is_ok_and(|r| r.status == 200);
        if ready {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon in container {} never became ready:\n{}",
            container.0,
            docker(&["logs", &container.0])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_image_from_the_local_registry_runs_jailed_sandboxes_and_drains_on_docker_stop() {
    const TEST: &str = "the_image_from_the_local_registry_runs_jailed_sandboxes";
    if !kvm_available() {
        return;
    }
    if !docker_works() {
        skip(TEST, "no dockerd answers (scripts/start-dockerd.sh)");
        return;
    }
    if !registry_answers() {
        skip(
            TEST,
            "no registry at 127.0.0.1:5000 (scripts/start-registry.sh)",
        );
        return;
    }
    let built = Command::new(workspace_root().join("scripts/k8s/image.sh"))
        .args(["--profile", "debug", "--push", REGISTRY])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&built.stdout);
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let image = stdout.lines().last().unwrap().to_string();
    assert!(
        image.starts_with(&format!("{REGISTRY}/rollbox:")),
        "{image}"
    );
    // Run what the registry holds, not the local build: drop the local names first.
    let local = image
        .trim_start_matches(&format!("{REGISTRY}/"))
        .to_string();
    docker(&["rmi", "-f", &image, &local]);
    docker(&["pull", "-q", &image]);

    let scratch = tempfile::tempdir().unwrap();
    for dir in ["state", "run"] {
        std::fs::create_dir(scratch.path().join(dir)).unwrap();
    }
    // The daemon refuses a state directory others may read.
    std::fs::set_permissions(
        scratch.path().join("state"),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    std::fs::write(scratch.path().join("key"), format!("{KEY}\n")).unwrap();
    let sock = scratch.path().join("run/rollbox.sock");
    let name = format!("rollbox-test-{}", std::process::id());
    let container = run_daemon(&image, scratch.path(), &name);
    wait_ready(&sock, &container);

    let (status, template) = call_at(
        &sock,
        "POST",
        "/templates",
        Some(json!({
            "name": "guest", "kernel": test_guest(), "cmdline": TEST_GUEST_CMDLINE, "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{template}");
    let (status, sandbox) = call_at(
        &sock,
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest"})),
    );
    assert_eq!(status, 201, "{sandbox}\n{}", docker(&["logs", &name]));
    assert_eq!(sandbox["state"], "running", "{sandbox}");
    let id = sandbox["id"].as_str().unwrap().to_string();
    let (status, node) = call_at(&sock, "GET", "/node", None);
    assert_eq!((status, &node["slots"]["used"]), (200, &json!(1)), "{node}");

    // docker stop sends SIGTERM and waits 30 s before SIGKILL: the drain takes its 5 s.
    let started = Instant::now();
    docker(&["stop", "-t", "30", &name]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(25),
        "docker stop took {took:?}: the drain did not finish within the grace period"
    );
    assert_eq!(
        docker(&["inspect", "-f", "{{.State.ExitCode}}", &name]),
        "0"
    );
    let logs = docker(&["logs", &name]);
    let logs = format!("{logs}\n{}", {
        let out = Command::new("docker")
            .args(["logs", &name])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).to_string()
    });
    assert!(logs.contains("draining first"), "{logs}");
    drop(container);

    // A new container on the same state: the sandbox ended by the drain, its files gone.
    let again = run_daemon(&image, scratch.path(), &format!("{name}-again"));
    wait_ready(&sock, &again);
    let (status, ended) = call_at(&sock, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 200, "{ended}");
    assert_ended(&ended, "deleted", "drain deadline");
    wait_for(
        "the sandbox's directory to be gone",
        Duration::from_secs(10),
        || {
            std::fs::read_dir(scratch.path().join("state/sandboxes"))
                .map(|mut d| d.next().is_none())
                .unwrap_or(true)
        },
    );
}

/// Reads rollbox-lease.yaml (argv 1), checks its agent-sandbox kinds, and writes its
/// SandboxTemplate's podTemplate as a Pod to argv 2.
const LEASE_POD: &str = r#"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {d["kind"]: d for d in docs}
assert set(kinds) == {"SandboxTemplate", "SandboxWarmPool"}, list(kinds)
for d in docs:
    assert d["apiVersion"] == "extensions.agents.x-k8s.io/v1beta1", d["apiVersion"]
template = kinds["SandboxTemplate"]
assert kinds["SandboxWarmPool"]["spec"]["sandboxTemplateRef"]["name"] == template["metadata"]["name"]
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lease"}}
pod["metadata"].update(template["spec"]["podTemplate"].get("metadata", {}))
pod["spec"] = template["spec"]["podTemplate"]["spec"]
yaml.safe_dump(pod, open(sys.argv[2], "w"))
"#;

#[test]
fn the_manifests_validate_offline_and_name_only_flags_the_cli_has() {
    // Not a skip when it cannot be made: the manifest check needs nothing but PyPI.
    let python = rollbox_tests::venv_python("scripts/k8s/validate-venv.sh", &[])
        .unwrap_or_else(|e| panic!("{e}"));
    let validate = |file: &Path| {
        Command::new(&python)
            .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
            .arg(file)
            .output()
            .unwrap()
    };
    let manifest = workspace_root().join("deploy/kubernetes/rollbox-node.yaml");
    let checked = validate(&manifest);
    assert!(
        checked.status.success(),
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // The validator does refuse what the API server would: a field of the wrong type.
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(text.contains("hostNetwork: true"));
    let broken_dir = tempfile::tempdir().unwrap();
    let broken = broken_dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        text.replace("hostNetwork: true", "hostNetwork: yes-please"),
    )
    .unwrap();
    assert!(
        !validate(&broken).status.success(),
        "a broken manifest passed"
    );

    // The lease's SandboxTemplate: agent-sandbox's kinds, no schema of theirs here, so its
    // podTemplate is checked as the Pod it becomes, and the warm pool names the template.
    let lease = workspace_root().join("deploy/kubernetes/rollbox-lease.yaml");
    let pod = broken_dir.path().join("lease-pod.yaml");
    let extracted = Command::new(&python)
        .arg("-c")
        .arg(LEASE_POD)
        .arg(&lease)
        .arg(&pod)
        .output()
        .unwrap();
    assert!(
        extracted.status.success(),
        "{}",
        String::from_utf8_lossy(&extracted.stderr)
    );
    let checked = validate(&pod);
    assert!(
        checked.status.success(),
        "the lease's podTemplate: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let lease_text = std::fs::read_to_string(&lease).unwrap();
    assert!(
        text.contains("--e2b-socket=/run/rollbox/e2b.sock")
            && lease_text.contains("--e2b-socket=/run/rollbox/e2b.sock"),
        "the lease reaches the DaemonSet's E2B socket"
    );

    // Every flag the manifests give rollbox is one the CLI has.
    let mut help = String::new();
    for args in [
        &["serve", "--help"][..],
        &["node", "probe", "--help"],
        &["node", "drain", "--help"],
        &["node", "advertise", "--help"],
        &["lease", "--help"],
    ] {
        let out = Command::new(rollbox_tests::rollbox_binary())
            .args(args)
            .output()
            .unwrap();
        help.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    // (Comments name kubectl's flags too; only the manifest's own lines count.)
    let both = format!("{text}\n{lease_text}");
    let flags: Vec<&str> = both
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .flat_map(|line| line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')))
        .filter(|word| word.starts_with("--") && word.len() > 2 && !word.starts_with("---"))
        .collect();
    assert!(flags.len() >= 8, "{flags:?}");
    for flag in flags {
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "deploy/kubernetes gives {flag}, which rollbox does not have"
        );
    }
}
