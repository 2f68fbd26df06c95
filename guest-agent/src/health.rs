//! Health and simple metrics from /proc and statvfs.

use rollbox_agent_protocol::{DiskInfo, ErrorInfo, Health, MemoryInfo, PROTOCOL_VERSION};

use crate::agent::Agent;
use crate::errors::{sys, SysError};

pub fn health(agent: &Agent) -> Result<Health, ErrorInfo> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| sys("read", "/proc/meminfo")(e).to_info())?;
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .map_err(|e| sys("read", "/proc/loadavg")(e).to_info())?;
    let uptime = std::fs::read_to_string("/proc/uptime")
        .map_err(|e| sys("read", "/proc/uptime")(e).to_info())?;
    let generation = agent.generation.as_ref().map(|w| w.status());
    Ok(Health {
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        protocol_version: PROTOCOL_VERSION,
        pid: std::process::id(),
        is_init: agent.config.is_init,
        uptime_seconds: first_number(&uptime),
        load: parse_loadavg(&loadavg),
        memory: parse_meminfo(&meminfo),
        disk: statvfs("/").map_err(|e| e.to_info())?,
        running_processes: crate::reaper::reaper().running() as u64,
        generation: generation.map(|g| g.generation),
        generation_applied: generation.and_then(|g| g.applied),
    })
}

fn first_number(text: &str) -> f64 {
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

pub fn parse_loadavg(text: &str) -> [f64; 3] {
    let mut fields = text
        .split_whitespace()
        .map(|v| v.parse::<f64>().unwrap_or(0.0));
    [
        fields.next().unwrap_or(0.0),
        fields.next().unwrap_or(0.0),
        fields.next().unwrap_or(0.0),
    ]
}

pub fn parse_meminfo(text: &str) -> MemoryInfo {
    let kib = |key: &str| -> u64 {
        text.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    MemoryInfo {
        total_bytes: kib("MemTotal"),
        free_bytes: kib("MemFree"),
        available_bytes: kib("MemAvailable"),
    }
}

fn statvfs(path: &str) -> Result<DiskInfo, SysError> {
    let c_path = std::ffi::CString::new(path).map_err(|_| {
        SysError::new(
            "statvfs",
            path,
            std::io::Error::from_raw_os_error(libc::EINVAL),
        )
    })?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is NUL-terminated and stats is a valid, writable struct.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stats) } != 0 {
        return Err(SysError::new(
            "statvfs",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    let block = stats.f_frsize;
    Ok(DiskInfo {
        total_bytes: stats.f_blocks * block,
        free_bytes: stats.f_bfree * block,
        available_bytes: stats.f_bavail * block,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_loadavg_parse() {
        let mem = parse_meminfo(
            "MemTotal:       1000 kB\nMemFree:         200 kB\nMemAvailable:    500 kB\n",
        );
        assert_eq!(
            mem,
            MemoryInfo {
                total_bytes: 1_024_000,
                free_bytes: 204_800,
                available_bytes: 512_000
            }
        );
        assert_eq!(
            parse_loadavg("0.50 1.00 2.25 1/123 456\n"),
            [0.5, 1.0, 2.25]
        );
    }

    #[test]
    fn statvfs_of_root_works() {
        let disk = statvfs("/").expect("statvfs /");
        assert!(disk.total_bytes > 0 && disk.total_bytes >= disk.free_bytes);
    }
}
