//! Usage: per-sandbox running time billed per second (vCPU-seconds, memory-MiB-seconds), the
//! VMM's measured CPU time, and the daemon's counters, for `GET /sandboxes/{id}/usage` and
//! `GET /metrics` (Prometheus text). Each sandbox's series has a `tenant` label (empty for
//! an admin key's sandboxes), so `sum by (tenant)` is a tenant's usage.
//!
//! The rule: a sandbox's running time counts from the moment its VMM runs (the create's
//! `running`) to its end, less the time it was paused; it is billed in whole seconds, rounded
//! up. vCPU-seconds = vCPUs × those seconds, memory-MiB-seconds = MiB × those seconds. The
//! accumulated milliseconds and the start of the current running stretch are in the
//! database, so a daemon restart loses nothing (and a VMM keeps counting while the daemon is
//! down).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use super::api::{ApiError, NodeInfo, NodeStatus, Reply, Usage, WarmPoolShape};
use super::store::{Db, UsageRow as Row};
use super::supervisor::cpu_ms;
use super::util::{internal, now_ms};

/// Ended sandboxes stay in `/metrics` this long, so a scrape sees their final counts.
const ENDED_IN_METRICS_MS: u64 = 10 * 60 * 1000;

/// Daemon counters since it started.
#[derive(Default)]
pub struct Counters {
    creates: AtomicU64,
    failures: AtomicU64,
    refused: AtomicU64,
}

impl Counters {
    /// A create inserted a new sandbox.
    pub fn created(&self) {
        self.creates.fetch_add(1, Ordering::Relaxed);
    }

    /// A create's VMM did not start.
    pub fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// A create was refused with 429.
    pub fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }
}

fn usage_of(row: &Row, now: u64) -> Usage {
    let running_ms = row.run_ms
        + row
            .running_since_ms
            .map_or(0, |since| now.saturating_sub(since));
    let running_s = running_ms.div_ceil(1000);
    let s = &row.sandbox;
    let live_cpu = match (s.state.is_live(), s.pid, s.pid_start_time) {
        (true, Some(pid), Some(start)) => cpu_ms(pid, start).unwrap_or(0),
        _ => 0,
    };
    Usage {
        sandbox: s.id.clone(),
        template: s.template.clone(),
        state: s.state,
        vcpus: s.vcpus,
        memory_mib: s.memory_mib,
        running_s,
        vcpu_seconds: running_s * u64::from(s.vcpus),
        memory_mib_seconds: running_s * u64::from(s.memory_mib),
        cpu_seconds: (row.cpu_ms + live_cpu) as f64 / 1000.0,
        ended_at_ms: s.ended_at_ms,
        tenant: s.tenant.clone(),
    }
}

/// A Prometheus label value, escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// GET /sandboxes/{id}/usage.
pub fn usage(db: &Db, id: &str) -> Result<Reply, ApiError> {
    let rows = db.lock().usage_rows(Some(id), 0).map_err(internal)?;
    let row = rows
        .first()
        .ok_or_else(|| ApiError::NotFound(format!("no sandbox {id}")))?;
    Ok(Reply::Usage(usage_of(row, now_ms())))
}

/// GET /metrics: Prometheus text format 0.0.4.
pub fn metrics(db: &Db, counters: &Counters, node: &NodeInfo) -> Result<Reply, ApiError> {
    let now = now_ms();
    let (rows, states) = {
        let store = db.lock();
        (
            store
                .usage_rows(None, now.saturating_sub(ENDED_IN_METRICS_MS))
                .map_err(internal)?,
            store.state_counts().map_err(internal)?,
        )
    };
    let mut out = String::new();
    let usages: Vec<Usage> = rows.iter().map(|r| usage_of(r, now)).collect();
    type Field = fn(&Usage) -> String;
    let series: [(&str, &str, Field); 4] = [
        (
            "rollbox_sandbox_running_seconds_total",
            "Whole seconds the sandbox ran, paused time not counted.",
            |u| u.running_s.to_string(),
        ),
        (
            "rollbox_sandbox_vcpu_seconds_total",
            "vCPUs times running seconds.",
            |u| u.vcpu_seconds.to_string(),
        ),
        (
            "rollbox_sandbox_memory_mib_seconds_total",
            "Memory MiB times running seconds.",
            |u| u.memory_mib_seconds.to_string(),
        ),
        (
            "rollbox_sandbox_cpu_seconds_total",
            "CPU time its VMM processes used (measured).",
            |u| u.cpu_seconds.to_string(),
        ),
    ];
    for (name, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for u in &usages {
            let _ = writeln!(
                out,
                "{name}{{sandbox=\"{}\",template=\"{}\",state=\"{}\",tenant=\"{}\"}} {}",
                label(&u.sandbox),
                label(&u.template),
                u.state.as_str(),
                label(u.tenant.as_deref().unwrap_or("")),
                value(u)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP rollbox_sandboxes Sandboxes in the database by state.\n# TYPE rollbox_sandboxes gauge"
    );
    for (state, count) in states {
        let _ = writeln!(
            out,
            "rollbox_sandboxes{{state=\"{}\"}} {count}",
            state.as_str()
        );
    }
    let totals: [(&str, &str, &AtomicU64); 3] = [
        (
            "rollbox_creates_total",
            "Creates that made a sandbox row, since the daemon started.",
            &counters.creates,
        ),
        (
            "rollbox_create_failures_total",
            "Creates whose VMM did not start, since the daemon started.",
            &counters.failures,
        ),
        (
            "rollbox_creates_refused_total",
            "Creates and batches refused with 429, since the daemon started.",
            &counters.refused,
        ),
    ];
    for (name, help, value) in totals {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
            value.load(Ordering::Relaxed)
        );
    }
    node_gauges(&mut out, node);
    Ok(Reply::Metrics(out))
}

/// One figure of a warm pool's shape.
type ShapeFigure = fn(&WarmPoolShape) -> u64;

/// GET /node's figures as gauges (a limit that is not set is not written).
fn node_gauges(out: &mut String, node: &NodeInfo) {
    let draining = u64::from(node.status == NodeStatus::Draining);
    let gauges: [(&str, &str, Option<u64>); 7] = [
        (
            "rollbox_node_draining",
            "1 while the node drains (takes no new sandboxes).",
            Some(draining),
        ),
        (
            "rollbox_node_slots_total",
            "--max-sandboxes.",
            node.slots.total,
        ),
        (
            "rollbox_node_slots_used",
            "Live sandboxes (creating, running, paused).",
            Some(node.slots.used),
        ),
        (
            "rollbox_node_slots_pending",
            "Sandboxes being created.",
            Some(node.slots.pending),
        ),
        (
            "rollbox_node_memory_budget_mib",
            "--memory-budget-mib.",
            node.memory_mib.budget,
        ),
        (
            "rollbox_node_memory_committed_mib",
            "Guest memory of the live sandboxes.",
            Some(node.memory_mib.committed),
        ),
        (
            "rollbox_node_memory_available_mib",
            "The host's MemAvailable.",
            Some(node.memory_mib.host_available),
        ),
    ];
    for (name, help, value) in gauges {
        if let Some(value) = value {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{node=\"{}\"}} {value}",
                label(&node.node_id)
            );
        }
    }
    if !node.warm_pool.is_empty() {
        let gauges: [(&str, &str, ShapeFigure); 2] = [
            (
                "rollbox_warm_shells_ready",
                "Warm VMM shells ready, by guest memory and template.",
                |shape| shape.ready,
            ),
            (
                "rollbox_warm_shells_target",
                "--warm-pool's shells, by guest memory and template.",
                |shape| shape.target,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for shape in &node.warm_pool {
                let template = shape
                    .template
                    .as_deref()
                    .map(|t| format!(",template=\"{}\"", label(t)))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "{name}{{node=\"{}\",memory_mib=\"{}\"{template}}} {}",
                    label(&node.node_id),
                    shape.memory_mib,
                    value(shape)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::{Sandbox, State};

    #[test]
    fn running_time_is_billed_in_whole_seconds_rounded_up() {
        let mut sandbox: Sandbox = serde_json::from_value(serde_json::json!({
            "id": "sb-1", "template": "t", "state": "paused", "vcpus": 2, "memory_mib": 64,
            "labels": {}, "metadata": {}, "idempotency_key": null, "created_at_ms": 0,
            "expires_at_ms": 1, "idle_ttl_s": null, "last_active_at_ms": 0, "pid": null,
            "pid_start_time": null, "dir": "/x", "ended_at_ms": null, "end_reason": null,
        }))
        .expect("sandbox");
        let paused = Row {
            sandbox: sandbox.clone(),
            run_ms: 2_001,
            running_since_ms: None,
            cpu_ms: 1_500,
        };
        let u = usage_of(&paused, 99_999);
        assert_eq!(
            (u.running_s, u.vcpu_seconds, u.memory_mib_seconds),
            (3, 6, 192)
        );
        assert_eq!(u.cpu_seconds, 1.5);
        sandbox.state = State::Running;
        let running = Row {
            sandbox,
            run_ms: 1_000,
            running_since_ms: Some(10_000),
            cpu_ms: 0,
        };
        assert_eq!(usage_of(&running, 12_000).running_s, 3);
        assert_eq!(label("a\"b\\c"), "a\\\"b\\\\c");
    }
}
