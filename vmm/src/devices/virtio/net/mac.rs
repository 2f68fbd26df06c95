//! The guest's MAC address, as the device reports it in its config space.

/// A MAC that does not parse or is not a unicast address.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("guest_mac {0:?} is invalid: expected a unicast MAC like 06:00:ac:10:00:02")]
pub struct MacError(pub String);

/// Parses `aa:bb:cc:dd:ee:ff` into a unicast MAC.
pub fn parse_mac(text: &str) -> Result<[u8; 6], MacError> {
    let err = || MacError(text.into());
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(err)?;
        if part.len() != 2 {
            return Err(err());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| err())?;
    }
    if parts.next().is_some() || mac[0] & 1 != 0 || mac == [0; 6] {
        return Err(err());
    }
    Ok(mac)
}
