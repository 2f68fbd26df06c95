//! Figures from measurements: a duration in milliseconds, and a summary of samples that names
//! what had none.

use std::time::Duration;

use super::error::LinuxBenchError;
use crate::stats::{summarize, Summary};

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn summary(what: &'static str, values: &[f64]) -> Result<Summary, LinuxBenchError> {
    summarize(values).ok_or(LinuxBenchError::NoSamples { what })
}
