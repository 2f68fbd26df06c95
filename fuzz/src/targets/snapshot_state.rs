//! Snapshot files: the state file (magic, version, length, CRC, then CBOR `MicroVmState`)
//! and the memory layers' identity records and dirty ranges.

use std::path::{Path, PathBuf};

use snapshot::format::{decode, FORMAT_VERSION, MAGIC};
use snapshot::memory::{apply_layer, open_layer, HostRegion, MemoryLayer};
use vmm::persist::MicroVmState;

use super::signature::shape;

const GUEST_LEN: u64 = 16 << 10;

/// The state-file image of `payload`: a valid header, so the CBOR decoder sees the input.
fn wrap(payload: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn scratch() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir()
            .unwrap_or_else(|e| panic!("fuzz rig: temporary directory: {e}"));
    }
    DIR.with(|d| d.path().to_path_buf())
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", path.display()));
}

/// Byte 0 picks what the rest is: 0 a state file, 1 a state file's CBOR payload, 2 a memory
/// file's identity side file, 3 an old-style identity trailer, 4 a diff layer's dirty ranges
/// (pairs of little-endian u64 offset and length).
pub fn run(data: &[u8]) -> u64 {
    let Some((&mode, rest)) = data.split_first() else {
        return 0;
    };
    let path = Path::new("fuzz.state");
    match mode % 5 {
        0 => shape(&format!("{:?}", decode::<MicroVmState>(path, rest).err())),
        1 => shape(&format!(
            "{:?}",
            decode::<MicroVmState>(path, &wrap(rest)).err()
        )),
        2 => {
            let mem = scratch().join("mem");
            write(&mem, &vec![0u8; GUEST_LEN as usize]);
            write(&snapshot::memory::id_path(&mem), rest);
            let layer = MemoryLayer {
                path: mem,
                id: 0x1234,
                dirty: None,
            };
            shape(&format!("{:?}", open_layer(&layer, GUEST_LEN).err()))
        }
        3 => {
            let mem = scratch().join("mem-trailer");
            let mut bytes = vec![0u8; GUEST_LEN as usize];
            let mut trailer = rest.to_vec();
            trailer.resize(snapshot::memory::TRAILER_LEN as usize, 0);
            bytes.extend_from_slice(&trailer);
            write(&mem, &bytes);
            let layer = MemoryLayer {
                path: mem,
                id: 0x1234,
                dirty: None,
            };
            shape(&format!("{:?}", open_layer(&layer, GUEST_LEN).err()))
        }
        _ => {
            let mem = scratch().join("mem-diff");
            write(&mem, &vec![0xa5u8; GUEST_LEN as usize]);
            let dirty: Vec<(u64, u64)> = rest
                .chunks_exact(16)
                .map(|c| {
                    let mut a = [0u8; 8];
                    let mut b = [0u8; 8];
                    a.copy_from_slice(&c[..8]);
                    b.copy_from_slice(&c[8..]);
                    (u64::from_le_bytes(a), u64::from_le_bytes(b))
                })
                .collect();
            let layer = MemoryLayer {
                path: mem.clone(),
                id: 1,
                dirty: Some(dirty),
            };
            // Two guest regions, as below and above a hole, back to back in the file.
            let mut host = vec![0u8; GUEST_LEN as usize];
            let half = GUEST_LEN / 2;
            let base = host.as_mut_ptr();
            let regions = [
                HostRegion {
                    host: base,
                    len: half,
                    file_offset: 0,
                },
                HostRegion {
                    // SAFETY: `half` is within `host`.
                    host: unsafe { base.add(half as usize) },
                    len: half,
                    file_offset: half,
                },
            ];
            let file = std::fs::File::open(&mem)
                .unwrap_or_else(|e| panic!("fuzz rig: {}: {e}", mem.display()));
            shape(&format!("{:?}", apply_layer(&layer, &file, &regions).err()))
        }
    }
}

fn cbor(value: &ciborium::Value) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).unwrap_or_else(|e| panic!("seed: {e}"));
    out
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use ciborium::Value;
    let text = |s: &str| Value::Text(s.into());
    let int = |n: u64| Value::Integer(n.into());
    let pair = |a: u64, b: u64| Value::Array(vec![int(a), int(b)]);
    let state = Value::Map(vec![
        (
            text("machine"),
            Value::Map(vec![
                (text("vcpu_count"), int(1)),
                (text("mem_size_mib"), int(128)),
            ]),
        ),
        (text("regions"), Value::Array(vec![pair(0, 128 << 20)])),
        (
            text("memory_layers"),
            Value::Array(vec![Value::Map(vec![
                (text("path"), text("mem")),
                (text("id"), int(7)),
                (text("dirty"), Value::Array(vec![pair(0, 4096)])),
            ])]),
        ),
        (text("devices"), Value::Array(vec![])),
        (text("generation"), int(1)),
    ]);
    let payload = cbor(&state);
    let mut with_header = vec![0u8];
    with_header.extend(wrap(&payload));
    let mut cbor_only = vec![1u8];
    cbor_only.extend(&payload);
    let mut identity = vec![2u8];
    identity.extend_from_slice(b"RBXMEM\0\0");
    identity.extend_from_slice(&0x1234u64.to_le_bytes());
    identity.extend_from_slice(&GUEST_LEN.to_le_bytes());
    let mut trailer = identity.clone();
    trailer[0] = 3;
    let mut dirty = vec![4u8];
    for (offset, len) in [(0u64, 4096u64), (8192 - 100, 200), (12288, 4096)] {
        dirty.extend_from_slice(&offset.to_le_bytes());
        dirty.extend_from_slice(&len.to_le_bytes());
    }
    vec![
        ("state-file".into(), with_header),
        ("state-cbor".into(), cbor_only),
        ("identity".into(), identity),
        ("trailer".into(), trailer),
        ("dirty-ranges".into(), dirty),
    ]
}
