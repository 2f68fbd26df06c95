//! `rollbox serve` end to end with real Linux image templates: `scripts/daemon-demo.sh` (the
//! README's daemon walk-through, every step checked) builds a template from the busybox image's
//! `docker save` archive and one from the Debian rootfs that `rollbox image build` made, each
//! with a boot snapshot, then creates, execs, writes and reads a file, snapshots, forks, resets
//! and deletes through the `rollbox` CLI.
//!
//! Linux guests need hardware virtualization: `scripts/test.sh` runs this binary in the nested
//! lab with the fixtures of `scripts/lab/tier4-fixtures.sh` (ROLLBOX_TIER4_FIXTURES).

mod tier4 {
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::Instant;

    use rollbox_tests::linux::{fixtures, Fixtures};
    use rollbox_tests::{rollbox_binary, vmm_binary};

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
        assert!(
            out.status.success(),
            "daemon-demo.sh {name}: {}\n{stderr}",
            out.status
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
}
