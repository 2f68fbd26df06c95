//! Reading a process's memory figures from `/proc/PID/smaps` and `/proc/PID/status`, and CPU
//! time from `/proc/stat` and `/proc/PID/stat`.

/// One mapping of `/proc/PID/smaps`: its size, whether it is anonymous, its Rss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub size_bytes: u64,
    pub anonymous: bool,
    pub rss_kib: u64,
}

/// Parses the text of `/proc/PID/smaps`. Lines it does not understand are skipped.
pub fn parse_smaps(text: &str) -> Vec<Mapping> {
    let mut mappings: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        if let Some(mapping) = parse_header(line) {
            mappings.push(mapping);
        } else if let Some(kib) = field_kib(line, "Rss:") {
            if let Some(last) = mappings.last_mut() {
                last.rss_kib = kib;
            }
        }
    }
    mappings
}

/// `7fb914a00000-7fb924a00000 rw-p 00000000 00:00 0   [path]`.
fn parse_header(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    if perms.len() != 4 {
        return None;
    }
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let inode: u64 = fields.next()?.parse().ok()?;
    let path = fields.next();
    Some(Mapping {
        start,
        size_bytes: end.checked_sub(start)?,
        anonymous: inode == 0 && path.is_none_or(|p| p.starts_with("[anon")),
        rss_kib: 0,
    })
}

/// The value of a `Name:   1234 kB` line, if `line` is that field.
pub fn field_kib(line: &str, name: &str) -> Option<u64> {
    let rest = line.strip_prefix(name)?;
    let mut words = rest.split_whitespace();
    let value = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(value)
}

/// `VmRSS` from the text of `/proc/PID/status`.
pub fn vm_rss_kib(status: &str) -> Option<u64> {
    status.lines().find_map(|l| field_kib(l, "VmRSS:"))
}

/// The Rss of the anonymous mappings exactly `size_bytes` long: guest memory. `None`
/// when there is none.
pub fn guest_memory_rss_kib(mappings: &[Mapping], size_bytes: u64) -> Option<u64> {
    let matching: Vec<&Mapping> = mappings
        .iter()
        .filter(|m| m.anonymous && m.size_bytes == size_bytes)
        .collect();
    (!matching.is_empty()).then(|| matching.iter().map(|m| m.rss_kib).sum())
}

/// Clock ticks the machine's CPUs spent busy (all but idle and iowait), from the text of
/// `/proc/stat`.
pub fn busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy: u64 = values
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    Some(busy)
}

/// The sum of two numeric fields of `/proc/PID/stat`'s text, by their numbers in proc(5).
fn stat_fields_sum(stat: &str, first: usize, second: usize) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: field 3 starts after the
    // last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |number: usize| -> Option<u64> { fields.get(number.checked_sub(3)?)?.parse().ok() };
    Some(field(first)? + field(second)?)
}

/// A process's user + system clock ticks (utime and stime, fields 14 and 15), from the text
/// of `/proc/PID/stat`.
pub fn process_ticks(stat: &str) -> Option<u64> {
    stat_fields_sum(stat, 14, 15)
}

/// The user + system clock ticks of a process's children it has waited for (and theirs:
/// cutime and cstime, fields 16 and 17), from the text of `/proc/PID/stat`.
pub fn children_ticks(stat: &str) -> Option<u64> {
    stat_fields_sum(stat, 16, 17)
}

/// Milliseconds per clock tick (USER_HZ).
pub fn ms_per_tick() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        1000.0 / hz as f64
    } else {
        10.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_ticks_leave_out_idle_and_iowait() {
        let stat = "cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 50 2 25 500 10 1 1 0 0 0\n";
        assert_eq!(busy_ticks(stat), Some(100 + 5 + 50 + 3 + 2 + 1));
        assert_eq!(busy_ticks("intr 1 2 3\n"), None);
    }

    #[test]
    fn process_ticks_read_past_a_name_with_spaces() {
        let stat = "42 (rollbox (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 70 30 0 0 20 0 3 0 5";
        assert_eq!(process_ticks(stat), Some(100));
        assert_eq!(children_ticks(stat), Some(0));
        assert_eq!(process_ticks("42 (cut"), None);
        let waited = "7 (d) S 1 7 7 0 -1 0 0 0 0 0 10 20 300 400 20 0 3 0 5";
        assert_eq!(children_ticks(waited), Some(700));
    }

    const SMAPS: &str = "\
55d0c0a00000-55d0c0b00000 r-xp 00000000 08:01 1234   /work/main/target/release/rollbox-vmm
Size:               1024 kB
Rss:                 900 kB
7fb914a00000-7fb924a00000 rw-p 00000000 00:00 0 
Size:             262144 kB
KernelPageSize:        4 kB
Rss:                 348 kB
Pss:                 348 kB
7fb924a00000-7fb924a21000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                  12 kB
VmFlags: rd wr mr mw me ac
";

    #[test]
    fn smaps_headers_and_rss() {
        let maps = parse_smaps(SMAPS);
        assert_eq!(maps.len(), 3);
        assert!(!maps[0].anonymous);
        assert_eq!(maps[1].size_bytes, 256 << 20);
        assert!(maps[1].anonymous);
        assert_eq!(maps[1].rss_kib, 348);
        assert!(
            !maps[2].anonymous,
            "[heap] is not the guest's anonymous mapping"
        );
        assert_eq!(guest_memory_rss_kib(&maps, 256 << 20), Some(348));
        assert_eq!(guest_memory_rss_kib(&maps, 128 << 20), None);
    }

    #[test]
    fn status_vm_rss() {
        assert_eq!(vm_rss_kib("Name:\tx\nVmRSS:\t    5012 kB\n"), Some(5012));
        assert_eq!(vm_rss_kib("VmRSS: lots\n"), None);
        assert_eq!(field_kib("Rss: 12 kB", "Rss:"), Some(12));
        assert_eq!(field_kib("Rss: 12", "Rss:"), None);
    }
}
