//! The node: POST /node/drain.

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::{bad, from_json};

/// The longest drain deadline: a week.
const MAX_DEADLINE_S: u64 = 7 * 24 * 3600;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    deadline_s: Option<u64>,
}

/// `{}` (drain until undrained) or `{"deadline_s": N}` (then end what is left); no body is `{}`.
pub fn parse_drain(body: &[u8]) -> Result<Action, ApiError> {
    let body: DrainBody = if body.is_empty() {
        DrainBody { deadline_s: None }
    } else {
        from_json(body)?
    };
    match body.deadline_s {
        Some(s) if s > MAX_DEADLINE_S => Err(bad(format!(
            "deadline_s: {s} is over {MAX_DEADLINE_S} (a week)"
        ))),
        deadline_s => Ok(Action::Drain { deadline_s }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_bodies() {
        assert_eq!(
            parse_drain(b"").expect("empty"),
            Action::Drain { deadline_s: None }
        );
        assert_eq!(
            parse_drain(br#"{"deadline_s": 30}"#).expect("deadline"),
            Action::Drain {
                deadline_s: Some(30)
            }
        );
        let err = parse_drain(br#"{"deadline_s": -1}"#).expect_err("negative");
        assert!(err.to_string().contains("deadline_s"), "{err}");
        let err = parse_drain(br#"{"deadline": 3}"#).expect_err("unknown field");
        assert!(err.to_string().contains("deadline"), "{err}");
        let err = parse_drain(br#"{"deadline_s": 99999999}"#).expect_err("too long");
        assert!(err.to_string().contains("deadline_s"), "{err}");
    }
}
