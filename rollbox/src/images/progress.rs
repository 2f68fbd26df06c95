//! Progress bars on stderr, shown only when stderr is a terminal.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Clone, Copy)]
pub struct Progress {
    enabled: bool,
}

impl Progress {
    pub fn new(enabled: bool) -> Self {
        Self { enabled }
    }

    /// Enabled when stderr is a terminal.
    pub fn for_stderr() -> Self {
        use std::io::IsTerminal as _;
        Self::new(std::io::stderr().is_terminal())
    }

    fn target(&self) -> ProgressDrawTarget {
        if self.enabled {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        }
    }

    pub fn bytes(&self, total: u64, message: String) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(Some(total), self.target());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:<28} [{bar:30}] {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta:>4}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message);
        bar
    }

    pub fn spinner(&self, message: String) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(None, self.target());
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
            bar.set_style(style);
        }
        bar.set_message(message);
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }
}
