//! Post-restore fixups: wall clock, RNG seed, identity (hostname, machine id).

use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::path::Path;

use rollbox_agent_protocol::{ErrorInfo, ServerMessage};

use crate::errors::{sys, SysError};

/// _IOW('R', 0x03, int[2])
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// _IO('R', 0x07)
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
const MAX_SEED_BYTES: usize = 4096;

fn applied(applied: bool, detail: impl Into<String>) -> ServerMessage {
    ServerMessage::Applied {
        applied,
        detail: detail.into(),
    }
}

/// Sets the wall clock, unless `set_clock` is off (`--no-set-clock`): then it says so.
pub fn set_time(
    set_clock: bool,
    unix_seconds: i64,
    nanos: u32,
) -> Result<ServerMessage, ErrorInfo> {
    if nanos >= 1_000_000_000 {
        return Err(ErrorInfo::bad_request(format!(
            "set_time: nanos {nanos} is not below 1000000000"
        )));
    }
    if unix_seconds < 0 {
        return Err(ErrorInfo::bad_request(format!(
            "set_time: unix_seconds {unix_seconds} is before 1970"
        )));
    }
    if !set_clock {
        return Ok(applied(
            false,
            format!(
                "clock not set to {unix_seconds}.{nanos:09}: the agent runs with --no-set-clock"
            ),
        ));
    }
    let time = libc::timespec {
        tv_sec: unix_seconds,
        tv_nsec: i64::from(nanos),
    };
    // SAFETY: time is a valid timespec on the stack.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        return Err(SysError::new(
            "clock_settime",
            "CLOCK_REALTIME",
            std::io::Error::last_os_error(),
        )
        .to_info());
    }
    Ok(applied(
        true,
        format!("CLOCK_REALTIME set to {unix_seconds}.{nanos:09}"),
    ))
}

/// How long other processes get between SIGTERM and SIGKILL at power-off.
const POWER_OFF_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
/// Lets the answer leave before the machine goes.
const POWER_OFF_DELAY: std::time::Duration = std::time::Duration::from_millis(200);

/// Powers off (or reboots) the machine the agent is init of, on a thread of its own after
/// the answer went out: SIGTERM to every other process, SIGKILL after a grace period, sync,
/// then reboot(2).
pub fn power_off(is_init: bool, reboot: bool) -> Result<ServerMessage, ErrorInfo> {
    let what = if reboot { "reboot" } else { "power_off" };
    if !is_init {
        return Err(ErrorInfo::bad_request(format!(
            "{what}: the agent is not PID 1, so there is no machine of its own to end"
        )));
    }
    std::thread::Builder::new()
        .name(what.into())
        .spawn(move || {
            std::thread::sleep(POWER_OFF_DELAY);
            // SAFETY: kill(-1) signals every process but init (us); sync and reboot take no
            // pointers. reboot only returns on failure.
            unsafe {
                libc::kill(-1, libc::SIGTERM);
                std::thread::sleep(POWER_OFF_GRACE);
                libc::kill(-1, libc::SIGKILL);
                libc::sync();
                let cmd = if reboot {
                    libc::RB_AUTOBOOT
                } else {
                    libc::RB_POWER_OFF
                };
                libc::reboot(cmd);
            }
            log::error!(
                "{what}: reboot(2) failed: {}",
                std::io::Error::last_os_error()
            );
        })
        .map_err(|e| sys("spawn", what)(e).to_info())?;
    Ok(applied(
        true,
        format!("{what} in {} ms", POWER_OFF_DELAY.as_millis()),
    ))
}

/// Mixes `seed` into the kernel RNG crediting 8 bits a byte, then reseeds the CRNG at once.
pub fn reseed(seed: &[u8]) -> Result<ServerMessage, ErrorInfo> {
    check_seed("reseed", seed)?;
    let bits = seed.len() * 8;
    let reseeded = add_entropy_and_reseed(seed, bits)?;
    Ok(applied(
        true,
        format!(
            "mixed {} seed bytes into the kernel RNG ({bits} bits credited); {}",
            seed.len(),
            if reseeded {
                "reseeded the CRNG"
            } else {
                "the CRNG is not initialized yet and takes the seed when it is"
            }
        ),
    ))
}

/// Mixes `seed` into the kernel RNG crediting no entropy, then has the CRNG
/// reseed itself at once (RNDRESEEDCRNG) instead of at its next interval.
pub fn reseed_crng(seed: &[u8]) -> Result<(), ErrorInfo> {
    check_seed("reseed_crng", seed)?;
    add_entropy_and_reseed(seed, 0).map(|_| ())
}

/// RNDADDENTROPY crediting `bits`, then RNDRESEEDCRNG.
/// RNDADDENTROPY crediting `bits`, then RNDRESEEDCRNG. Returns false when the CRNG is not
/// initialized yet (ENODATA): then there is nothing to reseed, and the kernel seeds it from
/// the pool, which holds `seed`, once it has enough entropy.
fn add_entropy_and_reseed(seed: &[u8], bits: usize) -> Result<bool, ErrorInfo> {
    let random = open_random()?;
    add_entropy(&random, seed, bits)?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENODATA) {
            return Ok(false);
        }
        return Err(SysError::new("ioctl RNDRESEEDCRNG", "/dev/random", err).to_info());
    }
    Ok(true)
}

fn check_seed(op: &str, seed: &[u8]) -> Result<(), ErrorInfo> {
    if seed.is_empty() || seed.len() > MAX_SEED_BYTES {
        return Err(ErrorInfo::bad_request(format!(
            "{op}: seed of {} bytes; expected 1 to {MAX_SEED_BYTES}",
            seed.len()
        )));
    }
    Ok(())
}

fn open_random() -> Result<std::fs::File, ErrorInfo> {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")
        .map_err(|e| sys("open", "/dev/random")(e).to_info())
}

/// RNDADDENTROPY: mix `seed` (at most MAX_SEED_BYTES) into the pool, crediting `bits`.
fn add_entropy(random: &std::fs::File, seed: &[u8], bits: usize) -> Result<(), ErrorInfo> {
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let too_large = |_| ErrorInfo::bad_request("reseed: seed too large");
    let bits = i32::try_from(bits).map_err(too_large)?;
    let size = i32::try_from(seed.len()).map_err(too_large)?;
    let mut words = vec![0u32; 2 + seed.len().div_ceil(4)];
    words[0] = bits as u32;
    words[1] = size as u32;
    // SAFETY: the u32 buffer is at least 8 + seed.len() bytes long; viewing it as bytes is always valid.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4) };
    bytes[8..8 + seed.len()].copy_from_slice(seed);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of the size it declares, which `words` holds.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, words.as_ptr()) } != 0 {
        return Err(SysError::new(
            "ioctl RNDADDENTROPY",
            "/dev/random",
            std::io::Error::last_os_error(),
        )
        .to_info());
    }
    Ok(())
}

pub fn set_identity(
    machine_id_path: &Path,
    hostname: Option<&str>,
    machine_id: Option<&str>,
) -> Result<ServerMessage, ErrorInfo> {
    if hostname.is_none() && machine_id.is_none() {
        return Err(ErrorInfo::bad_request(
            "set_identity: give a hostname, a machine_id or both",
        ));
    }
    if let Some(name) = hostname {
        validate_hostname(name)?;
    }
    let machine_id = machine_id.map(validate_machine_id).transpose()?;
    let mut done = Vec::new();
    if let Some(name) = hostname {
        // SAFETY: the pointer and length describe `name`'s bytes.
        if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
            return Err(
                SysError::new("sethostname", name, std::io::Error::last_os_error()).to_info(),
            );
        }
        done.push(format!("hostname {name}"));
    }
    if let Some(id) = machine_id {
        write_atomic(machine_id_path, format!("{id}\n").as_bytes()).map_err(|e| e.to_info())?;
        done.push(format!("machine id {id} in {}", machine_id_path.display()));
    }
    Ok(applied(true, format!("set {}", done.join(", "))))
}

pub fn validate_hostname(name: &str) -> Result<(), ErrorInfo> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['-', '.'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(ErrorInfo::bad_request(format!(
            "set_identity: hostname {name:?} must be 1-64 of [A-Za-z0-9.-], not starting with - or ."
        )))
    }
}

fn validate_machine_id(id: &str) -> Result<String, ErrorInfo> {
    let id = id.trim().to_ascii_lowercase();
    if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) && id.bytes().any(|b| b != b'0')
    {
        Ok(id)
    } else {
        Err(ErrorInfo::bad_request(format!(
            "set_identity: machine_id {id:?} must be 32 hex digits, not all zero"
        )))
    }
}

/// Write a small file by temp file + fsync + rename.
fn write_atomic(path: &Path, data: &[u8]) -> Result<(), SysError> {
    let text = path.display().to_string();
    let dir = path.parent().unwrap_or(Path::new("/"));
    let temp = dir.join(format!(
        ".{}.rollbox-tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    let temp_text = temp.display().to_string();
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)
            .map_err(sys("open", &temp_text))?;
        file.write_all(data).map_err(sys("write", &temp_text))?;
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o444))
            .map_err(sys("chmod", &temp_text))?;
        file.sync_all().map_err(sys("fsync", &temp_text))?;
        std::fs::rename(&temp, path).map_err(sys("rename", &text))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_and_machine_ids_are_validated() {
        assert!(validate_hostname("sandbox-7.rl").is_ok());
        assert!(validate_hostname("").is_err());
        assert!(validate_hostname("-x").is_err());
        assert!(validate_hostname("a b").is_err());
        assert!(validate_hostname(&"a".repeat(65)).is_err());
        assert_eq!(
            validate_machine_id("0123456789ABCDEF0123456789abcdef").expect("ok"),
            "0123456789abcdef0123456789abcdef"
        );
        assert!(validate_machine_id("00000000000000000000000000000000").is_err());
        assert!(validate_machine_id("xyz").is_err());
    }

    #[test]
    fn power_off_needs_the_agent_to_be_init() {
        let err = power_off(false, false).expect_err("not PID 1");
        assert!(err.message.contains("not PID 1"), "{}", err.message);
    }

    #[test]
    fn seed_size_is_checked() {
        assert!(reseed(&[]).is_err());
        assert!(reseed(&vec![1u8; MAX_SEED_BYTES + 1]).is_err());
        assert!(reseed_crng(&[]).is_err());
    }
}
