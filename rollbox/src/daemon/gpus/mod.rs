//! The GPUs service: the node's inventory (`inventory.rs`), and which sandbox holds which
//! device. A sandbox gets its devices exclusively, with every other device of the same IOMMU
//! group in the inventory; they are free again when it ends. The holders live in memory and
//! in each sandbox's row (`gpus`), from which a restarted daemon rebuilds them.

pub mod inventory;

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use super::api::{ApiError, Gpu, GpuRequest, Reply};

/// The node's GPUs and their holders.
pub struct Gpus {
    inventory: Vec<Gpu>,
    /// Device (BDF) to the sandbox holding it.
    holders: Mutex<HashMap<String, String>>,
}

impl Gpus {
    pub fn new(inventory: Vec<Gpu>) -> Gpus {
        Gpus {
            inventory,
            holders: Mutex::new(HashMap::new()),
        }
    }

    fn holders(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// GET /gpus: every device with its holder.
    pub fn list(&self) -> Reply {
        let holders = self.holders();
        Reply::Gpus(
            self.inventory
                .iter()
                .map(|gpu| Gpu {
                    holder: holders.get(&gpu.bdf).cloned(),
                    ..gpu.clone()
                })
                .collect(),
        )
    }

    fn matches(gpu: &Gpu, name: &str) -> bool {
        name == "any"
            || gpu.name.eq_ignore_ascii_case(name)
            || gpu.bdf == name
            || gpu
                .name
                .to_ascii_lowercase()
                .contains(&name.to_ascii_lowercase())
    }

    /// A create's check before anything is made: the node has that many devices of that
    /// name at all (in use or not).
    pub fn check(&self, request: &GpuRequest) -> Result<(), ApiError> {
        let have = self
            .inventory
            .iter()
            .filter(|gpu| Self::matches(gpu, &request.name))
            .count();
        if have >= request.count as usize {
            return Ok(());
        }
        let names: Vec<String> = self
            .inventory
            .iter()
            .map(|g| format!("{} ({})", g.bdf, g.name))
            .collect();
        Err(ApiError::BadRequest(format!(
            "gpu: this node has {have} GPU(s) matching {:?}, {} asked for; it has {}",
            request.name,
            request.count,
            if names.is_empty() {
                "none (rollbox serve --gpu BDF, or bind devices to vfio-pci)".to_string()
            } else {
                names.join(", ")
            }
        )))
    }

    /// Gives `sandbox` `request.count` free devices matching the request, each with the
    /// other inventory devices of its IOMMU group: the BDFs, or a 409 naming what is in use.
    pub fn claim(&self, sandbox: &str, request: &GpuRequest) -> Result<Vec<String>, ApiError> {
        self.check(request)?;
        let mut holders = self.holders();
        let mut taken: Vec<String> = Vec::new();
        let mut matched = 0;
        for gpu in &self.inventory {
            if matched == request.count as usize {
                break;
            }
            if !Self::matches(gpu, &request.name) || taken.contains(&gpu.bdf) {
                continue;
            }
            let group: Vec<&Gpu> = self
                .inventory
                .iter()
                .filter(|g| g.iommu_group == gpu.iommu_group)
                .collect();
            if group.iter().any(|g| holders.contains_key(&g.bdf)) {
                continue;
            }
            matched += 1;
            for member in group {
                if !taken.contains(&member.bdf) {
                    taken.push(member.bdf.clone());
                }
            }
        }
        if matched < request.count as usize {
            let busy: Vec<String> = self
                .inventory
                .iter()
                .filter(|g| Self::matches(g, &request.name))
                .filter_map(|g| {
                    holders
                        .get(&g.bdf)
                        .map(|h| format!("{} ({}) held by {h}", g.bdf, g.name))
                })
                .collect();
            return Err(ApiError::Conflict(format!(
                "gpu: no {} free GPU(s) matching {:?}: {}",
                request.count,
                request.name,
                busy.join(", ")
            )));
        }
        for bdf in &taken {
            holders.insert(bdf.clone(), sandbox.to_string());
        }
        Ok(taken)
    }

    /// [`Gpus::claim`], retried every 100 ms for `request.wait_s` while the devices are busy.
    pub async fn claim_waiting(
        &self,
        sandbox: &str,
        request: &GpuRequest,
    ) -> Result<Vec<String>, ApiError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(request.wait_s);
        loop {
            match self.claim(sandbox, request) {
                Err(ApiError::Conflict(message)) => {
                    if std::time::Instant::now() >= deadline {
                        return Err(ApiError::Conflict(if request.wait_s > 0 {
                            format!("{message} (waited gpu_wait_s={} s)", request.wait_s)
                        } else {
                            message
                        }));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                other => return other,
            }
        }
    }

    /// Frees what `sandbox` holds.
    pub fn release(&self, sandbox: &str) {
        self.holders().retain(|_, holder| holder != sandbox);
    }

    /// After a restart: a live sandbox holds the devices its row names (those still in the
    /// inventory; a device gone from it is logged).
    pub fn adopt(&self, sandbox: &str, bdfs: &[String]) {
        let mut holders = self.holders();
        for bdf in bdfs {
            if self.inventory.iter().any(|g| &g.bdf == bdf) {
                holders.insert(bdf.clone(), sandbox.to_string());
            } else {
                log::warn!("sandbox {sandbox} holds GPU {bdf}, which is no longer in this node's inventory");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(bdf: &str, name: &str, group: u32) -> Gpu {
        Gpu {
            bdf: bdf.into(),
            name: name.into(),
            vendor: "10de".into(),
            device: "2330".into(),
            iommu_group: group,
            holder: None,
        }
    }

    fn request(name: &str, count: u32) -> GpuRequest {
        GpuRequest {
            name: name.into(),
            count,
            wait_s: 0,
        }
    }

    #[test]
    fn claims_are_exclusive_by_iommu_group_and_released_with_the_sandbox() {
        let gpus = Gpus::new(vec![
            gpu("0000:01:00.0", "NVIDIA H100", 1),
            gpu("0000:01:00.1", "NVIDIA H100 audio", 1),
            gpu("0000:02:00.0", "NVIDIA H100", 2),
            gpu("0000:03:00.0", "NVIDIA A100", 3),
        ]);
        let first = gpus.claim("sb-a", &request("h100", 1)).expect("first");
        assert_eq!(first, ["0000:01:00.0", "0000:01:00.1"], "the whole group");
        let second = gpus.claim("sb-b", &request("H100", 1)).expect("second");
        assert_eq!(second, ["0000:02:00.0"]);
        let e = gpus
            .claim("sb-c", &request("H100", 1))
            .expect_err("none free");
        assert!(
            matches!(e, ApiError::Conflict(_)) && e.to_string().contains("held by sb-a"),
            "{e}"
        );
        let e = gpus
            .claim("sb-c", &request("H100", 4))
            .expect_err("too many");
        assert!(matches!(e, ApiError::BadRequest(_)), "{e}");
        let e = gpus
            .claim("sb-c", &request("MI300", 1))
            .expect_err("unknown");
        assert!(e.to_string().starts_with("gpu: this node has 0"), "{e}");
        gpus.release("sb-a");
        assert_eq!(
            gpus.claim("sb-c", &request("any", 1)).expect("freed")[0],
            "0000:01:00.0"
        );
        let Reply::Gpus(list) = gpus.list() else {
            panic!("a list")
        };
        let holders: Vec<Option<&str>> = list.iter().map(|g| g.holder.as_deref()).collect();
        assert_eq!(holders, [Some("sb-c"), Some("sb-c"), Some("sb-b"), None]);
        gpus.release("sb-c");
        gpus.adopt("sb-d", &["0000:03:00.0".into(), "0000:09:00.0".into()]);
        let e = gpus
            .claim("sb-e", &request("A100", 1))
            .expect_err("adopted");
        assert!(e.to_string().contains("held by sb-d"), "{e}");
    }
}
