//! A minimal DNS message reader and writer (RFC 1035) for the resolver: a guest's query
//! (header and one question), an upstream's answer (A and CNAME records, names with
//! compression pointers), and the replies the resolver builds. Everything is bounds-checked;
//! a name's pointers must each go below where the previous part of the name began, so a
//! hostile message cannot loop, and counts are only believed as far as the bytes go.

use std::net::Ipv4Addr;

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const CLASS_IN: u16 = 1;

pub const NOERROR: u8 = 0;
pub const FORMERR: u8 = 1;
pub const SERVFAIL: u8 = 2;
pub const NXDOMAIN: u8 = 3;
pub const REFUSED: u8 = 5;

/// The largest DNS message over UDP without EDNS.
pub const MAX_UDP: usize = 512;
/// A name on the wire: at most this many bytes.
const MAX_NAME_WIRE: usize = 255;
/// Compression pointers followed in one name, at most.
const MAX_POINTERS: usize = 64;
/// CNAME links followed from the question's name, at most.
const MAX_CNAMES: usize = 8;

const HEADER: usize = 12;
const FLAG_QR: u16 = 0x8000;
const FLAG_TC: u16 = 0x0200;
const FLAG_RD: u16 = 0x0100;
const FLAG_RA: u16 = 0x0080;

/// Why a DNS message was not read: names the part at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DnsError {
    #[error("DNS message ends inside its {0}")]
    Truncated(&'static str),
    #[error("DNS message: {0}")]
    Malformed(&'static str),
    #[error("DNS answer does not match the question: {0}")]
    Mismatch(&'static str),
}

fn u16_at(msg: &[u8], at: usize, part: &'static str) -> Result<u16, DnsError> {
    match msg.get(at..at + 2) {
        Some(&[a, b]) => Ok(u16::from_be_bytes([a, b])),
        _ => Err(DnsError::Truncated(part)),
    }
}

fn u32_at(msg: &[u8], at: usize, part: &'static str) -> Result<u32, DnsError> {
    match msg.get(at..at + 4) {
        Some(&[a, b, c, d]) => Ok(u32::from_be_bytes([a, b, c, d])),
        _ => Err(DnsError::Truncated(part)),
    }
}

/// Reads the name at `start`: (lowercase, dot-separated, no trailing dot; the root is ""),
/// and the offset just past it where it starts (past its first pointer, if any).
pub fn read_name(msg: &[u8], start: usize) -> Result<(String, usize), DnsError> {
    let mut name = String::new();
    let mut pos = start;
    // Where the part being read began: each pointer must go below it, so reading ends.
    let mut segment = start;
    let mut end = None;
    let mut wire = 0usize;
    let mut pointers = 0;
    loop {
        let len = *msg.get(pos).ok_or(DnsError::Truncated("name"))?;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Ok((name, end.unwrap_or(pos + 1)));
            }
            0x00 => {
                let len = usize::from(len);
                let label = msg
                    .get(pos + 1..pos + 1 + len)
                    .ok_or(DnsError::Truncated("name"))?;
                wire += len + 1;
                if wire + 1 > MAX_NAME_WIRE {
                    return Err(DnsError::Malformed("a name over 255 bytes"));
                }
                if label.iter().any(|&b| b == b'.' || !b.is_ascii_graphic()) {
                    return Err(DnsError::Malformed(
                        "a label byte that is not printable ASCII",
                    ));
                }
                if !name.is_empty() {
                    name.push('.');
                }
                name.extend(label.iter().map(|b| char::from(b.to_ascii_lowercase())));
                pos += 1 + len;
            }
            0xC0 => {
                let low = *msg.get(pos + 1).ok_or(DnsError::Truncated("name"))?;
                let target = usize::from(u16::from_be_bytes([len & 0x3F, low]));
                end.get_or_insert(pos + 2);
                pointers += 1;
                if target >= segment || pointers > MAX_POINTERS {
                    return Err(DnsError::Malformed(
                        "a compression pointer that does not go backwards",
                    ));
                }
                segment = target;
                pos = target;
            }
            _ => return Err(DnsError::Malformed("a label type other than 0 or 3")),
        }
    }
}

/// A question: the name read, and its bytes as sent (the guest's letter case kept: some
/// resolvers check it in the reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    pub wire: Vec<u8>,
}

/// A guest's query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    pub recursion_desired: bool,
    pub question: Question,
}

/// The id of a message long enough to have a header and that is a query (for a FORMERR).
pub fn query_id(msg: &[u8]) -> Option<u16> {
    let flags = u16_at(msg, 2, "header").ok()?;
    if flags & FLAG_QR != 0 {
        return None;
    }
    u16_at(msg, 0, "header").ok()
}

/// A record of an answer that the resolver uses.
enum Record {
    A(Ipv4Addr),
    Cname(String),
}

/// Reads a query: a standard query (opcode 0) with exactly one question whose name is not
/// compressed. Other sections (an EDNS OPT record) are ignored.
pub fn parse_query(msg: &[u8]) -> Result<Query, DnsError> {
    let id = u16_at(msg, 0, "header")?;
    let flags = u16_at(msg, 2, "header")?;
    if flags & FLAG_QR != 0 {
        return Err(DnsError::Malformed("a response where a query was expected"));
    }
    if (flags >> 11) & 0xF != 0 {
        return Err(DnsError::Malformed("an opcode other than QUERY"));
    }
    if u16_at(msg, 4, "header")? != 1 {
        return Err(DnsError::Malformed("a query without exactly one question"));
    }
    let mut pos = HEADER;
    // The question's name, uncompressed (nothing precedes it to point to).
    loop {
        let len = *msg.get(pos).ok_or(DnsError::Truncated("question"))?;
        if len & 0xC0 != 0 {
            return Err(DnsError::Malformed("a compressed question"));
        }
        pos += 1 + usize::from(len);
        if len == 0 {
            break;
        }
    }
    let (name, end) = read_name(msg, HEADER)?;
    debug_assert_eq!(end, pos);
    let qtype = u16_at(msg, end, "question")?;
    let qclass = u16_at(msg, end + 2, "question")?;
    Ok(Query {
        id,
        recursion_desired: flags & FLAG_RD != 0,
        question: Question {
            name,
            qtype,
            qclass,
            wire: msg[HEADER..end + 4].to_vec(),
        },
    })
}

/// An upstream's answer to an A question, as far as the resolver uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub rcode: u8,
    /// The answer did not fit (TC): ask again over TCP.
    pub truncated: bool,
    /// The A records of the question's name or of the names its CNAMEs lead to, with TTLs.
    pub addresses: Vec<(Ipv4Addr, u32)>,
}

/// Reads an upstream's answer to the query `id` for `name` (type A, class IN).
pub fn parse_answer(msg: &[u8], id: u16, name: &str) -> Result<Answer, DnsError> {
    if u16_at(msg, 0, "header")? != id {
        return Err(DnsError::Mismatch("another id"));
    }
    let flags = u16_at(msg, 2, "header")?;
    if flags & FLAG_QR == 0 {
        return Err(DnsError::Malformed("a query where a response was expected"));
    }
    let truncated = flags & FLAG_TC != 0;
    let rcode = (flags & 0xF) as u8;
    let questions = u16_at(msg, 4, "header")?;
    let answers = u16_at(msg, 6, "header")?;
    if questions != 1 {
        return Err(DnsError::Mismatch("not exactly one question"));
    }
    let (qname, end) = read_name(msg, HEADER)?;
    if qname != name
        || u16_at(msg, end, "question")? != TYPE_A
        || u16_at(msg, end + 2, "question")? != CLASS_IN
    {
        return Err(DnsError::Mismatch("another question"));
    }
    let mut pos = end + 4;
    let mut records = Vec::new();
    for _ in 0..answers {
        if truncated && pos >= msg.len() {
            break;
        }
        let (owner, at) = read_name(msg, pos)?;
        let rtype = u16_at(msg, at, "record")?;
        let class = u16_at(msg, at + 2, "record")?;
        let ttl = u32_at(msg, at + 4, "record")?;
        let len = usize::from(u16_at(msg, at + 8, "record")?);
        let data = at + 10;
        let rdata = msg
            .get(data..data + len)
            .ok_or(DnsError::Truncated("record data"))?;
        if class == CLASS_IN {
            match (rtype, rdata) {
                (TYPE_A, &[a, b, c, d]) => {
                    records.push((owner, Record::A(Ipv4Addr::new(a, b, c, d)), ttl))
                }
                (TYPE_CNAME, _) => {
                    let (target, target_end) = read_name(msg, data)?;
                    if target_end > data + len {
                        return Err(DnsError::Malformed("a CNAME longer than its data"));
                    }
                    records.push((owner, Record::Cname(target), ttl));
                }
                _ => {}
            }
        }
        pos = data + len;
    }
    // The question's name and where its CNAMEs lead (a bounded walk: loops end).
    let mut names = vec![name.to_string()];
    for _ in 0..MAX_CNAMES {
        let Some(next) = records.iter().find_map(|(owner, record, _)| match record {
            Record::Cname(target) if names.last() == Some(owner) && !names.contains(target) => {
                Some(target.clone())
            }
            _ => None,
        }) else {
            break;
        };
        names.push(next);
    }
    let addresses = records
        .iter()
        .filter_map(|(owner, record, ttl)| match record {
            Record::A(addr) if names.contains(owner) => Some((*addr, *ttl)),
            _ => None,
        })
        .collect();
    Ok(Answer {
        rcode,
        truncated,
        addresses,
    })
}

/// A query for `name`, type `qtype`, class IN, recursion desired: what the resolver sends
/// upstream (its own id and name; nothing of the guest's message).
pub fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut msg = Vec::with_capacity(HEADER + name.len() + 6);
    msg.extend_from_slice(&id.to_be_bytes());
    msg.extend_from_slice(&FLAG_RD.to_be_bytes());
    msg.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        // Names come from `read_name` or a checked policy: labels of 1-63 bytes.
        msg.push(label.len().min(63) as u8);
        msg.extend_from_slice(&label.as_bytes()[..label.len().min(63)]);
    }
    msg.push(0);
    msg.extend_from_slice(&qtype.to_be_bytes());
    msg.extend_from_slice(&CLASS_IN.to_be_bytes());
    msg
}

/// The reply to `query`: `rcode` and, as answers to its own name, `addresses` (as many as
/// fit in `max_len` bytes; TC is set when some did not).
pub fn build_reply(
    query: &Query,
    rcode: u8,
    addresses: &[(Ipv4Addr, u32)],
    max_len: usize,
) -> Vec<u8> {
    const RECORD: usize = 16;
    let room = max_len.saturating_sub(HEADER + query.question.wire.len()) / RECORD;
    let count = addresses.len().min(room).min(usize::from(u16::MAX));
    let mut flags = FLAG_QR | FLAG_RA | u16::from(rcode & 0xF);
    if query.recursion_desired {
        flags |= FLAG_RD;
    }
    if count < addresses.len() {
        flags |= FLAG_TC;
    }
    let mut msg = Vec::with_capacity(HEADER + query.question.wire.len() + count * RECORD);
    msg.extend_from_slice(&query.id.to_be_bytes());
    msg.extend_from_slice(&flags.to_be_bytes());
    msg.extend_from_slice(&1u16.to_be_bytes());
    msg.extend_from_slice(&(count as u16).to_be_bytes());
    msg.extend_from_slice(&[0, 0, 0, 0]);
    msg.extend_from_slice(&query.question.wire);
    for (addr, ttl) in &addresses[..count] {
        // The owner is the question's name, at offset 12.
        msg.extend_from_slice(&[0xC0, 0x0C]);
        msg.extend_from_slice(&TYPE_A.to_be_bytes());
        msg.extend_from_slice(&CLASS_IN.to_be_bytes());
        msg.extend_from_slice(&ttl.to_be_bytes());
        msg.extend_from_slice(&4u16.to_be_bytes());
        msg.extend_from_slice(&addr.octets());
    }
    msg
}

/// A header-only FORMERR for a message that is a query but could not be read.
pub fn build_formerr(id: u16) -> Vec<u8> {
    let flags = FLAG_QR | FLAG_RA | u16::from(FORMERR);
    let mut msg = id.to_be_bytes().to_vec();
    msg.extend_from_slice(&flags.to_be_bytes());
    msg.extend_from_slice(&[0; 8]);
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as a server writes it: the question, then records with compressed owners.
    fn answer(id: u16, name: &str, records: &[(&[u8], u16, u32, Vec<u8>)]) -> Vec<u8> {
        let mut msg = build_query(id, name, TYPE_A);
        msg[2] |= 0x80;
        msg[7] = records.len() as u8;
        for (owner, rtype, ttl, data) in records {
            msg.extend_from_slice(owner);
            msg.extend_from_slice(&rtype.to_be_bytes());
            msg.extend_from_slice(&CLASS_IN.to_be_bytes());
            msg.extend_from_slice(&ttl.to_be_bytes());
            msg.extend_from_slice(&(data.len() as u16).to_be_bytes());
            msg.extend_from_slice(data);
        }
        msg
    }

    #[test]
    fn a_query_round_trips_and_keeps_the_guests_case() {
        let mut msg = build_query(0x1234, "PyPI.org", 28);
        msg.extend_from_slice(&[0, 0, 41, 4, 0, 0, 0, 0, 0, 0, 0]); // an EDNS OPT, ignored
        msg[11] = 1;
        let query = parse_query(&msg).unwrap();
        assert_eq!(query.id, 0x1234);
        assert_eq!(query.question.name, "pypi.org");
        assert_eq!(query.question.qtype, 28);
        assert!(query.recursion_desired);
        assert_eq!(&query.question.wire[1..5], b"PyPI");
        let reply = build_reply(&query, NOERROR, &[(Ipv4Addr::new(1, 2, 3, 4), 300)], 512);
        assert_eq!(&reply[0..2], &[0x12, 0x34]);
        assert_eq!(reply[3] & 0xF, NOERROR);
        assert_eq!(u16::from_be_bytes([reply[6], reply[7]]), 1);
        assert!(reply.ends_with(&[0, 0, 1, 44, 0, 4, 1, 2, 3, 4]));
        // A reply that does not fit in 512 bytes is cut, with TC set.
        let many: Vec<(Ipv4Addr, u32)> = (0..40).map(|i| (Ipv4Addr::new(1, 1, 1, i), 60)).collect();
        let cut = build_reply(&query, NOERROR, &many, MAX_UDP);
        assert!(cut.len() <= MAX_UDP);
        assert_ne!(cut[2] & 0x02, 0);
    }

    #[test]
    fn answers_follow_cnames_and_compression() {
        // pypi.org CNAME dualstack.x.example (at 38, after the first record's fixed part), whose A records
        // follow; an A record for another name is not taken.
        let target = b"\x09dualstack\x01x\x07example\x00".to_vec();
        let msg = answer(
            7,
            "pypi.org",
            &[
                (&[0xC0, 12], TYPE_CNAME, 300, target),
                (&[0xC0, 38], TYPE_A, 60, vec![151, 101, 0, 223]),
                (&[0xC0, 38], TYPE_A, 30, vec![151, 101, 64, 223]),
                (b"\x05other\x03org\x00", TYPE_A, 60, vec![6, 6, 6, 6]),
                (&[0xC0, 12], 28, 60, vec![0; 16]),
            ],
        );
        let got = parse_answer(&msg, 7, "pypi.org").unwrap();
        assert_eq!(
            got.addresses,
            [
                (Ipv4Addr::new(151, 101, 0, 223), 60),
                (Ipv4Addr::new(151, 101, 64, 223), 30)
            ]
        );
        assert_eq!(got.rcode, NOERROR);
        assert_eq!(
            parse_answer(&msg, 8, "pypi.org").unwrap_err(),
            DnsError::Mismatch("another id")
        );
        assert_eq!(
            parse_answer(&msg, 7, "pypi.com").unwrap_err(),
            DnsError::Mismatch("another question")
        );
    }

    #[test]
    fn hostile_messages_are_refused_not_followed() {
        // Every prefix of a good answer: an error, never a panic.
        let good = answer(
            1,
            "a.example",
            &[(&[0xC0, 12], TYPE_A, 1, vec![1, 2, 3, 4])],
        );
        for len in 0..good.len() {
            assert!(parse_answer(&good[..len], 1, "a.example").is_err(), "{len}");
            let _ = parse_query(&good[..len]);
        }
        // A pointer to itself, and two pointing at each other.
        let mut looped = build_query(1, "a.example", TYPE_A);
        looped[2] |= 0x80;
        looped[7] = 1;
        let at = looped.len();
        looped.extend_from_slice(&[0xC0, at as u8]);
        assert!(matches!(
            parse_answer(&looped, 1, "a.example"),
            Err(DnsError::Malformed(_))
        ));
        let mut pair = vec![0u8; 12];
        pair.extend_from_slice(&[1, b'a', 0xC0, 16, 1, b'b', 0xC0, 12]);
        assert!(read_name(&pair, 12).is_err());
        assert!(read_name(&pair, 16).is_err());
        // Huge counts with no records behind them.
        let mut counts = build_query(1, "a.example", TYPE_A);
        counts[2] |= 0x80;
        counts[6] = 0xFF;
        counts[7] = 0xFF;
        assert_eq!(
            parse_answer(&counts, 1, "a.example").unwrap_err(),
            DnsError::Truncated("name")
        );
        // A name over 255 bytes through pointers.
        let mut long = vec![0u8; 12];
        long.push(63);
        long.extend_from_slice(&[b'a'; 63]);
        for i in 0..4 {
            long.push(63);
            long.extend_from_slice(&[b'a'; 63]);
            let _ = i;
        }
        long.push(0);
        assert_eq!(
            read_name(&long, 12).unwrap_err(),
            DnsError::Malformed("a name over 255 bytes")
        );
        // Queries: compressed, two questions, a response, another opcode, odd bytes.
        let mut compressed = build_query(1, "a.example", TYPE_A);
        compressed[12] = 0xC0;
        assert_eq!(
            parse_query(&compressed).unwrap_err(),
            DnsError::Malformed("a compressed question")
        );
        let mut two = build_query(1, "a.example", TYPE_A);
        two[5] = 2;
        assert!(parse_query(&two).is_err());
        let mut response = build_query(1, "a.example", TYPE_A);
        response[2] |= 0x80;
        assert!(parse_query(&response).is_err());
        assert_eq!(query_id(&response), None);
        let mut notify = build_query(1, "a.example", TYPE_A);
        notify[2] |= 4 << 3;
        assert!(parse_query(&notify).is_err());
        assert_eq!(query_id(&notify), Some(1));
        let odd = build_query(1, "a\u{7f}b.example", TYPE_A);
        assert!(parse_query(&odd).is_err());
        let dotted = build_query(1, "x", TYPE_A);
        let mut dotted = dotted;
        dotted[13] = b'.';
        assert!(parse_query(&dotted).is_err());
        assert_eq!(build_formerr(9)[3] & 0xF, FORMERR);
    }

    #[test]
    fn a_cname_loop_ends() {
        let a = b"\x01a\x07example\x00".to_vec();
        let b = b"\x01b\x07example\x00".to_vec();
        let msg = answer(
            3,
            "a.example",
            &[
                (&[0xC0, 12], TYPE_CNAME, 1, b.clone()),
                (&b, TYPE_CNAME, 1, a),
                (&b, TYPE_A, 5, vec![9, 9, 9, 9]),
            ],
        );
        let got = parse_answer(&msg, 3, "a.example").unwrap();
        assert_eq!(got.addresses, [(Ipv4Addr::new(9, 9, 9, 9), 5)]);
    }
}
