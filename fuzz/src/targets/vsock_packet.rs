//! The vsock muxer (the host side of virtio-vsock): guest packets as the TX queue hands them
//! over, host connections sending their `CONNECT <port>` line, and RX drained in between.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};

use vmm::devices::virtio::vsock::{PacketHeader, UnixMuxer, HEADER_LEN};

use super::signature::shape;

/// Records: kind byte, then for a guest packet (kind % 8 < 6) a 44-byte header, a length
/// byte and the payload; for a host connection (6) a length byte and the line; 7 drains RX.
pub fn run(data: &[u8]) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("rollbox-fuzz-vsock-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("m{}.sock", NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_file(&path);
    let mut muxer =
        UnixMuxer::new(3, &path).unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", path.display()));
    let mut hosts = Vec::new();
    let mut seen = String::new();
    let mut rest = data;
    while let [kind, tail @ ..] = rest {
        rest = tail;
        match kind % 8 {
            0..=5 => {
                let Some((header, tail)) = rest.split_first_chunk::<HEADER_LEN>() else {
                    break;
                };
                let (len, tail) = tail.split_first().map_or((0, tail), |(l, t)| (*l, t));
                let n = usize::from(len).min(tail.len());
                let (payload, tail) = tail.split_at(n);
                rest = tail;
                muxer.handle_guest_packet(&PacketHeader::from_bytes(header), payload);
            }
            6 => {
                let (len, tail) = rest.split_first().map_or((0, rest), |(l, t)| (*l, t));
                let n = usize::from(len).min(tail.len());
                let (line, tail) = tail.split_at(n);
                rest = tail;
                if let Ok(mut stream) = UnixStream::connect(&path) {
                    let _ = stream.write_all(line);
                    hosts.push(stream);
                }
                muxer.process_events();
            }
            _ => {
                let max = rest.first().map_or(0, |b| usize::from(*b) * 16);
                rest = rest.get(1..).unwrap_or_default();
                while let Some((header, payload)) = muxer.next_rx(max) {
                    assert!(payload.len() <= max, "next_rx gave more than asked");
                    seen.push_str(&format!("{}/{};", header.op, payload.len()));
                }
            }
        }
    }
    muxer.process_events();
    for _ in 0..64 {
        let Some((header, _)) = muxer.next_rx(4096) else {
            break;
        };
        seen.push_str(&format!("{}:{};", header.op, header.flags));
    }
    drop(muxer);
    drop(hosts);
    let _ = std::fs::remove_file(&path);
    shape(&seen)
}

fn header(op: u16, src_port: u32, dst_port: u32, len: u32, flags: u32) -> Vec<u8> {
    let h = PacketHeader {
        src_cid: 3,
        dst_cid: 2,
        src_port,
        dst_port,
        len,
        type_: 1,
        op,
        flags,
        buf_alloc: 65536,
        fwd_cnt: 0,
    };
    h.to_bytes().to_vec()
}

fn packet(op: u16, src_port: u32, dst_port: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend(header(op, src_port, dst_port, payload.len() as u32, 0));
    out.push(payload.len() as u8);
    out.extend_from_slice(payload);
    out
}

fn host_line(line: &[u8]) -> Vec<u8> {
    let mut out = vec![6u8, line.len() as u8];
    out.extend_from_slice(line);
    out
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let drain = vec![7u8, 255];
    let mut seeds = Vec::new();
    // A host connection: CONNECT, the guest answers RESPONSE, data both ways, shutdown.
    let mut s = host_line(b"CONNECT 52\n");
    s.extend(&drain);
    s.extend(packet(2, 52, 1_000_000_000, b""));
    s.extend(packet(5, 52, 1_000_000_000, b"hello"));
    s.extend(packet(6, 52, 1_000_000_000, b""));
    s.extend(packet(4, 52, 1_000_000_000, b""));
    s.extend(&drain);
    seeds.push(("host-connect".to_string(), s));
    // A guest connection to a host port nobody listens on, then RW and RST.
    let mut s = packet(1, 1024, 5000, b"");
    s.extend(&drain);
    s.extend(packet(5, 1024, 5000, b"data"));
    s.extend(packet(7, 1024, 5000, b""));
    s.extend(packet(3, 1024, 5000, b""));
    s.extend(&drain);
    seeds.push(("guest-connect".to_string(), s));
    seeds.push((
        "bad-connect-line".to_string(),
        host_line(b"CONNECT nope\r\n"),
    ));
    seeds
}
