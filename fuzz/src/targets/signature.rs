//! Outcome signatures: what makes two fuzz results count as one outcome.

use std::hash::{DefaultHasher, Hash, Hasher};

/// A signature of a result's text without digits and without quoted parts (which echo the
/// input), so "offset 12" and "offset 13", or two unknown fields, count as one outcome.
pub fn shape(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    let mut quoted = None;
    for c in text.chars().take(400) {
        match (quoted, c) {
            (None, '"' | '`' | '\'') => quoted = Some(c),
            (Some(q), c) if c == q => quoted = None,
            (None, c) if !c.is_ascii_digit() => c.hash(&mut h),
            _ => {}
        }
    }
    h.finish()
}

/// A signature of raw bytes.
pub fn bytes_signature(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_ignores_digits_and_quoted_input() {
        assert_eq!(shape("offset 12"), shape("offset 13"));
        assert_eq!(shape("unknown field `abc`"), shape("unknown field `xyz`"));
        assert_ne!(shape("offset 12"), shape("length 12"));
    }
}
