//! `rollbox-bench networks`: networks per sandbox through a real `rollbox serve` with
//! test-guest sandboxes: create latency (booted) without a network, with egress `none` and
//! with egress `all` (a tap, a /30, NAT and an nftables egress chain each, the tap handed to
//! the jailed VMM), delete latency with a network, and a live policy change (`PATCH
//! /sandboxes/{id}/network`, one nftables transaction). Figures only, never a verdict. Needs
//! root, /dev/net/tun and nft; the daemon's default pool (10.200.0.0/16) and lease directory.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use crate::daemon::{delete, ms, p99, start, summary, DaemonBenchConfig, DaemonBenchError};
use crate::stats::Summary;
use crate::test_guest::TEST_GUEST_CMDLINE;

/// What to run.
pub struct NetworksBenchConfig {
    pub rollbox: PathBuf,
    pub vmm: PathBuf,
    pub guest: PathBuf,
    pub dir: PathBuf,
    /// Creates (and deletes) per row.
    pub creates: usize,
}

/// One row: creates with this network (None: none), their deletes.
#[derive(Debug, Serialize)]
pub struct NetworkFigure {
    /// `none`, `all`, or absent (no network interface).
    pub egress: Option<String>,
    pub create_ms: Summary,
    pub create_p99_ms: f64,
    pub delete_ms: Summary,
}

/// Everything measured.
#[derive(Debug, Serialize)]
pub struct NetworksReport {
    pub rows: Vec<NetworkFigure>,
    /// PATCH /sandboxes/{id}/network, alternating `all` and `none`.
    pub patch_ms: Summary,
}

fn daemon_config(config: &NetworksBenchConfig) -> DaemonBenchConfig {
    DaemonBenchConfig::for_other_bench(
        config.rollbox.clone(),
        config.vmm.clone(),
        config.guest.clone(),
        config.dir.clone(),
        None,
    )
}

pub fn run(config: &NetworksBenchConfig) -> Result<NetworksReport, DaemonBenchError> {
    let daemon = start(&daemon_config(config))?;
    daemon.expect(
        "POST",
        "/templates",
        Some(json!({"name": "plain", "kernel": config.guest, "cmdline": TEST_GUEST_CMDLINE, "memory_mib": 32})),
        201,
    )?;
    let mut rows = Vec::new();
    for egress in [None, Some("none"), Some("all")] {
        eprintln!(
            "networks: {} creates {}",
            config.creates,
            egress.map_or("without a network".to_string(), |e| format!(
                "with egress {e}"
            ))
        );
        let (mut creates, mut deletes) = (Vec::new(), Vec::new());
        for _ in 0..config.creates.max(1) {
            let mut body = json!({"template": "plain", "ttl_s": 600});
            if let Some(egress) = egress {
                body["network"] = json!({ "egress": egress });
            }
            let started = Instant::now();
            let sandbox = daemon.expect("POST", "/sandboxes", Some(body), 201)?;
            creates.push(ms(started));
            let id = sandbox["id"].as_str().unwrap_or_default().to_string();
            deletes.push(delete(&daemon, &id)?);
        }
        rows.push(NetworkFigure {
            egress: egress.map(str::to_string),
            create_p99_ms: p99(&creates),
            create_ms: summary(&creates, "creates")?,
            delete_ms: summary(&deletes, "deletes")?,
        });
    }
    eprintln!("networks: {} policy changes", config.creates);
    let sandbox = daemon.expect(
        "POST",
        "/sandboxes",
        Some(json!({"template": "plain", "ttl_s": 600, "network": {"egress": "none"}})),
        201,
    )?;
    let id = sandbox["id"].as_str().unwrap_or_default().to_string();
    let mut patches = Vec::new();
    for i in 0..config.creates.max(1) {
        let egress = if i % 2 == 0 { "all" } else { "none" };
        let started = Instant::now();
        daemon.expect(
            "PATCH",
            &format!("/sandboxes/{id}/network"),
            Some(json!({ "egress": egress })),
            200,
        )?;
        patches.push(ms(started));
    }
    delete(&daemon, &id)?;
    Ok(NetworksReport {
        rows,
        patch_ms: summary(&patches, "policy changes")?,
    })
}

pub fn markdown(report: &NetworksReport) -> String {
    let mut out = String::from(
        "## rollbox-bench networks (test guest, 32 MiB, jailed, booted creates)\n\n\
         | network | create p50 ms | create p99 ms | delete p50 ms |\n| --- | ---: | ---: | ---: |\n",
    );
    for row in &report.rows {
        out.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.1} |\n",
            row.egress
                .as_deref()
                .map_or("none (no interface)".to_string(), |e| format!("egress {e}")),
            row.create_ms.p50,
            row.create_p99_ms,
            row.delete_ms.p50
        ));
    }
    out.push_str(&format!(
        "\nPATCH /sandboxes/{{id}}/network (one nftables transaction): p50 {:.1} ms\n",
        report.patch_ms.p50
    ));
    out
}
