//! The machine (`machine-config`): vCPUs, memory and rollbox's PCI/VFIO extension, checked
//! against the host.

use vmm_api::MachineConfig;

use super::validate::{ConfigError, ValidateMachine};
use crate::arch::mptable::MAX_VCPUS;

impl ValidateMachine for MachineConfig {
    fn validate(&self, host_mib: u64) -> Result<(), ConfigError> {
        if self.vcpu_count == 0 || self.vcpu_count > MAX_VCPUS {
            return Err(ConfigError::VcpuCount(self.vcpu_count));
        }
        if self.mem_size_mib == 0 {
            return Err(ConfigError::MemoryZero(self.mem_size_mib));
        }
        if self.mem_size_mib > host_mib {
            return Err(ConfigError::MemoryTooLarge {
                requested: self.mem_size_mib,
                host_mib,
            });
        }
        if self.smt {
            return Err(ConfigError::Smt);
        }
        if self.cpu_template.as_deref().is_some_and(|t| t != "None") {
            return Err(ConfigError::Unsupported("cpu_template"));
        }
        match self.huge_pages.as_deref() {
            None | Some("None") => {}
            Some("2M") if self.mem_size_mib.is_multiple_of(2) => {}
            Some("2M") => return Err(ConfigError::HugePagesOdd(self.mem_size_mib)),
            Some(_) => return Err(ConfigError::Unsupported("huge_pages")),
        }
        let vfio = &self.rollbox.vfio;
        if let Some(twice) = vfio
            .iter()
            .enumerate()
            .find_map(|(i, path)| vfio[..i].contains(path).then_some(path))
        {
            return Err(ConfigError::VfioTwice(twice.clone()));
        }
        Ok(())
    }
}

/// The host's memory in MiB, from /proc/meminfo.
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| kib / 1024)
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_api::{ConfigFile, MachineExtension};

    #[test]
    fn pci_and_vfio_are_a_rollbox_extension_of_the_machine_config() {
        let file: ConfigFile = serde_json::from_str(
            r#"{"machine-config":{"vcpu_count":1,"mem_size_mib":64,
                "rollbox":{"pci":true,"vfio":["/sys/bus/pci/devices/0000:00:04.0"]}}}"#,
        )
        .expect("parse");
        let machine = file.machine_config.expect("machine");
        assert!(machine.rollbox.pci && machine.rollbox.has_pci());
        assert_eq!(machine.rollbox.vfio.len(), 1);
        // Without it, nothing of the extension is written back.
        let plain = serde_json::to_string(&MachineConfig::default()).expect("json");
        assert!(!plain.contains("rollbox"), "{plain}");
        // One device twice is refused, naming it.
        let mut twice = machine.clone();
        twice.rollbox.vfio.push(machine.rollbox.vfio[0].clone());
        let err = twice.validate(1 << 20).expect_err("twice");
        assert!(err.to_string().contains("0000:00:04.0"), "{err}");
        let vfio_only = MachineExtension {
            pci: false,
            vfio: vec!["/x".into()],
        };
        assert!(vfio_only.has_pci(), "--vfio implies --pci");
    }

    #[test]
    fn memory_limits() {
        let mut m = MachineConfig {
            mem_size_mib: 0,
            ..Default::default()
        };
        assert_eq!(m.validate(100), Err(ConfigError::MemoryZero(0)));
        m.mem_size_mib = 200;
        assert!(matches!(
            m.validate(100),
            Err(ConfigError::MemoryTooLarge { .. })
        ));
        m.mem_size_mib = 64;
        m.vcpu_count = 33;
        assert_eq!(m.validate(100), Err(ConfigError::VcpuCount(33)));
    }

    #[test]
    fn huge_pages_are_2m_of_an_even_memory_size_or_none() {
        let machine = |mib: u64, pages: &str| MachineConfig {
            mem_size_mib: mib,
            huge_pages: Some(pages.into()),
            ..Default::default()
        };
        assert_eq!(machine(64, "2M").validate(1 << 20), Ok(()));
        assert_eq!(machine(64, "None").validate(1 << 20), Ok(()));
        assert_eq!(
            machine(65, "2M").validate(1 << 20),
            Err(ConfigError::HugePagesOdd(65))
        );
        assert_eq!(
            machine(64, "1G").validate(1 << 20),
            Err(ConfigError::Unsupported("huge_pages"))
        );
    }
}
