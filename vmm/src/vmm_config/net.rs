//! Network interfaces (`network-interfaces`): a host tap each, with an optional guest MAC; no
//! two share a tap or a MAC. The tap name and MAC rules are the net device's.

use vmm_api::NetworkInterfaceConfig;

use super::resources::VmResources;
use super::validate::{valid_id, ConfigError, Validate};
use crate::devices::virtio::net::tap::check_name;
use crate::devices::virtio::net::MacError;

/// Parses `aa:bb:cc:dd:ee:ff` into a unicast MAC.
pub fn parse_mac(text: &str) -> Result<[u8; 6], ConfigError> {
    crate::devices::virtio::net::parse_mac(text)
        .map_err(|MacError(text)| ConfigError::GuestMac(text))
}

/// The ID, tap name, MAC and unsupported options; a valid interface yields its parsed MAC.
impl Validate for NetworkInterfaceConfig {
    type Valid = Option<[u8; 6]>;

    fn validate(&self) -> Result<Option<[u8; 6]>, ConfigError> {
        if !valid_id(&self.iface_id) {
            return Err(ConfigError::IfaceId(self.iface_id.clone()));
        }
        if check_name(&self.host_dev_name).is_err() {
            return Err(ConfigError::HostDevName(self.host_dev_name.clone()));
        }
        if self.rx_rate_limiter.is_some() {
            return Err(ConfigError::Unsupported("rx_rate_limiter"));
        }
        if self.tx_rate_limiter.is_some() {
            return Err(ConfigError::Unsupported("tx_rate_limiter"));
        }
        self.guest_mac.as_deref().map(parse_mac).transpose()
    }
}

impl VmResources {
    /// Adds or replaces a network interface; no two share a tap or a MAC.
    pub fn upsert_net(&mut self, iface: NetworkInterfaceConfig) -> Result<(), ConfigError> {
        let mac = iface.validate()?;
        for other in self.net.iter().filter(|o| o.iface_id != iface.iface_id) {
            let clash = |what, value: String| ConfigError::NetClash {
                iface_id: iface.iface_id.clone(),
                what,
                value,
                other: other.iface_id.clone(),
            };
            if other.host_dev_name == iface.host_dev_name {
                return Err(clash("host_dev_name", iface.host_dev_name.clone()));
            }
            let other_mac = other.guest_mac.as_deref().map(parse_mac).transpose()?;
            if let (Some(a), Some(b)) = (mac, other_mac) {
                if a == b {
                    return Err(clash(
                        "guest_mac",
                        iface.guest_mac.clone().unwrap_or_default(),
                    ));
                }
            }
        }
        match self.net.iter_mut().find(|o| o.iface_id == iface.iface_id) {
            Some(existing) => *existing = iface,
            None => self.net.push(iface),
        }
        Ok(())
    }
}
