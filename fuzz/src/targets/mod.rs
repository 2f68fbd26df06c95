//! One target per parser that a guest or a client can reach.

mod agent;
mod api;
mod devices;
mod dns;
mod layer;
mod scratch;
mod signature;
mod snapshot_archive;
mod snapshot_state;
mod vsock_packet;

/// A fuzz target.
pub struct Target {
    /// Its name on the command line and in `fuzz/corpus/<name>`.
    pub name: &'static str,
    /// One line on what it feeds where.
    pub about: &'static str,
    /// Runs one input; returns a signature of the outcome (which error, which device state),
    /// so that inputs with new outcomes become mutation bases.
    pub run: fn(&[u8]) -> u64,
    /// Well-formed inputs to start from (name, bytes), written by `rollbox-fuzz seeds`.
    pub seeds: fn() -> Vec<(String, Vec<u8>)>,
    /// `Some(reason)` when this host cannot run the target.
    pub available: fn() -> Option<String>,
    /// Longest input the mutator makes.
    pub max_len: usize,
}

fn always() -> Option<String> {
    None
}

/// Every target.
pub const ALL: &[Target] = &[
    Target {
        name: "chain",
        about: "the shared descriptor-chain validator (fs, net and any device's rules) on a queue in guest memory",
        run: devices::run_chain,
        seeds: devices::seeds_chain,
        available: always,
        max_len: devices::INPUT_MAX,
    },
    Target {
        name: "block",
        about: "virtio-blk requests: descriptor chains in guest memory, served through the MMIO transport",
        run: devices::run_block,
        seeds: devices::seeds_block,
        available: always,
        max_len: devices::INPUT_MAX,
    },
    Target {
        name: "vsock",
        about: "virtio-vsock TX/RX/event queues: chains and packets in guest memory, through the MMIO transport",
        run: devices::run_vsock,
        seeds: devices::seeds_vsock,
        available: always,
        max_len: devices::INPUT_MAX,
    },
    Target {
        name: "net",
        about: "virtio-net TX/RX chains in guest memory on a real tap (root and /dev/net/tun)",
        run: devices::run_net,
        seeds: devices::seeds_net,
        available: devices::net_available,
        max_len: devices::INPUT_MAX,
    },
    Target {
        name: "mmio",
        about: "sequences of virtio-mmio register reads and writes (block and vsock devices)",
        run: devices::run_mmio,
        seeds: devices::seeds_mmio,
        available: always,
        max_len: devices::INPUT_MAX,
    },
    Target {
        name: "vsock_packet",
        about: "the vsock muxer: guest packet headers and payloads, and host CONNECT lines",
        run: vsock_packet::run,
        seeds: vsock_packet::seeds,
        available: always,
        max_len: 4096,
    },
    Target {
        name: "vmm_api",
        about: "rollbox-vmm's HTTP/1.1 request reader and JSON action parser",
        run: api::run_vmm,
        seeds: api::seeds_vmm,
        available: always,
        max_len: 8192,
    },
    Target {
        name: "daemon_api",
        about: "the daemon's request parser (method, path, query, JSON body)",
        run: api::run_daemon,
        seeds: api::seeds_daemon,
        available: always,
        max_len: 8192,
    },
    Target {
        name: "snapshot_state",
        about: "the snapshot state file (header, CRC, CBOR MicroVmState) and memory-layer identity records",
        run: snapshot_state::run,
        seeds: snapshot_state::seeds,
        available: always,
        max_len: 16384,
    },
    Target {
        name: "agent_frame",
        about: "agent protocol frames (length prefix, JSON client and server frames) and the hybrid CONNECT handshake",
        run: agent::run,
        seeds: agent::seeds,
        available: always,
        max_len: 8192,
    },
    Target {
        name: "oci_layer",
        about: "OCI tar layers applied by the image builder into a scratch root",
        run: layer::run,
        seeds: layer::seeds,
        available: always,
        max_len: 32768,
    },
    Target {
        name: "dns",
        about: "the sandbox resolver's DNS reader: a guest's query and an upstream's answer (compression pointers)",
        run: dns::run,
        seeds: dns::seeds,
        available: always,
        max_len: 1024,
    },
    Target {
        name: "snapshot_archive",
        about: "snapshot archives a node imports (tar headers, GNU sparse maps and their extension blocks)",
        run: snapshot_archive::run,
        seeds: snapshot_archive::seeds,
        available: always,
        max_len: 32768,
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    fn run_seeds(target: &Target) {
        let seeds = (target.seeds)();
        assert!(!seeds.is_empty(), "{} has no seeds", target.name);
        for (name, bytes) in seeds {
            assert!(
                bytes.len() <= target.max_len,
                "{}/{name} is too long",
                target.name
            );
            (target.run)(&bytes);
        }
    }

    /// Every target's seeds run without a panic (net has its own test: it needs a tap).
    #[test]
    fn every_seed_runs_clean() {
        for target in ALL.iter().filter(|t| t.name != "net") {
            assert_eq!((target.available)(), None, "{}", target.name);
            run_seeds(target);
        }
    }

    #[test]
    fn net_seeds_run_clean() {
        let Some(net) = ALL.iter().find(|t| t.name == "net") else {
            panic!("no net target");
        };
        if let Some(reason) = (net.available)() {
            rollbox_tests::skip("targets::tests::net_seeds_run_clean", &reason);
            return;
        }
        run_seeds(net);
    }
}
