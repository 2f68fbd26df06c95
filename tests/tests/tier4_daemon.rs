//! `rollbox serve` end to end with real Linux image templates: `scripts/daemon-demo.sh` (the
//! README's daemon walk-through, every step checked) builds a template from the busybox image's
//! `docker save` archive and one from the Debian rootfs that `rollbox image build` made, each
//! with a boot snapshot, then creates, execs, writes and reads a file, snapshots, forks, resets
//! and deletes through the `rollbox` CLI. The stock `e2b` SDK (2.63.0, the venv of
//! `scripts/e2b-venv.sh`) then runs `rollbox/tests/e2b/test_linux.py` against the daemon's E2B
//! listener with the Debian template: commands, files, PTYs, watches, pause, fork and kill in a
//! real Linux guest. The stock `e2b-code-interpreter` SDK runs `test_code_interpreter.py` with
//! the code-interpreter template (`scripts/code-interpreter-rootfs.sh`), whose start command
//! serves `run_code` from an IPython kernel in the guest.
//!
//! Linux guests need hardware virtualization: `scripts/test.sh` runs this binary in the nested
//! lab with the fixtures of `scripts/lab/tier4-fixtures.sh` (ROLLBOX_TIER4_FIXTURES).

mod tier4 {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::time::Instant;

    use rollbox_tests::linux::{fixtures, Fixtures, LabDaemon as Daemon};
    use rollbox_tests::{e2b_script, rollbox_binary, skip, vmm_binary};

    fn demo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/daemon-demo.sh")
            .canonicalize()
            .expect("scripts/daemon-demo.sh")
    }

    /// Runs the walk-through and checks that it says ok for `name`.
    fn run_demo(fixtures: &Fixtures, name: &str, source: &[String], forks: u32) {
        let rollbox = rollbox_binary();
        let vmm = vmm_binary();
        assert_eq!(
            rollbox.parent(),
            vmm.parent(),
            "rollbox serve finds rollbox-vmm beside itself"
        );
        let started = Instant::now();
        let out = Command::new(demo())
            .arg("--kernel")
            .arg(fixtures.path("OUR_VMLINUX"))
            .args(source)
            .args([
                "--name",
                name,
                "--forks",
                &forks.to_string(),
                "--memory-mib",
                "192",
            ])
            .arg("--bin-dir")
            .arg(rollbox.parent().expect("bin dir"))
            .output()
            .expect("run scripts/daemon-demo.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        println!("{stdout}");
        // The step and the demo's own complaint go last, where a log's tail shows them.
        let last_step = stdout.lines().rfind(|l| l.starts_with("== ")).unwrap_or("");
        let complaint: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("daemon-demo:"))
            .collect();
        assert!(
            out.status.success(),
            "daemon-demo.sh {name}: {}\n{stderr}\nfailed in step {last_step:?}: {}",
            out.status,
            complaint.join("\n")
        );
        assert!(
            stdout.contains(&format!("daemon demo: ok ({name})")),
            "{stdout}\n{stderr}"
        );
        println!(
            "figure: daemon walk-through with the {name} template took {:.1} s in the lab",
            started.elapsed().as_secs_f64()
        );
    }

    #[test]
    fn busybox_template_from_an_image_archive_end_to_end() {
        let Some(fixtures) = fixtures("tier4::busybox_template_from_an_image_archive_end_to_end")
        else {
            return;
        };
        let archive = fixtures.text("BUSYBOX_IMAGE_TAR");
        run_demo(
            &fixtures,
            "busybox",
            &[
                "--docker-archive".into(),
                archive,
                "--reference".into(),
                "rollbox-test/busybox:latest".into(),
            ],
            4,
        );
    }

    #[test]
    fn debian_template_end_to_end() {
        let Some(fixtures) = fixtures("tier4::debian_template_end_to_end") else {
            return;
        };
        let rootfs = fixtures.text("DEBIAN_ROOTFS");
        run_demo(&fixtures, "debian", &["--rootfs".into(), rootfs], 2);
    }

    /// The python of the e2b `version` venv that `scripts/e2b-venv.sh` made on the host. (L1
    /// sees the host's root read-only, so the venv must exist before the lab starts.)
    fn sdk_python(version: &str) -> Result<PathBuf, String> {
        rollbox_tests::venv_python("scripts/e2b-venv.sh", &[version])
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    }

    /// `rollbox serve` with its E2B listener on `port` (rollbox_tests::linux::LabDaemon).
    fn start_daemon(port: u16) -> Daemon {
        let listen = format!("127.0.0.1:{port}");
        let extra = ["--e2b-listen", &listen, "--e2b-domain", "e2b.test"].map(String::from);
        Daemon::start("e2b-lab-key-0123", &extra, Some(port))
    }

    /// `rollbox template add NAME` with the lab's kernel, a boot snapshot and `extra` flags.
    fn add_template(daemon: &Daemon, fixtures: &Fixtures, name: &str, extra: &[&str]) {
        let started = Instant::now();
        let kernel = fixtures.path("OUR_VMLINUX").display().to_string();
        let mut args = vec![
            "template",
            "add",
            name,
            "--kernel",
            &kernel,
            "--boot-snapshot",
            "--cmdline",
            "console=ttyS0 reboot=k panic=1 loglevel=4 init=/.rollbox/rollbox-agent",
        ];
        args.extend_from_slice(extra);
        let added = daemon.cli(&args);
        assert!(
            added.status.success(),
            "rollbox template add {name}: {}\n{}\n{}",
            added.status,
            String::from_utf8_lossy(&added.stderr),
            daemon.log()
        );
        println!(
            "figure: the {name} template with a boot snapshot took {:.1} s in the lab",
            started.elapsed().as_secs_f64()
        );
    }

    /// Runs `rollbox/tests/e2b/SCRIPT` with `python` against the daemon's E2B listener on
    /// `port`, with sandboxes of `template`; it must print `all ok`.
    fn run_e2b_script(daemon: &Daemon, port: u16, python: &Path, script: &str, template: &str) {
        let url = format!("http://127.0.0.1:{port}");
        let scratch = tempfile::tempdir().expect("scratch");
        let started = Instant::now();
        let output = e2b_script(python, script, &url, &daemon.key, template, scratch.path())
            .env("ROLLBOX_E2B_LINUX_GUEST", "1")
            // L1's root is read-only: no __pycache__ beside the scripts.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .unwrap_or_else(|e| panic!("run {script}: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        println!("{stdout}");
        assert!(
            output.status.success() && stdout.contains("all ok"),
            "{script} failed ({}):\n{stdout}\n{}\n--- serve.log ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            daemon.log()
        );
        println!(
            "figure: {script} took {:.1} s in the lab",
            started.elapsed().as_secs_f64()
        );
    }

    #[test]
    fn stock_e2b_sdk_with_a_debian_template_end_to_end() {
        let test = "tier4::stock_e2b_sdk_with_a_debian_template_end_to_end";
        let Some(fixtures) = fixtures(test) else {
            return;
        };
        let python = match sdk_python("2.63.0") {
            Ok(python) => python,
            Err(reason) => {
                skip(test, &format!("no e2b 2.63.0 venv: {reason}"));
                return;
            }
        };
        assert_eq!(
            rollbox_binary().parent(),
            vmm_binary().parent(),
            "rollbox serve finds rollbox-vmm beside itself"
        );
        let port = free_port();
        let daemon = start_daemon(port);
        let rootfs = fixtures.path("DEBIAN_ROOTFS").display().to_string();
        add_template(
            &daemon,
            &fixtures,
            "debian",
            &["--rootfs", &rootfs, "--memory-mib", "256"],
        );
        run_e2b_script(&daemon, port, &python, "test_linux.py", "debian");
    }

    /// The README's RL loop (`sdk/python/examples/rl_loop.py`) with rollbox's own SDK: a
    /// sandbox with a volume boots, a fork makes the other workers, each writes a trajectory
    /// to the volume with the guest's python, and a `@function` mounting the same volume
    /// reads them all and writes a checkpoint that the host reads back through the daemon.
    #[test]
    fn python_sdk_rl_loop_with_a_volume_and_a_function() {
        let test = "tier4::python_sdk_rl_loop_with_a_volume_and_a_function";
        let Some(fixtures) = fixtures(test) else {
            return;
        };
        let python = match rollbox_tests::venv_python("scripts/sdk-venv.sh", &[]) {
            Ok(python) => python,
            Err(reason) => {
                skip(test, &format!("no rollbox SDK venv: {reason}"));
                return;
            }
        };
        // 16 in the words; CI's lab runs 4 (each clone copies its guest's memory
        // for its virtiofsd, slowly under emulation).
        let workers = std::env::var("ROLLBOX_TIER4_FUNCTION_WORKERS").unwrap_or("4".into());
        let daemon = start_daemon(free_port());
        let rootfs = fixtures
            .path("CODE_INTERPRETER_ROOTFS")
            .display()
            .to_string();
        add_template(
            &daemon,
            &fixtures,
            "python",
            &["--rootfs", &rootfs, "--memory-mib", "256"],
        );
        let example = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../sdk/python/examples/rl_loop.py")
            .canonicalize()
            .expect("sdk/python/examples/rl_loop.py");
        let started = Instant::now();
        let output = Command::new(&python)
            .arg(&example)
            .args([
                "--template",
                "python",
                "--workers",
                &workers,
                "--timeout",
                "900",
            ])
            .env("ROLLBOX_SOCKET", daemon.socket())
            .env("ROLLBOX_API_KEY", &daemon.key)
            // L1's root is read-only: no __pycache__ beside the example.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .output()
            .expect("run rl_loop.py");
        let stdout = String::from_utf8_lossy(&output.stdout);
        println!("{stdout}");
        assert!(
            output.status.success() && stdout.contains("rl loop: ok"),
            "rl_loop.py failed ({}):\n{stdout}\n{}\n--- serve.log ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            daemon.log()
        );
        println!(
            "figure: the RL loop with {workers} workers, a volume and a @function took {:.1} s in the lab",
            started.elapsed().as_secs_f64()
        );
    }

    /// Figures, not asserts (docs/benchmarks.md): `sdk/python/bench/function_round_trip.py`,
    /// the round trip of `f.remote()` for a trivial function cold (a boot) and from a snapshot
    /// (a restore), beside a plain create + exec + delete, ROLLBOX_TIER4_FUNCTION_BENCH_REPS
    /// times each (default 3). Run with `--ignored --nocapture`.
    #[test]
    #[ignore = "benchmark: prints figures"]
    fn python_sdk_function_round_trip_figures() {
        let test = "tier4::python_sdk_function_round_trip_figures";
        let Some(fixtures) = fixtures(test) else {
            return;
        };
        let python = match rollbox_tests::venv_python("scripts/sdk-venv.sh", &[]) {
            Ok(python) => python,
            Err(reason) => {
                skip(test, &format!("no rollbox SDK venv: {reason}"));
                return;
            }
        };
        let reps = std::env::var("ROLLBOX_TIER4_FUNCTION_BENCH_REPS").unwrap_or("3".into());
        let daemon = start_daemon(free_port());
        let rootfs = fixtures
            .path("CODE_INTERPRETER_ROOTFS")
            .display()
            .to_string();
        add_template(
            &daemon,
            &fixtures,
            "python",
            &["--rootfs", &rootfs, "--memory-mib", "256"],
        );
        let bench = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../sdk/python/bench/function_round_trip.py")
            .canonicalize()
            .expect("sdk/python/bench/function_round_trip.py");
        let status = Command::new(&python)
            .arg(&bench)
            .args(["--template", "python", "--reps", &reps])
            .env("ROLLBOX_SOCKET", daemon.socket())
            .env("ROLLBOX_API_KEY", &daemon.key)
            // L1's root is read-only: no __pycache__ beside the script.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .status()
            .expect("run function_round_trip.py");
        assert!(
            status.success(),
            "function_round_trip.py failed ({status})\n--- serve.log ---\n{}",
            daemon.log()
        );
    }

    /// The code-interpreter template: its start command serves `POST :49999/execute` in the
    /// guest with a warm IPython kernel, started before the boot snapshot; the stock
    /// `e2b-code-interpreter` SDK's `run_code` reaches it through the daemon and the agent.
    #[test]
    fn stock_code_interpreter_sdk_with_the_code_interpreter_template() {
        let test = "tier4::stock_code_interpreter_sdk_with_the_code_interpreter_template";
        let Some(fixtures) = fixtures(test) else {
            return;
        };
        let python = match rollbox_tests::venv_python("scripts/e2b-ci-venv.sh", &[]) {
            Ok(python) => python,
            Err(reason) => {
                skip(test, &format!("no e2b-code-interpreter venv: {reason}"));
                return;
            }
        };
        let port = free_port();
        let daemon = start_daemon(port);
        let rootfs = fixtures
            .path("CODE_INTERPRETER_ROOTFS")
            .display()
            .to_string();
        add_template(
            &daemon,
            &fixtures,
            "code-interpreter-v1",
            &[
                "--rootfs",
                &rootfs,
                "--memory-mib",
                "512",
                "--start-cmd",
                "/opt/rollbox/code-interpreter/start",
                "--ready-cmd",
                "/opt/rollbox/code-interpreter/ready",
            ],
        );
        run_e2b_script(
            &daemon,
            port,
            &python,
            "test_code_interpreter.py",
            "code-interpreter-v1",
        );
    }
}
