//! The `--config` file: Firecracker's JSON of every resource, read and applied in one go.

use std::path::Path;

use vmm_api::ConfigFile;

use super::console::{ConsoleConfig, MIN_CONSOLE_MAX_BYTES};
use super::resources::VmResources;
use super::validate::{ConfigError, Validate, ValidateMachine};

/// Reads and parses the `--config` file at `path`; unknown fields are errors.
pub fn load_config_file(path: &Path) -> Result<ConfigFile, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

impl VmResources {
    /// Applies a configuration file.
    pub fn apply_file(&mut self, file: ConfigFile, host_mib: u64) -> Result<(), ConfigError> {
        if let Some(machine) = file.machine_config {
            machine.validate(host_mib)?;
            self.machine = machine;
        }
        self.boot_source = file.boot_source.or(self.boot_source.take());
        for drive in file.drives {
            self.upsert_drive(drive)?;
        }
        if let Some(vsock) = file.vsock {
            vsock.validate()?;
            self.vsock = Some(vsock);
        }
        for iface in file.network_interfaces {
            self.upsert_net(iface)?;
        }
        if let Some(console) = file.console {
            self.console = ConsoleConfig::parse(&console);
        }
        if let Some(max) = file.console_max_bytes {
            if max < MIN_CONSOLE_MAX_BYTES {
                return Err(ConfigError::ConsoleMaxBytes(max));
            }
            self.console = self.console.clone().with_max_bytes(max);
        }
        for fs in file.fs {
            self.add_fs(fs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_api::FsCache;

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_str::<ConfigFile>(
            r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,"bogus":1}}"#,
        )
        .expect_err("must fail");
        assert!(err.to_string().contains("bogus"), "{err}");
        let err = serde_json::from_str::<ConfigFile>(r#"{"kernel":"x"}"#).expect_err("must fail");
        assert!(err.to_string().contains("kernel"), "{err}");
    }

    #[test]
    fn firecracker_config_parses() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"boot-source":{"kernel_image_path":"/k","boot_args":"console=ttyS0"},
                "machine-config":{"vcpu_count":2,"mem_size_mib":256,"smt":false},
                "drives":[{"drive_id":"rootfs","path_on_host":"/r","is_root_device":true,"is_read_only":false}],
                "vsock":{"guest_cid":3,"uds_path":"/tmp/v.sock"}}"#,
        )
        .expect("parse");
        let mut res = VmResources::default();
        res.apply_file(file, 1024).expect("apply");
        assert_eq!(res.machine.vcpu_count, 2);
        assert_eq!(res.root_args().as_deref(), Some("root=/dev/vda rw"));
    }

    #[test]
    fn fs_is_a_separate_config_file_field() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"fs":[{"tag":"t","shared_dir":"/tmp","readonly":true,"cache":"always"}]}"#,
        )
        .expect("parse");
        assert_eq!(file.fs[0].cache, FsCache::Always);
        assert!(serde_json::from_str::<ConfigFile>(
            r#"{"fs":[{"tag":"t","shared_dir":"/tmp","bogus":1}]}"#
        )
        .is_err());
    }

    #[test]
    fn a_console_file_is_capped_at_8_mib_unless_the_file_says_otherwise() {
        let apply = |json: &str| {
            let file: ConfigFile = serde_json::from_str(json).expect("parse");
            let mut res = VmResources::default();
            res.apply_file(file, 1024).map(|()| res.console)
        };
        let cap = |max_bytes| ConsoleConfig::File {
            path: "/c.log".into(),
            max_bytes,
        };
        assert_eq!(apply(r#"{"console":"/c.log"}"#), Ok(cap(8 << 20)));
        assert_eq!(
            apply(r#"{"console":"/c.log","console-max-bytes":4096}"#),
            Ok(cap(4096))
        );
        assert_eq!(
            apply(r#"{"console":"stdout","console-max-bytes":4096}"#),
            Ok(ConsoleConfig::Stdout)
        );
        let err = apply(r#"{"console":"/c.log","console-max-bytes":10}"#).expect_err("too small");
        assert_eq!(
            err.to_string(),
            "console-max-bytes 10 is invalid: it must be at least 1024"
        );
    }
}
