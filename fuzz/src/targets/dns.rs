//! The resolver's DNS reader: a guest's query (`parse_query`) and an upstream's answer
//! (`parse_answer`, names with compression pointers). Besides panics, a readable A query
//! whose reply does not read back with the same address is a finding.

use std::net::Ipv4Addr;

use rollbox::net::dns;

use super::signature::shape;

pub fn run(data: &[u8]) -> u64 {
    let query = match dns::parse_query(data) {
        Ok(query) => {
            let addr = (Ipv4Addr::new(192, 0, 2, 1), 60);
            let reply = dns::build_reply(&query, dns::NOERROR, &[addr], dns::MAX_UDP);
            assert!(reply.len() <= dns::MAX_UDP, "a UDP reply over 512 bytes");
            let q = &query.question;
            if q.qtype == dns::TYPE_A && q.qclass == dns::CLASS_IN {
                let read = dns::parse_answer(&reply, query.id, &q.name)
                    .unwrap_or_else(|e| panic!("the reply to {q:?} does not read back: {e}"));
                assert_eq!(read.addresses, [addr], "the reply to {q:?}");
            }
            format!("query {}", q.qtype.min(2))
        }
        Err(e) => format!("{e:?}"),
    };
    let id = data
        .get(0..2)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let name = dns::read_name(data, 12).map(|(n, _)| n).unwrap_or_default();
    let answer = match dns::parse_answer(data, id, &name) {
        Ok(answer) => format!("answer {} {}", answer.rcode, answer.addresses.len().min(3)),
        Err(e) => format!("{e:?}"),
    };
    shape(&format!("{query} {answer}"))
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut answer = dns::build_query(7, "pypi.org", dns::TYPE_A);
    answer[2] |= 0x80;
    answer[7] = 2;
    // pypi.org CNAME x.example (at offset 38), x.example A 151.101.0.223.
    answer.extend_from_slice(&[0xC0, 12, 0, 5, 0, 1, 0, 0, 1, 44, 0, 11]);
    answer.extend_from_slice(b"\x01x\x07example\x00");
    answer.extend_from_slice(&[0xC0, 38, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 151, 101, 0, 223]);
    let mut looped = dns::build_query(1, "a.example", dns::TYPE_A);
    looped[2] |= 0x80;
    looped[7] = 1;
    let at = looped.len() as u8;
    looped.extend_from_slice(&[0xC0, at]);
    vec![
        (
            "query-a".into(),
            dns::build_query(0x1234, "PyPI.org", dns::TYPE_A),
        ),
        (
            "query-aaaa".into(),
            dns::build_query(9, "files.pythonhosted.org", 28),
        ),
        ("answer-cname".into(), answer),
        ("answer-loop".into(), looped),
    ]
}
