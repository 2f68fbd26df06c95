//! The CPU time of a VMM's processes (the VMM, or the jailer and the jailed VMM under it), as
//! /proc counts it.

fn clock_ticks() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100)
}

/// utime + stime of process `pid` (if it is still the one started at `start`), in ms.
pub fn cpu_ms(pid: u32, start: u64) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3; utime is field 14, stime 15, starttime 22.
    if fields.get(19)?.parse::<u64>().ok()? != start {
        return None;
    }
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // A jailed VMM is a grandchild of the jailer (the sandbox's pid): its time counts too.
    let descendants: u64 = children(pid).into_iter().map(tree_ticks).sum();
    Some((ticks + descendants) * 1000 / clock_ticks())
}

/// The children of `pid` (empty where the kernel does not list them).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// utime + stime of `pid` and its descendants, in clock ticks.
fn tree_ticks(pid: u32) -> u64 {
    let own = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let rest = stat.get(stat.rfind(')')? + 1..)?.to_string();
            let fields: Vec<&str> = rest.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    own + children(pid).into_iter().map(tree_ticks).sum::<u64>()
}
