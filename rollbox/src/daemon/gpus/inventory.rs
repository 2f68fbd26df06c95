//! The node's GPUs: PCI devices bound to `vfio-pci` (`rollbox serve --gpu BDF[=NAME]`, else
//! every device bound to vfio-pci), each with its IOMMU group and a name from the PCI ID
//! database (`/usr/share/misc/pci.ids`, Debian's `pci.ids` package) unless one is given.

use std::path::{Path, PathBuf};

use crate::daemon::api::Gpu;

/// Where Debian keeps the PCI ID database.
pub const PCI_IDS: &str = "/usr/share/misc/pci.ids";

/// A GPU the inventory cannot take; each names the device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error("--gpu {0:?}: expected DDDD:BB:DD.F[=NAME] (a PCI address, e.g. 0000:3b:00.0=H100)")]
    Syntax(String),
    #[error("--gpu {bdf}: {why}")]
    Device { bdf: String, why: String },
}

/// One `--gpu BDF[=NAME]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    pub bdf: String,
    pub name: Option<String>,
}

impl GpuSpec {
    pub fn parse(text: &str) -> Result<GpuSpec, InventoryError> {
        let (bdf, name) = match text.split_once('=') {
            Some((bdf, name)) => (bdf, Some(name)),
            None => (text, None),
        };
        let bad = || InventoryError::Syntax(text.to_string());
        if !is_bdf(bdf) {
            return Err(bad());
        }
        if let Some(name) = name {
            if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
                return Err(bad());
            }
        }
        Ok(GpuSpec {
            bdf: bdf.to_ascii_lowercase(),
            name: name.map(str::to_string),
        })
    }
}

/// `DDDD:BB:DD.F` in hex.
pub fn is_bdf(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// A sysfs file's text, trimmed.
fn read(path: &Path) -> Option<String> {
    Some(std::fs::read_to_string(path).ok()?.trim().to_string())
}

/// The link's last component (a driver's or an IOMMU group's name).
fn link_name(path: &Path) -> Option<String> {
    Some(
        std::fs::read_link(path)
            .ok()?
            .file_name()?
            .to_string_lossy()
            .into_owned(),
    )
}

/// The GPUs under `sysfs` (`/sys` on a host): `specs`, else every device bound to vfio-pci.
pub fn discover(
    sysfs: &Path,
    specs: &[GpuSpec],
    pci_ids: Option<&str>,
) -> Result<Vec<Gpu>, InventoryError> {
    let devices = sysfs.join("bus/pci/devices");
    let specs: Vec<GpuSpec> = if specs.is_empty() {
        let mut bound: Vec<GpuSpec> = std::fs::read_dir(sysfs.join("bus/pci/drivers/vfio-pci"))
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|name| is_bdf(name))
                    .map(|bdf| GpuSpec { bdf, name: None })
                    .collect()
            })
            .unwrap_or_default();
        bound.sort_by(|a, b| a.bdf.cmp(&b.bdf));
        bound
    } else {
        specs.to_vec()
    };
    let mut gpus = Vec::new();
    for spec in specs {
        let dir = devices.join(&spec.bdf);
        let refuse = |why: String| InventoryError::Device {
            bdf: spec.bdf.clone(),
            why,
        };
        let (Some(vendor), Some(device)) = (read(&dir.join("vendor")), read(&dir.join("device")))
        else {
            return Err(refuse(format!("no PCI device at {}", dir.display())));
        };
        let driver = link_name(&dir.join("driver"));
        if driver.as_deref() != Some("vfio-pci") {
            return Err(refuse(format!(
                "bound to {}, not vfio-pci (echo vfio-pci > {d}/driver_override; echo {bdf} > {d}/driver/unbind; echo {bdf} > /sys/bus/pci/drivers_probe)",
                driver.as_deref().unwrap_or("no driver"),
                d = dir.display(),
                bdf = spec.bdf
            )));
        }
        let group = link_name(&dir.join("iommu_group"))
            .and_then(|g| g.parse::<u32>().ok())
            .ok_or_else(|| refuse("no IOMMU group (is the IOMMU on?)".into()))?;
        let vendor = vendor.trim_start_matches("0x").to_ascii_lowercase();
        let device = device.trim_start_matches("0x").to_ascii_lowercase();
        let name = spec
            .name
            .clone()
            .or_else(|| pci_ids.and_then(|db| pci_name(db, &vendor, &device)))
            .unwrap_or_else(|| format!("{vendor}:{device}"));
        gpus.push(Gpu {
            bdf: spec.bdf.clone(),
            name,
            vendor,
            device,
            iommu_group: group,
            holder: None,
        });
    }
    Ok(gpus)
}

/// The sysfs path the VMM and the jailer take for a device.
pub fn sysfs_path(bdf: &str) -> PathBuf {
    Path::new("/sys/bus/pci/devices").join(bdf)
}

/// "Vendor Device" from the PCI ID database's text, if it knows the device.
pub fn pci_name(db: &str, vendor: &str, device: &str) -> Option<String> {
    let mut vendor_name = None;
    for line in db.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if !line.starts_with('\t') {
            if vendor_name.is_some() {
                // The vendor's block ended without the device.
                break;
            }
            let (id, name) = line.split_once("  ")?;
            if id.eq_ignore_ascii_case(vendor) {
                vendor_name = Some(name.trim().to_string());
            }
            continue;
        }
        let Some(vendor_name) = &vendor_name else {
            continue;
        };
        if line.starts_with("\t\t") {
            continue;
        }
        if let Some((id, name)) = line.trim_start_matches('\t').split_once("  ") {
            if id.eq_ignore_ascii_case(device) {
                return Some(format!("{vendor_name} {}", name.trim()));
            }
        }
    }
    vendor_name.map(|v| format!("{v} device {device}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DB: &str = "# comment\n1234  QEMU-ish\n\t11e8  Education device\n\t\t1af4 1100  subsystem\n10de  NVIDIA Corporation\n\t2330  GH100 [H100 SXM5 80GB]\n";

    fn fake_device(sysfs: &Path, bdf: &str, vendor: &str, device: &str, driver: &str, group: u32) {
        let dir = sysfs.join("devices/pci0000:00").join(bdf);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("vendor"), format!("0x{vendor}\n")).expect("vendor");
        std::fs::write(dir.join("device"), format!("0x{device}\n")).expect("device");
        let drivers = sysfs.join("bus/pci/drivers").join(driver);
        std::fs::create_dir_all(&drivers).expect("drivers");
        std::os::unix::fs::symlink(&drivers, dir.join("driver")).expect("driver link");
        let groups = sysfs.join("kernel/iommu_groups").join(group.to_string());
        std::fs::create_dir_all(&groups).expect("group");
        std::os::unix::fs::symlink(&groups, dir.join("iommu_group")).expect("group link");
        let devices = sysfs.join("bus/pci/devices");
        std::fs::create_dir_all(&devices).expect("devices");
        std::os::unix::fs::symlink(&dir, devices.join(bdf)).expect("device link");
        if driver == "vfio-pci" {
            std::os::unix::fs::symlink(&dir, drivers.join(bdf)).expect("bound");
        }
    }

    #[test]
    fn specs_parse_and_bad_ones_are_named() {
        assert_eq!(
            GpuSpec::parse("0000:3B:00.0=H100").expect("spec"),
            GpuSpec {
                bdf: "0000:3b:00.0".into(),
                name: Some("H100".into())
            }
        );
        assert_eq!(GpuSpec::parse("0000:00:04.0").expect("spec").name, None);
        for bad in ["3b:00.0", "0000:3b:00.0=", "0000:3b:00:0", "gpu0"] {
            assert_eq!(
                GpuSpec::parse(bad),
                Err(InventoryError::Syntax(bad.into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn names_come_from_the_pci_id_database() {
        assert_eq!(
            pci_name(DB, "10de", "2330").as_deref(),
            Some("NVIDIA Corporation GH100 [H100 SXM5 80GB]")
        );
        assert_eq!(
            pci_name(DB, "1234", "11E8").as_deref(),
            Some("QEMU-ish Education device")
        );
        assert_eq!(
            pci_name(DB, "10de", "ffff").as_deref(),
            Some("NVIDIA Corporation device ffff")
        );
        assert_eq!(pci_name(DB, "abcd", "0001"), None);
    }

    #[test]
    fn discovery_takes_vfio_bound_devices_and_refuses_others_by_name() {
        let dir = tempfile::tempdir().expect("sysfs");
        let sysfs = dir.path();
        fake_device(sysfs, "0000:00:04.0", "1234", "11e8", "vfio-pci", 5);
        fake_device(sysfs, "0000:00:05.0", "10de", "2330", "nvidia", 6);
        let found = discover(sysfs, &[], Some(DB)).expect("discover");
        assert_eq!(found.len(), 1);
        assert_eq!(
            (
                found[0].bdf.as_str(),
                found[0].name.as_str(),
                found[0].iommu_group
            ),
            ("0000:00:04.0", "QEMU-ish Education device", 5)
        );
        let named = [GpuSpec::parse("0000:00:04.0=edu").expect("spec")];
        assert_eq!(
            discover(sysfs, &named, Some(DB)).expect("named")[0].name,
            "edu"
        );
        let other = [GpuSpec::parse("0000:00:05.0").expect("spec")];
        let e = discover(sysfs, &other, Some(DB)).expect_err("nvidia-bound");
        assert!(
            e.to_string().contains("bound to nvidia, not vfio-pci"),
            "{e}"
        );
        let missing = [GpuSpec::parse("0000:ff:1f.7").expect("spec")];
        let e = discover(sysfs, &missing, None).expect_err("missing");
        assert!(
            e.to_string()
                .starts_with("--gpu 0000:ff:1f.7: no PCI device"),
            "{e}"
        );
    }
}
